"""Model families whose attention or cache the plain Llama path does not exercise: each one's greedy
output through the engine (target alone, speculative, paged) is HF `generate`'s, or the model is
refused at load with a clear error.

- Falcon attends without transformers' attention interface (it branches on the name "sdpa"
  itself): the runner must leave its attention function as it is.
- DeepSeek-V2/V3 (latent attention) is cached compressed by transformers: keys and values of
  different widths (the latent and its rotary part), one head, expanded to every query head only
  for the attention: both caches keep each its own width, and the memory sizing counts both.
- Doge hands its attention a per-head mask of its own making: the runner's grouped attention must
  leave such a mask to HF's SDPA (a line that had fallen into a comment sent it down the grouped
  path, which failed), and flex, which cannot take it, is refused with advice.
- GPT-NeoX-Japanese views its cached keys as one contiguous block: served dense, refused paged.
- GPT-Neo's local layers mask by a causal buffer sliced at the cache's length: refused; so is RWKV,
  which keeps a state of its own instead of a KV cache, and the models whose first forward failed
  in transformers' own code (Bloom's and Falcon's ALiBi, CPM-Ant, Dory, HRM).
"""
from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from models import hf_greedy, perturbed
from specserve import SamplingParams, SpeculativeEngine
from specserve.engine import attention
from specserve.engine.model_runner import ModelRunner
from specserve.engine.sharding import kv_cache_bytes_per_token, kv_sizes

VOCAB = 96
NEW = 16
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=None)
LATENT = dict(num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
              kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
              first_k_dense_replace=1, n_group=1, topk_group=1)
FAMILIES = {
    "falcon": ("falcon", {}, "sdpa"),
    "falcon-eager": ("falcon", {}, "eager"),
    "deepseek_v3": ("deepseek_v3", LATENT, "sdpa"),
    "deepseek_v2": ("deepseek_v2", LATENT, "sdpa"),
    "doge": ("doge", {}, "sdpa"),
    "gpt_neox_japanese": ("gpt_neox_japanese", {}, "eager"),
}


def build(key: str) -> torch.nn.Module:
    model_type, extra, attn = FAMILIES[key]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**SMALL, **extra}),
                                             attn_implementation=attn).eval()
    with torch.no_grad():  # weights large enough that outputs depend on the context
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
    return model


