"""Drafters beyond a separate draft model: layer skip (self-speculative) and prompt lookup (n-gram).

Both must be lossless like any drafter: greedy output identical to the target's own, and sampled
output following the target's distribution (the chi-square test of test_sampling_distribution,
run through each drafter).
"""
import functools
import random

import pytest
import torch

from models import hf_greedy, tiny_llama
from specserve import SamplingParams, SpeculativeEngine
from specserve.engine import RowInput
from specserve.engine.model_runner import CacheMiss
from specserve.engine import lookup
from specserve.engine.lookup import TokenStore
from specserve.engine.proposers import (
    DraftModelProposer, LayerSkipProposer, LayerSkipSpec, PromptLookupProposer, PromptLookupSpec,
    layer_skip_view, target_vocab_size,
)
from specserve.engine.sampling import BatchSampling
from test_sampling_distribution import VOCAB, assert_proposer_follows_target

MAX_NEW = 24
LAYERS = 4
SPECS = {
    "layer-skip": LayerSkipSpec((1, 2)),
    "prompt-lookup": PromptLookupSpec(min_n=1, max_n=3),
}


@functools.lru_cache(maxsize=None)
def target():
    return tiny_llama(0, layers=LAYERS)


def prompts(batch: int, seed: int = 0) -> list[list[int]]:
    """Random prompts, some with repeats in them (where prompt lookup finds something to copy)."""
    rng = random.Random(seed + batch)
    out = []
    for _ in range(batch):
        piece = [rng.randrange(1, 96) for _ in range(rng.choice([1, 3, 9, 17]))]
        out.append(piece * rng.choice([1, 2, 3]))
    return out


@functools.lru_cache(maxsize=None)
def reference(prompt: tuple[int, ...]) -> list[int]:
    return hf_greedy(target(), list(prompt), MAX_NEW)


def build(spec, model):
    return spec.build(model, target_vocab_size(model), None)


