"""`kind: random` model sources (load tests without weights): named and given shapes, seeded weights
made in their dtype, and speculation over them as lossless as over any model, in process and through
the coordinator with its real workers."""
from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from models import hf_greedy
from specserve import SamplingParams, SpeculativeEngine
from specserve.config import RANDOM_SHAPES, AppConfig, RandomSource
from specserve.engine.attention import Windows, windows_of
from specserve.models.loading import load_draft, load_target, load_tokenizer

SHAPE = {"model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
GREEDY = SamplingParams(temperature=0.0, max_tokens=20)
# Gemma 3's layers, windowed and full, a window of 4 that the requests' contexts pass
WINDOWED = {"model_type": "gemma3_text", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "max_position_embeddings": 256, "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]}


def test_named_and_given_shapes_validate_and_unknown_ones_are_refused():
    assert RandomSource(shape="llama-7b").config_fields()["hidden_size"] == 4096
    assert set(RANDOM_SHAPES) == {"llama-7b", "llama-1b", "mistral-7b", "gemma3-12b"}
    config = AppConfig.model_validate({"served_model_name": "r", "target": {"kind": "random", "shape": SHAPE, "dtype": "float32"},
                                       "draft": {"kind": "random", "shape": SHAPE, "seed": 1, "dtype": "float32"}})
    assert isinstance(config.target, RandomSource) and config.draft.seed == 1
    with pytest.raises(ValidationError, match="not one of"):
        RandomSource(shape="llama-70b")
    with pytest.raises(ValidationError, match="model_type"):
        RandomSource(shape={"hidden_size": 64})


def test_the_mistral_shape_is_served_with_its_window():
    """Mistral-7B-v0.1's shape, built on the meta device (no memory): its runner masks every layer
    to the last 4096 positions, which contexts up to its 32768 reach past."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = RandomSource(shape="mistral-7b").config_fields()
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    assert sum(p.numel() for p in model.parameters()) == 7_241_732_096  # Mistral-7B-v0.1's count
    assert windows_of(model.config, 32768) == Windows(4096, by_type=False)


def test_the_gemma3_shape_has_its_windowed_and_full_layers():
    """Gemma 3 12B's text shape on the meta device: 11.77B parameters with the embedding tied as
    Gemma ties it (its output head untied here, for peaked weights: 1.01B more); 40 of its 48 layers
    attend the last 1024 positions, the others everything, so a paged runner keeps a pool per kind."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = RandomSource(shape="gemma3-12b").config_fields()
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    head = model.lm_head.weight.numel()
    assert sum(p.numel() for p in model.parameters()) - head == 11_766_034_176
    windows = windows_of(model.config, 8192)
    assert windows.window == 1024 and windows.horizon is None
    assert sum(windows.windowed(i) for i in range(48)) == 40 and not windows.windowed(5)


def test_weights_are_seeded_in_the_sources_dtype_and_declare_no_eos():
    a = load_target(RandomSource(shape=SHAPE, dtype="bfloat16", seed=3))
    b = load_target(RandomSource(shape=SHAPE, dtype="bfloat16", seed=3))
    c = load_draft(RandomSource(shape=SHAPE, dtype="bfloat16", seed=4))
    assert {p.dtype for p in a.parameters()} == {torch.bfloat16} and torch.get_default_dtype() == torch.float32
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    assert a.config.num_hidden_layers == 2 and a.config.eos_token_id is None
    assert load_tokenizer(RandomSource(shape=SHAPE)).decode([72, 105]) == "Hi"


def test_speculation_over_random_models_is_the_targets_greedy():
    target = load_target(RandomSource(shape=SHAPE, dtype="float32", seed=0))
    draft = load_target(RandomSource(shape=SHAPE, dtype="float32", seed=0))  # the same weights: α near 1
    prompts = [[5, 17, 230, 4], [299, 1, 2]]
    outs = SpeculativeEngine(target, draft, num_speculative_tokens=3, adaptive=False).generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [hf_greedy(target, p, 20) for p in prompts]
    assert all(o.finish_reason == "length" for o in outs)  # no EOS: every request runs to max_tokens
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0


@pytest.mark.parametrize("shape", [SHAPE, WINDOWED], ids=["llama", "gemma3-windowed"])
def test_the_coordinator_serves_random_models_with_its_real_workers(local_coordinator, shape):
    from test_pipeline import generate

    config = AppConfig.model_validate(dict(
        served_model_name="random", target={"kind": "random", "shape": shape, "dtype": "float32", "seed": 0},
        draft={"kind": "random", "shape": shape, "dtype": "float32", "seed": 0},
        speculation=dict(num_speculative_tokens=2, adaptive=False, execution="eager", transport="actor_calls"),
        max_model_len=256))
    coordinator = local_coordinator(config)
    prompts = [[5, 17, 230, 4], [299, 1, 2]]
    outs = generate(coordinator, prompts, [GREEDY] * len(prompts))
    runner = coordinator.target._obj.model.runner
    assert runner.windows.window == shape.get("sliding_window")
    assert outs == [hf_greedy(runner.model, p, 20) for p in prompts]
    assert coordinator._totals["spec_decode_num_accepted_tokens"] > 0


# Mistral's layers: every one windowed (4 positions), so a paged cache gives back what the window passed
MISTRAL = {**SHAPE, "model_type": "mistral", "head_dim": 16, "sliding_window": 4}


@pytest.mark.parametrize("draft_seed", [0, 1], ids=["draft-equal", "draft-wrong"])
def test_the_coordinator_gives_back_windowed_blocks_under_pipelined_speculation(local_coordinator, draft_seed):
    """A model windowed everywhere, paged, pipelined (blocks drafted ahead, dropped on a rejection:
    the draft's rows roll back): both workers give back the blocks behind their rows' windows and
    slack, the coordinator's admission counts what they keep, and the tokens are the target's."""
    from test_pipeline import generate

    from specserve.engine import paged_cache

    config = AppConfig.model_validate(dict(
        served_model_name="random", target={"kind": "random", "shape": MISTRAL, "dtype": "float32", "seed": 0},
        draft={"kind": "random", "shape": MISTRAL, "dtype": "float32", "seed": draft_seed},
        speculation=dict(num_speculative_tokens=3, adaptive=False, pipelined=True, execution="eager",
                         transport="actor_calls"),
        max_model_len=256, kv_block_size=4))
    given_back = []
    forget = paged_cache.PagedKVCache.forget

    def counted(cache, slot, before):
        given_back.append(forget(cache, slot, before))
        return given_back[-1]

    coordinator = local_coordinator(config)
    assert coordinator.admission.kept_behind == {"target_len": 4 + 64 + 4 - 2, "draft_len": 4 + 64 + 4 - 2}
    prompts = [[5, 17, 230, 4], [299, 1, 2]]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(paged_cache.PagedKVCache, "forget", counted)
        outs = generate(coordinator, prompts, [SamplingParams(temperature=0.0, max_tokens=120)] * 2)
    runner = coordinator.target._obj.model.runner
    assert outs == [hf_greedy(runner.model, p, 120) for p in prompts]
    assert max(given_back) >= 40  # (contexts of 123 positions: up to 123 - 4 - 64, in whole blocks)
    assert coordinator._totals["pipelined_prepared"] > 0


def test_peaked_weights_keep_the_shape_and_make_greedy_robust():
    plain = load_target(RandomSource(shape=SHAPE, dtype="float32", seed=2))
    peaked = load_target(RandomSource(shape=SHAPE, dtype="float32", seed=2, peaked=True))
    assert [p.shape for p in plain.parameters()] == [p.shape for p in peaked.parameters()]
    logits = peaked(torch.tensor([[5, 17, 230, 4]])).logits[0, -1].float()
    top2 = logits.topk(2).values
    assert (top2[0] - top2[1]) / logits.std() > 5  # the greedy token wins by a wide margin
    with pytest.raises(ValueError, match="output head of its own"):
        load_target(RandomSource(shape={**SHAPE, "tie_word_embeddings": True}, dtype="float32", peaked=True))


def test_planted_acceptance_needs_a_draft_model():
    with pytest.raises(ValidationError, match="needs a draft model"):
        AppConfig.model_validate(dict(served_model_name="r", target={"kind": "random", "shape": SHAPE},
                                      drafter={"kind": "prompt_lookup"},
                                      speculation={"planted": {"alpha": 0.8, "references": "refs.jsonl"}}))
    with pytest.raises(ValidationError):
        AppConfig.model_validate(dict(served_model_name="r", target={"kind": "random", "shape": SHAPE},
                                      draft={"kind": "random", "shape": SHAPE},
                                      speculation={"planted": {"alpha": 1.5, "references": "refs.jsonl"}}))


@pytest.mark.parametrize("alpha", [1.0, 0.0])
def test_acceptance_is_planted_through_the_coordinator(local_coordinator, tmp_path, alpha):
    """A served config plants α: with α 1 every draft of the referenced prompts is accepted, with
    α 0 none is; a prompt with no reference drafts as the model would; outputs are the target's."""
    from specserve.engine.planted import write_references
    from test_pipeline import generate

    target_source = {"kind": "random", "shape": SHAPE, "dtype": "float32", "seed": 0, "peaked": True}
    target = load_target(RandomSource.model_validate(target_source))
    prompts = [[5, 17, 230, 4], [299, 1, 2]]
    references = [p + hf_greedy(target, p, 20) for p in prompts]
    write_references(tmp_path / "refs.jsonl", references)
    config = AppConfig.model_validate(dict(
        served_model_name="random", target=target_source,
        draft={"kind": "random", "shape": SHAPE, "dtype": "float32", "seed": 7},
        speculation=dict(num_speculative_tokens=3, adaptive=False, execution="eager", transport="actor_calls",
                         planted=dict(alpha=alpha, references=str(tmp_path / "refs.jsonl"))),
        max_model_len=256))
    coordinator = local_coordinator(config)
    outs = generate(coordinator, prompts, [GREEDY] * len(prompts))
    assert [p + o for p, o in zip(prompts, outs)] == references
    totals = coordinator._totals
    drafted, accepted = totals["spec_decode_num_draft_tokens"], totals["spec_decode_num_accepted_tokens"]
    assert drafted > 0 and accepted == (drafted if alpha == 1.0 else 0)
    counts = coordinator.draft_worker._obj.model.counts
    assert counts.proposed > 0 and counts.own == 0 and counts.off_reference == 0
    unknown = [[7, 7, 7, 8]]
    assert generate(coordinator, unknown, [GREEDY]) == [hf_greedy(target, unknown[0], 20)]
    assert counts.own > 0