def uncached_greedy(model: torch.nn.Module, prompt: list[int], max_new: int) -> list[int]:
    """Greedy tokens with every forward over the whole sequence, no cache: what the model computes."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(max_new):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


def prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(1, VOCAB) for _ in range(n)] for n in (3, 14, 23)]


LAYOUTS = {"dense": {}, "paged": dict(kv_block_size=4), "flex": dict(attention="flex"),
           "flex-paged": dict(attention="flex", kv_block_size=16)}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("key", sorted(FAMILIES))
def test_greedy_is_hf_generates(key, layout):
    model = build(key)
    options = LAYOUTS[layout]
    params = SamplingParams(max_tokens=NEW, temperature=0.0)
    want = [hf_greedy(model, p, NEW) for p in prompts()]
    if key == "doge" and want[0] != uncached_greedy(model, prompts()[0], NEW):
        pytest.skip("this transformers' Doge decodes otherwise through its cache than over the whole sequence")
    if key == "gpt_neox_japanese" and layout != "dense":  # (flex: it attends outside the interface)
        with pytest.raises(ValueError, match="paged KV cache" if layout == "paged" else "attention interface"):
            SpeculativeEngine(model, None, num_speculative_tokens=0, **options)
        return
    if key.startswith("falcon") and "flex" in layout:  # flex attends only through the interface
        with pytest.raises(ValueError, match="attention interface"):
            SpeculativeEngine(model, None, num_speculative_tokens=0, **options)
        return
    if key == "doge" and "flex" in layout:  # its own per-head masks, which flex cannot take
        with pytest.raises(ValueError, match="tensor mask of its own"):
            SpeculativeEngine(model, None, num_speculative_tokens=0, **options).generate(prompts(), params)
        return
    plain = SpeculativeEngine(model, None, num_speculative_tokens=0, **options)
    assert [o.token_ids for o in plain.generate(prompts(), params)] == want
    engine = SpeculativeEngine(model, perturbed(model, 0.3, seed=1), num_speculative_tokens=3, adaptive=False,
                               **options)
    outs = engine.generate(prompts(), params)
    assert [o.token_ids for o in outs] == want
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0


def test_a_model_that_names_sdpa_itself_keeps_its_own_attention():
    """Falcon branches on `_attn_implementation == "sdpa"`: renamed to the runner's grouped
    function, it took its eager branch and added the boolean mask to its scores (every token
    after the first was off). The runner now selects its functions only for models that attend
    through the interface."""
    assert not attention.dispatches(build("falcon"))
    assert attention.dispatches(build("deepseek_v3"))
    assert not ModelRunner(build("falcon")).grouped_attention


def test_latent_attention_caches_keys_and_values_at_their_own_sizes():
    """transformers caches latent attention compressed: per layer one head of the latent
    (kv_lora_rank) as keys and the rotary part (qk_rope_head_dim) as values, 512 and 64 wide on
    DeepSeek-V3's own config. Both caches keep each its own width (one shape for both failed at
    the first write), and the memory the engine sizes its cache by counts them (the config's
    128 KV heads of head_dim 64 would have been 28x that)."""
    from transformers import DeepseekV3Config

    config = DeepseekV3Config()
    assert kv_sizes(config) == (512, 64)
    assert kv_cache_bytes_per_token(config, torch.bfloat16) == 61 * (512 + 64) * 2
    engine = SpeculativeEngine(build("deepseek_v3"), None, num_speculative_tokens=0, kv_block_size=4)
    engine.generate(prompts(), SamplingParams(max_tokens=2, temperature=0.0))
    cache = engine.verifier.runner.cache
    assert (cache._keys[0].shape[-2:], cache._values[0].shape[-2:]) == ((1, 16), (1, 16))  # rank 16, rope 16
    assert cache.bytes_per_position() == 2 * (16 + 16) * 4  # 2 layers, float32


def test_gpt_neo_local_layers_are_refused():
    config = AutoConfig.for_model("gpt_neo", vocab_size=VOCAB, hidden_size=64, num_heads=4, num_layers=2,
                                  attention_types=[[["global", "local"], 1]], window_size=8)
    with pytest.raises(ValueError, match="GPT-Neo"):
        ModelRunner(AutoModelForCausalLM.from_config(config, attn_implementation="eager"))


def test_a_model_that_keeps_its_own_state_is_refused():
    """RWKV takes no KV cache (a state of its own): run as the engine runs models, its tokens were
    not its own. Refused at load."""
    config = AutoConfig.for_model("rwkv", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                  attention_hidden_size=64, intermediate_size=128, context_length=256)
    with pytest.raises(ValueError, match="takes no KV cache"):
        ModelRunner(AutoModelForCausalLM.from_config(config))


@pytest.mark.parametrize("model_type, fields, reason", [
    ("bloom", {}, "ALiBi"),
    ("falcon", {"alibi": True}, "ALiBi"),
    ("cpmant", {}, "layout of its own"),
    ("dory", {}, "cache layers"),
    ("hrm_text", {}, "recurrent cycles"),
])
def test_models_transformers_cannot_run_this_way_are_refused_at_load(model_type, fields, reason):
    """Each failed at its first forward with an error from inside transformers (an unpacking or
    shape error, a missing attribute); refused at load instead, naming why."""
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {model_type}")
    config = AutoConfig.for_model(model_type, **{**SMALL, **fields})
    with pytest.raises(ValueError, match=reason):
        ModelRunner(AutoModelForCausalLM.from_config(config))
