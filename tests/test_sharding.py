"""Sharding plans from configs alone (no weights), and the engine on an accelerate-dispatched model."""
import copy
import json
import resource
import time

import pytest
import torch
from transformers import LlamaConfig

from models import tiny_llama
from specserve.engine import SamplingParams, SpeculativeEngine
from specserve.engine import sharding as sh

GB = 1e9


def llama3_70b() -> LlamaConfig:
    return LlamaConfig(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                       intermediate_size=28672, vocab_size=128256, max_position_embeddings=8192,
                       tie_word_embeddings=False)


def llama3_8b() -> LlamaConfig:
    return LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192,
                       tie_word_embeddings=False)


@pytest.fixture(scope="module")
def plan_70b():
    config = llama3_70b()
    headroom = sh.headroom_for_tokens(config, 8192, 4)
    return config, headroom, sh.plan_device_map(config, [0, 1, 2, 3], "80GB", torch.bfloat16, headroom)


def _max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def test_kv_headroom_for_8k_tokens():
    config = llama3_70b()
    per_token = sh.kv_cache_bytes_per_token(config, torch.bfloat16)
    assert per_token == 80 * 8 * 128 * 2 * 2 == 327_680  # layers × kv heads × head dim × (k, v) × bf16
    assert per_token * 8192 == 2_684_354_560  # 2.5 GiB for 8k cached tokens, all layers
    # Over 4 GPUs a device holds at most 20 layers: a quarter of that.
    assert sh.headroom_for_tokens(config, 8192, 4, torch.bfloat16) == 20 * 8 * 128 * 2 * 2 * 8192
    assert sh.headroom_for_tokens(config, 8192, 3, "bfloat16") == 27 * 8 * 128 * 2 * 2 * 8192  # ceil(80/3)


def test_70b_over_four_80gb_gpus(plan_70b):
    config, headroom, plan = plan_70b
    # Every decoder layer is placed whole: its own entry, nothing finer, on one of the four GPUs.
    for i in range(config.num_hidden_layers):
        assert plan[f"model.layers.{i}"] in {0, 1, 2, 3}
    assert not any(name.startswith("model.layers.") and name.count(".") > 2 for name in plan)
    assert set(plan) == {f"model.layers.{i}" for i in range(80)} | {
        "model.embed_tokens", "model.norm", "model.rotary_emb", "lm_head"}
    assert set(plan.values()) == {0, 1, 2, 3}  # balanced: every GPU takes a share
    per_device = sh.placed_bytes(config, plan, torch.bfloat16)
    assert sum(per_device.values()) == pytest.approx(141.1e9, rel=0.01)  # 70.6B bf16 parameters
    for device, placed in per_device.items():
        assert placed + headroom <= 80 * GB, device
        assert placed <= 0.3 * sum(per_device.values())  # no GPU carries much more than a quarter


@pytest.mark.parametrize("devices,budget", [([0], "80GB"), ([0, 1], "40GB")])
def test_70b_does_not_fit_small_budgets(devices, budget):
    config = llama3_70b()
    rss, began = _max_rss_bytes(), time.perf_counter()
    with pytest.raises(ValueError, match=r"does not fit: its torch.bfloat16 weights need 141.1 GB") as err:
        sh.plan_device_map(config, devices, budget, torch.bfloat16, sh.headroom_for_tokens(config, 8192, len(devices)))
    assert f"{len(devices)} device(s)" in str(err.value)
    # Nothing was materialised: 141 GB of weights cannot have been touched in this time and memory.
    assert time.perf_counter() - began < 30
    assert _max_rss_bytes() - rss < 2 * GB


def test_spill_past_a_device_is_refused():
    """Enough memory in total, but layers are indivisible: the remainder must not go to cpu/disk."""
    config = llama3_70b()
    with pytest.raises(ValueError, match=r"would spill to \['disk'\]"):
        sh.plan_device_map(config, [0, 1], "72GB", torch.bfloat16, 0)


def test_skeleton_holds_no_real_tensor():
    model = sh.build_skeleton(llama3_70b(), torch.bfloat16)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) > 70e9


def test_load_sharded_fails_before_reading_weights(tmp_path):
    """A checkpoint folder with a 70B config and no weight files: the plan refuses it first."""
    (tmp_path / "config.json").write_text(json.dumps(llama3_70b().to_dict()))
    with pytest.raises(ValueError, match="does not fit"):
        sh.load_sharded(tmp_path, [0], "80GB", torch.bfloat16, 0.05)
    with pytest.raises(FileNotFoundError, match="local checkpoint folder"):
        sh.load_sharded(tmp_path / "missing", [0], "80GB")


