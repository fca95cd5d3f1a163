"""The mask-free attention path (ModelRunner(attention="flex"), engine/attention.py): FlexAttention
under the rows' positions computes what the masked path computes, eagerly and compiled, on both
caches, and speculative greedy output stays the target's own."""
from __future__ import annotations

import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from models import ShiftedDraft, perturbed, tiny_llama, tiny_qwen2
from specserve import SamplingParams, SpeculativeEngine
from specserve.engine import attention
from specserve.engine.model_runner import ModelRunner, RowInput

# eager FlexAttention warns that it is the unfused reference: here that is the point
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

LENGTHS = (7, 30, 3)  # a ragged batch: every row its own length


def tiny_mha_llama(seed: int, layers: int = 2):
    """A Llama whose every query head has its own KV head (no grouping)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=96, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).eval()


MODELS = {
    "gqa": lambda: tiny_llama(0),
    "gqa-eager": lambda: tiny_llama(0, attn="eager"),
    "mha": lambda: tiny_mha_llama(0),
    "qwen2": lambda: tiny_qwen2(0),
}


def run_forwards(runner: ModelRunner, widths=(1, 5, 1), seed: int = 1) -> list[torch.Tensor]:
    """A ragged prefill, then a forward of each width for every row -> every forward's logits [B, Q, V]."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, 96, (n,), generator=g).tolist() for n in LENGTHS]
    out = [runner.forward([RowInput(str(i), 0, t) for i, t in enumerate(rows)], logits="all")]
    for width in widths:
        new = [torch.randint(0, 96, (width,), generator=g).tolist() for _ in rows]
        calls = [RowInput(str(i), runner.valid_length(str(i)), t) for i, t in enumerate(new)]
        out.append(runner.forward(calls, logits="all"))
    return out


def runner_for(model, mode: str, paged: bool = False, execution: str = "eager") -> ModelRunner:
    runner = ModelRunner(model, execution=execution, attention=mode)
    if paged:
        runner.page(16)
    return runner


def assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model_key", sorted(MODELS))
@pytest.mark.parametrize("paged", [False, True])
def test_flex_logits_equal_masked_logits(model_key, paged):
    model = MODELS[model_key]()
    want = run_forwards(runner_for(model, "mask", paged))
    got = run_forwards(runner_for(model, "flex", paged))
    assert_same(got, want)


def test_flex_runs_flex_and_restores_the_models_attention(monkeypatch):
    model = tiny_llama(0)
    calls = []
    original = attention.flex_sdpa

    def spy(*args, **kwargs):
        calls.append(args[4])
        return original(*args, **kwargs)

    monkeypatch.setattr(attention, "flex_sdpa", spy)
    attention.AttentionInterface.register(attention.FLEX_NAME, spy)
    try:
        run_forwards(runner_for(model, "flex"), widths=(1,))
    finally:
        attention.AttentionInterface.register(attention.FLEX_NAME, original)
    assert len(calls) == 2 * model.config.num_hidden_layers  # every layer of both forwards
    assert all(isinstance(m, attention.BlockMask) for m in calls)
    assert model.config._attn_implementation == "sdpa"


def test_flex_block_mask_is_the_position_rule():
    positions = torch.tensor([[3, 4], [0, 0], [200, 201]])  # [B', Q]
    block = attention.block_mask(positions, 256)
    keys = torch.arange(256)
    for b in range(3):
        for q in range(2):
            visible = block.mask_mod(torch.tensor(b), torch.tensor(0), torch.tensor(q), keys)
            assert torch.equal(visible, keys <= positions[b, q])


def test_unknown_attention_mode_is_refused():
    with pytest.raises(ValueError, match="attention must be one of"):
        ModelRunner(tiny_llama(0), attention="paged")


def test_flex_refuses_a_model_over_several_devices():
    model = tiny_llama(0)
    model.model.layers[1].to("meta")  # (a stand-in for a second GPU)
    with pytest.raises(ValueError, match="whole model on one device"):
        ModelRunner(model, attention="flex")