# -- lossless ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("drafter", sorted(SPECS))
@pytest.mark.parametrize("gamma", [1, 3, 5])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_identical_to_hf_generate(drafter, gamma, batch):
    model = target()
    engine = SpeculativeEngine(model, proposer=build(SPECS[drafter], model), num_speculative_tokens=gamma,
                               adaptive=False)
    batch_prompts = prompts(batch)
    outs = engine.generate(batch_prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    for prompt, out in zip(batch_prompts, outs):
        assert out.token_ids == reference(tuple(prompt)), (drafter, gamma, prompt)
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0  # really speculating, not just running


def test_adaptive_greedy_identical():
    model = target()
    for spec in SPECS.values():
        engine = SpeculativeEngine(model, proposer=build(spec, model), num_speculative_tokens=5, adaptive=True)
        batch_prompts = prompts(6, seed=3)
        outs = engine.generate(batch_prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
        assert [o.token_ids for o in outs] == [reference(tuple(p)) for p in batch_prompts], spec


@pytest.fixture(scope="module")
def small_target():
    """The vocabulary-8 model family of the distribution test, with layers to skip."""
    return tiny_llama(0, vocab=VOCAB, init_range=0.3, layers=3, hidden=16)


@pytest.mark.parametrize("spec", [LayerSkipSpec((1,)), PromptLookupSpec(min_n=1, max_n=2)], ids=repr)
def test_sampling_matches_target_distribution(small_target, spec):
    assert_proposer_follows_target(small_target, build(spec, small_target))


# -- prompt lookup ----------------------------------------------------------------------------------
def find_continuation(tokens: list[int], min_n: int, max_n: int) -> int | None:
    """The full search (the specification `TokenStore.find` keeps): index j < L where the
    continuation of the best earlier match of the suffix starts, or None. The match ending just
    before j is the longest (up to max_n, at least min_n) that equals the suffix; ties go to the
    largest j (the most recent occurrence)."""
    length = len(tokens)
    cap = min(max_n, length - 1)
    best, found = 0, None
    for j in range(length):  # the earlier occurrence ends at j - 1 (overlapping the suffix is fine)
        k = 0
        while k < cap and j - 1 - k >= 0 and tokens[j - 1 - k] == tokens[length - 1 - k]:
            k += 1
        if k >= max(best, min_n):
            best, found = k, j
    return found


def store_find(tokens: list[int], min_n: int, max_n: int) -> int | None:
    store = TokenStore(min_n, max_n)
    store.rewrite("a", 0, tokens)
    return store.find("a")


@pytest.mark.parametrize("find", [find_continuation, store_find])
def test_lookup_prefers_longest_then_most_recent(find):
    #        0  1  2  3  4  5  6  7  8  9
    seq = [1, 2, 3, 9, 5, 3, 7, 1, 2, 3]
    assert find(seq, 1, 3) == 3  # "1 2 3" at 0..2 beats the more recent "3" at 5
    assert find(seq, 1, 1) == 6  # unigrams only: the most recent earlier "3"
    assert find(seq, 4, 5) is None  # no earlier 4-gram
    assert find([4], 1, 3) is None
    assert find([7, 7], 1, 3) == 1  # overlapping occurrence


@pytest.mark.parametrize("min_n, max_n", [(1, 3), (2, 2), (3, 8)])
def test_the_index_finds_what_the_full_search_finds_as_tokens_come_and_go(monkeypatch, min_n, max_n):
    """Tokens appended and cut back at random (accepted tokens, rolled-back drafts, a preempted
    request prefilled again from an earlier point), several requests interleaved: after every
    change each request's lookup equals the full search over its tokens (no bound on the
    occurrences looked at)."""
    monkeypatch.setattr(lookup, "CANDIDATES", 10**9)
    rng = random.Random(min_n * 10 + max_n)
    store, held = TokenStore(min_n, max_n), {}
    for step in range(3000):
        rid = f"r{rng.randrange(3)}"
        seq = held.setdefault(rid, [])
        start = max(0, len(seq) - rng.choice([0, 0, 1, 3, 5, 40]))
        tokens = [rng.randrange(4) for _ in range(rng.choice([1, 1, 2, 4, 7]))]
        seq[start:] = tokens
        assert store.rewrite(rid, start, tokens) == seq
        if rng.random() < 0.7:
            assert store.find(rid) == find_continuation(seq, min_n, max_n), (step, seq)
        if len(seq) > 300:
            store.free(rid)
            held.pop(rid)


def test_a_lookup_extends_the_most_recent_occurrences_only():
    """Past CANDIDATES occurrences of the suffix's min_n tokens, a longer match further back is
    not found: the best among the most recent ones is (what bounds a lookup's cost)."""
    far = [1, 2, 3, 4]  # the suffix's 4-token match, far back
    recent = [9, 3, 4] * lookup.CANDIDATES  # the suffix's last 2 tokens, then one more, many times
    tokens = far + [7] + recent + [1, 2, 3, 4]
    assert find_continuation(tokens, 2, 4) == 4
    assert store_find(tokens, 2, 4) == len(tokens) - 4  # the latest "3 4" (a 2-token match)
    assert store_find(far + [7] + recent[: 3 * (lookup.CANDIDATES - 1)] + [1, 2, 3, 4], 2, 4) == 4


def test_prompt_lookup_proposes_the_continuation():
    proposer = PromptLookupProposer(vocab_size=50, min_n=2, max_n=3)
    text = [10, 11, 12, 13, 14, 20, 30, 10, 11, 12]
    greedy = BatchSampling.from_params([SamplingParams(temperature=0.0)])
    proposal = proposer.propose([RowInput("a", 0, text)], 4, greedy, None)
    assert proposal.tokens.tolist() == [[13, 14, 20, 30]]
    assert proposal.probs is None
    assert proposer.valid_length("a") == len(text) + 3  # its tokens + the first G-1 drafts

    # Two drafts accepted, the target said 99: the caller resends from len(text) + 2.
    proposal = proposer.propose([RowInput("a", len(text) + 2, [99])], 3, greedy, None)
    assert proposer._tokens["a"] == text + [13, 14, 99] + proposal.tokens[0, :2].tolist()
    with pytest.raises(CacheMiss):
        proposer.propose([RowInput("a", proposer.valid_length("a") + 1, [1])], 2, greedy, None)


def test_prompt_lookup_repeats_a_pattern_and_falls_back_cheaply():
    proposer = PromptLookupProposer(vocab_size=50, min_n=1, max_n=3)
    sampling = BatchSampling.from_params([SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)])
    rows = [RowInput("cycle", 0, [5, 6, 5, 6]), RowInput("fresh", 0, [1, 2, 3, 4])]
    proposal = proposer.propose(rows, 5, sampling, torch.rand(2, 5))
    assert proposal.tokens.tolist() == [[5, 6, 5, 6, 5], [4, 4, 4, 4, 4]]
    # Deterministic drafts carry no q even when a row samples: the rule treats q as one-hot.
    assert proposal.probs is None and proposal.deterministic
    assert (proposer.num_lookups, proposer.num_matches) == (2, 1)
    proposer.free("cycle")
    assert proposer.valid_length("cycle") == 0


def test_prompt_lookup_accepts_repeats():
    """The tiny target falls into a loop after its prompt; once it does, lookup drafts are accepted."""
    model = target()
    prompt = prompts(1)[0]
    engine = SpeculativeEngine(model, proposer=build(SPECS["prompt-lookup"], model), num_speculative_tokens=4,
                               adaptive=False)
    result = engine.generate([prompt], SamplingParams(max_tokens=2 * MAX_NEW, temperature=0.0))[0]
    assert result.token_ids == hf_greedy(model, prompt, 2 * MAX_NEW)
    assert result.metrics.acceptance_rate > 0.5
    assert result.metrics.num_steps < MAX_NEW  # fewer than half the target-only steps


# -- layer skip -------------------------------------------------------------------------------------
def test_layer_skip_with_nothing_skipped_is_the_target():
    model = target()
    proposer = build(LayerSkipSpec(()), model)
    engine = SpeculativeEngine(model, proposer=proposer, num_speculative_tokens=3, adaptive=False)
    outs = engine.generate(prompts(3), SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    assert drafted > 0 and sum(o.metrics.num_accepted_tokens for o in outs) == drafted  # 100%


def test_layer_skip_view_shares_weights_and_caches_kept_layers_only():
    model = target()
    proposer = LayerSkipProposer(model, [2, 1], target_vocab_size(model))
    assert isinstance(proposer, DraftModelProposer) and proposer.skip_layers == (1, 2)
    view = proposer.runner.model
    kept = list(view.model.layers)
    assert [m.self_attn.layer_idx for m in kept] == [0, 3]
    assert all(a is b for a, b in zip(kept, [model.model.layers[0], model.model.layers[3]]))
    assert view.lm_head is model.lm_head and view.model.embed_tokens is model.model.embed_tokens
    assert len(model.model.layers) == LAYERS  # target untouched
    view_params = {p.data_ptr() for p in view.parameters()}
    assert view_params <= {p.data_ptr() for p in model.parameters()}  # no weight copied

    proposer.propose([RowInput("r", 0, [1, 2, 3])], 2, BatchSampling.from_params([SamplingParams(temperature=0)]), None)
    allocated = [i for i, k in enumerate(proposer.runner.cache._keys) if k is not None]
    assert allocated == [0, 3]

    with torch.no_grad():  # the view computes what a model built from the kept layers computes
        ids = torch.tensor([[5, 6, 7, 8]])
        hidden = model.model.embed_tokens(ids)
        positions = torch.arange(4)[None]
        rope = model.model.rotary_emb(hidden, position_ids=positions)
        mask = torch.ones(1, 1, 4, 4, dtype=torch.bool).tril()
        for layer in kept:
            hidden = layer(hidden, attention_mask=mask, position_embeddings=rope, position_ids=positions)
        expected = model.lm_head(model.model.norm(hidden))
        assert torch.allclose(view(input_ids=ids).logits, expected, atol=1e-5)


def test_layer_skip_spec_validation():
    assert LayerSkipSpec((3, 1, 3)).skip_layers == (1, 3)
    assert LayerSkipSpec.every_other(6).skip_layers == (1, 3, 5)
    with pytest.raises(ValueError):
        layer_skip_view(target(), [LAYERS])
    with pytest.raises(ValueError):
        layer_skip_view(target(), range(LAYERS))  # nothing left to run
    with pytest.raises(ValueError):
        PromptLookupSpec(min_n=3, max_n=2)
