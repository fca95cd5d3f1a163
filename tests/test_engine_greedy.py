"""Greedy speculative output is token-for-token the target's own greedy output."""
import functools
import random

import pytest

from models import ShiftedDraft, hf_greedy, perturbed, tiny_gpt2, tiny_llama, tiny_qwen2
from specserve import SamplingParams, SpeculativeEngine

MAX_NEW = 24


def prompts(batch: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed + batch)
    return [[rng.randrange(1, 96) for _ in range(rng.choice([1, 3, 9, 17, 40]))] for _ in range(batch)]


@functools.lru_cache(maxsize=None)
def reference(model_key: str, prompt: tuple[int, ...]) -> list[int]:
    return hf_greedy(MODELS[model_key](), list(prompt), MAX_NEW)


MODELS = {
    "llama": functools.lru_cache(None)(lambda: tiny_llama(0)),
    "llama-eager": functools.lru_cache(None)(lambda: tiny_llama(0, attn="eager")),
    "gpt2": functools.lru_cache(None)(lambda: tiny_gpt2(0)),
    "qwen2": functools.lru_cache(None)(lambda: tiny_qwen2(0)),
}
DRAFTS = {
    "always-wrong": lambda t: ShiftedDraft(t),
    "equal": lambda t: t,
    "ordinary": lambda t: perturbed(t, 0.6, seed=1),
}


def check_greedy(model_key: str, draft_kind: str, gamma: int, batch: int) -> None:
    target = MODELS[model_key]()
    engine = SpeculativeEngine(target, DRAFTS[draft_kind](target), num_speculative_tokens=gamma, adaptive=False)
    batch_prompts = prompts(batch)
    outs = engine.generate(batch_prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    for prompt, out in zip(batch_prompts, outs):
        assert out.token_ids == reference(model_key, tuple(prompt)), (prompt, draft_kind, gamma)
        assert out.finish_reason == "length"
    total_draft = sum(o.metrics.num_draft_tokens for o in outs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    assert total_draft > 0
    if draft_kind == "always-wrong":
        assert accepted == 0
    if draft_kind == "equal":
        assert accepted == total_draft  # a draft equal to the target is always accepted


@pytest.mark.parametrize("draft_kind", sorted(DRAFTS))
@pytest.mark.parametrize("gamma", [1, 2, 4, 7])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_greedy_identical_to_target(draft_kind, gamma, batch):
    check_greedy("llama", draft_kind, gamma, batch)


@pytest.mark.parametrize("model_key", ["gpt2", "qwen2", "llama-eager"])
@pytest.mark.parametrize("draft_kind", ["ordinary", "equal"])
def test_greedy_other_families(model_key, draft_kind):
    check_greedy(model_key, draft_kind, 3, 3)


def test_ordinary_draft_is_partly_accepted():
    target = MODELS["llama"]()
    engine = SpeculativeEngine(target, DRAFTS["ordinary"](target), num_speculative_tokens=4, adaptive=False)
    outs = engine.generate(prompts(8), SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    rate = sum(o.metrics.num_accepted_tokens for o in outs) / sum(o.metrics.num_draft_tokens for o in outs)
    assert 0.05 < rate < 0.95, rate  # the test above really exercises partial acceptance


def test_target_only_baseline_matches():
    target = MODELS["llama"]()
    engine = SpeculativeEngine(target, None, num_speculative_tokens=0)
    batch_prompts = prompts(3)
    outs = engine.generate(batch_prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    for prompt, out in zip(batch_prompts, outs):
        assert out.token_ids == reference("llama", tuple(prompt))
        assert out.metrics.num_draft_tokens == 0 and out.metrics.num_steps == MAX_NEW


def test_adaptive_greedy_identical():
    target = MODELS["llama"]()
    engine = SpeculativeEngine(target, DRAFTS["ordinary"](target), num_speculative_tokens=6, adaptive=True)
    batch_prompts = prompts(8, seed=5)
    outs = engine.generate(batch_prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    for prompt, out in zip(batch_prompts, outs):
        assert out.token_ids == reference("llama", tuple(prompt))