def test_flex_on_a_gpu_refuses_heads_narrower_than_its_kernel_takes():
    """FlexAttention's GPU kernel needs a head dimension >= 16 (an H200 run failed in Inductor at 8):
    refused up front with the way out; a CPU runs such heads, and a 16-wide head passes."""
    from types import SimpleNamespace

    from specserve.engine.model_runner import _resolve_attention

    llama = tiny_llama(0, layers=1)  # (what the stand-in's modules hold: a model of the attention interface)

    def model(hidden, heads, cuda):
        weight = SimpleNamespace(device=torch.device("cuda:0" if cuda else "cpu"), is_cuda=cuda)
        return SimpleNamespace(config=LlamaConfig(hidden_size=hidden, num_attention_heads=heads),
                               parameters=lambda: iter([weight]), modules=lambda: iter([llama]))

    with pytest.raises(ValueError, match="head dimension of at least 16.*is 8: use attention='mask'"):
        _resolve_attention("flex", model(32, 4, cuda=True))
    assert _resolve_attention("flex", model(32, 4, cuda=False)) == "flex"
    assert _resolve_attention("flex", model(32, 2, cuda=True)) == "flex"
    assert _resolve_attention("auto", model(32, 4, cuda=True)) == "mask"


def test_auto_keeps_the_masked_path():
    runner = ModelRunner(tiny_llama(0))
    assert runner.attention == "mask" and runner.grouped_attention