def test_8b_draft_fits_one_80gb_gpu():
    config = llama3_8b()
    plan = sh.plan_device_map(config, [0], "80GB", torch.bfloat16, sh.headroom_for_tokens(config, 32768, 1))
    assert set(plan.values()) == {0}
    assert sum(sh.placed_bytes(config, plan).values()) == pytest.approx(16.06e9, rel=0.01)


def test_budget_per_device_and_fractional_headroom():
    """A draft sharing GPU 0 leaves the target less room there; the plan respects each budget."""
    config = llama3_70b()
    budgets = {0: "40GB", 1: "80GB", 2: "80GB", 3: "80GB"}
    plan = sh.plan_device_map(config, [0, 1, 2, 3], budgets, torch.bfloat16, 0.1)
    per_device = sh.placed_bytes(config, plan)
    assert per_device[0] <= 0.9 * 40 * GB
    assert all(per_device[d] <= 0.9 * 80 * GB for d in (1, 2, 3))
    with pytest.raises(ValueError, match="no memory budget"):
        sh.plan_device_map(config, [0, 1], {0: "80GB"})
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        sh.plan_device_map(config, [0], "80GB", torch.bfloat16, 1.5)


def test_cuda_ordinals():
    assert sh.cuda_ordinals([2, 3], {"CUDA_VISIBLE_DEVICES": "2,3"}) == [0, 1]  # what Ray sets for an actor
    assert sh.cuda_ordinals(["5"], {"CUDA_VISIBLE_DEVICES": "1,5"}) == [1]
    assert sh.cuda_ordinals([4, 6], {}) == [4, 6]  # nothing hidden: ids are ordinals
    with pytest.raises(ValueError, match="not in CUDA_VISIBLE_DEVICES"):
        sh.cuda_ordinals([7], {"CUDA_VISIBLE_DEVICES": "0,1"})


# -- the engine on a model whose modules carry accelerate hooks ---------------------------------------
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10] * 12]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture
def one_thread():
    """Tiny models run many small ops: one thread is far faster than two on a shared CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_engine_on_hook_dispatched_target(target, one_thread):
    """accelerate's per-module hooks (what a multi-GPU device_map installs) leave the engine lossless.

    CPU is one accelerate device, so the layers cannot go to different devices here; with
    force_hooks every module gets the AlignDevicesHook a multi-GPU map installs (execution device
    per module, inputs moved before each forward, past_key_values skipped). With a main device of
    "cpu", accelerate does not offload "cpu" entries, so this is the multi-GPU code path with
    transfers that happen to be no-ops.
    """
    from accelerate import dispatch_model
    from accelerate.hooks import AlignDevicesHook

    reference = [o.token_ids for o in SpeculativeEngine(target, None, 0).generate(PROMPTS, GREEDY)]
    hooked = copy.deepcopy(target)
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    device_map.update({f"model.layers.{i}": "cpu" for i in range(hooked.config.num_hidden_layers)})
    hooked = dispatch_model(hooked, device_map, force_hooks=True, skip_keys=hooked._skip_keys_device_placement)
    assert all(isinstance(getattr(hooked.get_submodule(name), "_hf_hook", None), AlignDevicesHook)
               for name in device_map)
    draft = tiny_llama(1, layers=1)
    out = SpeculativeEngine(hooked, draft, 3, adaptive=False).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in out] == reference


def test_load_sharded_round_trip(tmp_path, target):
    target.save_pretrained(tmp_path)
    loaded = sh.load_sharded(tmp_path, ["cpu"], "1GB", torch.float32, 0.1)
    assert loaded.config._attn_implementation == "sdpa"
    ids = torch.tensor([PROMPTS[0]])
    torch.testing.assert_close(loaded(ids).logits, target(ids).logits)


def test_hf_source_loads_on_cpu_without_gpus(tmp_path):
    """The serving loader's CPU path: a local checkpoint, no GPUs given, no download attempted."""
    from specserve.config import HFSource
    from specserve.models.loading import load_target

    model = tiny_llama(3)
    model.save_pretrained(tmp_path)
    loaded = load_target(HFSource(path=str(tmp_path), dtype="float32"), gpus=[])
    ids = torch.tensor([[1, 2, 3]])
    assert torch.allclose(loaded(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-6)
    with pytest.raises(Exception):
        HFSource(path=str(tmp_path), kv_cache_headroom=1.5)