@pytest.mark.parametrize("draft_kind", ["ordinary", "always-wrong"])
def test_flex_engine_greedy_equals_target_only(draft_kind):
    target = tiny_llama(0)
    draft = perturbed(target, 0.6, seed=1) if draft_kind == "ordinary" else ShiftedDraft(target)
    prompts = [[5, 9, 2], [7] * 17, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    plain = SpeculativeEngine(target, None, num_speculative_tokens=0).generate(prompts, params)
    flex = SpeculativeEngine(target, draft, num_speculative_tokens=3, adaptive=False, attention="flex")
    assert flex.verifier.runner.attention == "flex" and flex.proposer.runner.attention == "flex"
    outs = flex.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0


def test_flex_compiled_forward_equals_eager():
    """execution="compile": the runner's `_compute` with FlexAttention under torch.compile
    (fullgraph); decode widths 1 and 5 run compiled. One layer keeps the compile short."""
    model = tiny_llama(0, layers=1)
    want = run_forwards(runner_for(model, "mask"))
    runner = runner_for(model, "flex", execution="compile")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = run_forwards(runner)
    assert runner._compiled is not None  # the decode forwards went through torch.compile
    assert_same(got, want)
    assert model.config._attn_implementation == "sdpa"


# -- a paged pool read in place (attention.pool_block_mask) -------------------------------------

def fragmenting_forwards(runner: ModelRunner, seed: int = 2) -> list[torch.Tensor]:
    """Ragged rows decoding, one freed, a longer one taking its blocks and more (its table then
    interleaves with the others'), every live row decoding on -> every forward's logits [B, Q, V]."""
    g = torch.Generator().manual_seed(seed)

    def tokens(n):
        return torch.randint(0, 96, (n,), generator=g).tolist()

    def step(ids, width):
        calls = [RowInput(i, runner.valid_length(i), tokens(width)) for i in ids]
        return runner.forward(calls, logits="all")

    out = [runner.forward([RowInput(str(i), 0, tokens(n)) for i, n in enumerate(LENGTHS)], logits="all")]
    out += [step(["0", "1", "2"], w) for w in (1, 5)]
    runner.free("1")
    out.append(runner.forward([RowInput("3", 0, tokens(40))], logits="all"))
    out += [step(["0", "2", "3"], w) for w in (1, 4, 1)]
    return out


@pytest.mark.parametrize("block_size", [1, 7, 16])
@pytest.mark.parametrize("model_key", ["gqa", "mha"])
def test_paged_pool_read_in_place_equals_masked_dense(model_key, block_size):
    model = MODELS[model_key]()
    want = fragmenting_forwards(runner_for(model, "mask"))
    runner = ModelRunner(model, execution="eager", attention="flex")
    runner.page(block_size)
    pooled = []
    original = attention.flex_sdpa

    def spy(module, query, key, value, mask, *args, **kwargs):
        pooled.append(key.shape[0] == 1 and key.shape[2] == runner.cache.num_blocks * block_size)
        return original(module, query, key, value, mask, *args, **kwargs)

    attention.AttentionInterface.register(attention.FLEX_NAME, spy)
    try:
        got = fragmenting_forwards(runner)
    finally:
        attention.AttentionInterface.register(attention.FLEX_NAME, original)
    assert_same(got, want)
    layers = model.config.num_hidden_layers
    assert pooled.count(True) == 5 * layers  # the five decode forwards read the pool, the prefills gathered


def test_pool_block_mask_is_the_table_and_position_rule():
    block_size, num_blocks = 4, 12
    tables = torch.tensor([[5, 2, 9, 0], [3, 0, 0, 0], [0, 0, 0, 0]])  # [B', T]; the last row is padding
    positions = torch.tensor([[9, 10], [2, 3], [0, 0]])  # [B', Q]
    mask = attention.pool_block_mask(positions, tables, block_size, num_blocks)
    assert mask.kv_num_blocks.view(-1).tolist() == [3, 1, 0]  # each row lists its own blocks only
    assert mask.kv_indices[0, 0, 0, :3].tolist() == [5, 2, 9] and mask.kv_indices[1, 0, 0, 0].item() == 3
    keys = torch.arange(num_blocks * block_size)  # physical pool positions
    for b in range(3):
        own = [int(x) for x in tables[b] if x != 0]
        logical = torch.tensor([own.index(k // block_size) * block_size + k % block_size
                                if k // block_size in own else -1 for k in keys.tolist()])
        for q in range(2):
            visible = mask.mask_mod(torch.tensor(b), torch.tensor(0), torch.tensor(q), keys)
            assert torch.equal(visible, (logical >= 0) & (logical <= positions[b, q]))


def test_paged_pool_in_place_compiled_equals_masked():
    """execution="compile" over a paged pool: compiled FlexAttention visits only the key blocks
    the mask lists (the eager reference ignores the list), so this checks the list itself."""
    model = tiny_llama(0, layers=1)
    want = fragmenting_forwards(runner_for(model, "mask"))
    runner = runner_for(model, "flex", paged=True, execution="compile")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = fragmenting_forwards(runner)
    assert runner._compiled is not None
    assert_same(got, want)


@pytest.mark.parametrize("block_size", [1, 16])
def test_flex_paged_engine_greedy_equals_target_only(block_size):
    target = tiny_llama(0)
    draft = perturbed(target, 0.6, seed=1)
    prompts = [[5, 9, 2], [7] * 17, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    plain = SpeculativeEngine(target, None, num_speculative_tokens=0).generate(prompts, params)
    engine = SpeculativeEngine(target, draft, num_speculative_tokens=3, adaptive=False, attention="flex",
                               kv_block_size=block_size)
    assert engine.verifier.runner.paged and engine.proposer.runner.paged
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("paged", [False, True])
def test_flex_on_gpu_in_graphs_equals_target_only(paged):
    """On a GPU: FlexAttention (compiled) inside CUDA graphs, over the dense cache or reading a
    fixed paged pool in place, gives the target-alone tokens."""
    target = tiny_llama(0).cuda()
    draft = perturbed(target, 0.6, seed=1)
    prompts = [[5, 9, 2], [7] * 17, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [8, 8]]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    plain = SpeculativeEngine(target, None, num_speculative_tokens=0, execution="eager").generate(prompts, params)
    engine = SpeculativeEngine(target, draft, num_speculative_tokens=3, adaptive=False, attention="flex",
                               execution="graph", kv_block_size=16 if paged else None,
                               max_cached_tokens=4096 if paged else None)
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert len(engine.verifier.runner.graphs) > 0


def test_in_place_forwards_take_one_shape_whatever_the_context():
    """Read in place, a decode forward's shapes (the key of its compiled or captured graph) are
    the same at 10 positions and at 200, where the gathering path's K grows with the context."""
    model = tiny_llama(0, layers=1)

    def decode_keys(attention_mode):
        runner = ModelRunner(model, execution="eager", attention=attention_mode)
        runner.page(16, 40)
        keys = []
        real = runner.run

        def spy(staged, *args, **kwargs):
            keys.append(staged.static_key)
            return real(staged, *args, **kwargs)
        runner.run = spy
        runner.forward([RowInput("a", 0, list(range(1, 10))), RowInput("b", 0, [4] * 190)], logits="none")
        keys.clear()
        for _ in range(2):
            runner.forward([RowInput("a", runner.valid_length("a"), [5]), RowInput("b", runner.valid_length("b"), [6])],
                           logits="last")
        runner.free("b")
        runner.forward([RowInput("a", runner.valid_length("a"), [5])], logits="last")
        return keys

    in_place = decode_keys("flex")
    assert in_place[0] == in_place[1] and in_place[2][1:] == in_place[0][1:]  # (B' 2, then 1)
    assert in_place[0][2] == 256  # K: whole tables, as many blocks as a row may hold (the 256-position model)
    gathered = decode_keys("mask")
    assert gathered[0][2] > gathered[2][2]  # without row b, the gathering path's K shrinks to row a's
