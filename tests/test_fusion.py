"""Fused blocks (engine/fusion.py): a model's decoder layers compiled once for every layer and every
shape, equal to the plain model, and lossless through the engine's captured paths (CUDA graphs
emulated on the CPU, test_engine_static.emulate_graphs; the fused draft-model engine is
test_engine_static.test_graph_mode_logic_on_cpu[fused])."""
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from models import tiny_gpt2, tiny_llama
from specserve import SamplingParams, SpeculativeEngine
from specserve.engine import ModelRunner, RowInput, cpu_linear
from specserve.engine.fusion import repeated_blocks
from test_engine_static import emulate_graphs


@pytest.fixture
def plain_linears(monkeypatch):
    """Runners made here route no linear through the CPU kernels (each linear's own dispatcher
    would make every layer a compile of its own)."""
    monkeypatch.setenv("SPECSERVE_CPU_KERNELS", "0")
    torch._dynamo.reset()


def fused_and_plain(model, backend, block_size=None) -> tuple[ModelRunner, ModelRunner]:
    fused, plain = ModelRunner(model, execution="eager"), ModelRunner(model, execution="eager")
    fused.fuse(backend)
    for runner in (fused, plain):
        runner.pad_batches = True  # as captured runs are: batches padded up to their bucket
        if block_size:
            runner.page(block_size)
    return fused, plain


def forwards_beside(fused: ModelRunner, plain: ModelRunner, prompts: dict[str, list[int]], widths) -> float:
    """Prefill, then forwards of each width fed the same tokens to both -> the largest logit gap.
    The requests are freed after (the next call's rows are slots 0..B'-1 again: nothing gathered,
    as in every captured forward)."""
    for runner in (fused, plain):
        runner.forward([RowInput(rid, 0, p) for rid, p in prompts.items()], logits="none")
    ends, gap = {rid: len(p) for rid, p in prompts.items()}, 0.0
    for step, width in enumerate(widths):
        rows = [RowInput(rid, ends[rid], [(7 * step + i) % 90 + 1 for i in range(width)]) for rid in prompts]
        got, expected = (r.forward(rows, logits="all") for r in (fused, plain))
        gap = max(gap, (got - expected).abs().max().item())
        ends = {rid: end + width for rid, end in ends.items()}
    for runner in (fused, plain):
        for rid in prompts:
            runner.free(rid)
    return gap


def test_one_compile_serves_every_layer_and_every_shape(plain_linears):
    """A 2-layer and a 5-layer model compile as many frames; once B' and Q have each been 1 and
    more than 1, more batch sizes, widths and key lengths compile nothing; the logits are the
    plain runner's. (Paged: the inductor test below.)"""
    frames, gap = {}, 0.0
    for layers in (2, 5):
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")
        fused, plain = fused_and_plain(tiny_llama(0, layers=layers), counter)
        gap = max(gap, forwards_beside(fused, plain, {"a": [1, 2, 3], "b": [4, 5, 6, 7, 8]}, [1, 3]))
        gap = max(gap, forwards_beside(fused, plain, {"c": [9]}, [1, 4]))
        frames[layers] = counter.frame_count
    assert frames[2] == frames[5] > 0
    prompts = {f"r{i}": list(range(1 + i, 30 + 9 * i)) for i in range(5)}  # B' 8, K past 64
    gap = max(gap, forwards_beside(fused, plain, prompts, [1, 5, 1, 2, 3]))
    assert counter.frame_count == frames[5]
    assert gap < 1e-4
    assert type(repeated_blocks(fused.model)[0]).__name__ == "LlamaDecoderLayer"  # the plain blocks are back


def test_inductor_fused_blocks_write_and_read_the_cache_as_the_plain_model(plain_linears):
    """With inductor's own kernels (the GPU's compiler, here generating C++): the same logits over
    ten forwards, dense and paged, the cache writes made outside the compiled code included."""
    model = tiny_llama(0, layers=2)
    for block_size in (None, 16):
        fused, plain = fused_and_plain(model, "inductor", block_size)
        prompts = {"a": [1, 2, 3, 4], "b": [5, 6], "c": list(range(10, 40))}
        assert forwards_beside(fused, plain, prompts, [1, 4, 1, 1, 2, 1, 4, 1, 1, 1]) < 1e-4


@pytest.mark.parametrize("block_size", [None, 16])
def test_over_a_dense_cache_the_cache_write_compiles_into_the_block(plain_linears, block_size):
    """A dense cache under fused blocks is stacked, every layer's keys in one tensor, so the write
    and the read of a layer's keys compile with the block: no graph break, and still one compile
    for every layer. A paged cache's update stays eager: a break at each layer's write."""
    from torch._dynamo.utils import counters

    counters.clear()
    counter = CompileCounterWithBackend("aot_eager")
    fused, plain = fused_and_plain(tiny_llama(0, layers=3), counter, block_size)
    assert forwards_beside(fused, plain, {"a": [1, 2, 3], "b": [4, 5, 6, 7, 8]}, [1, 3, 1]) < 1e-4
    assert getattr(fused.cache, "stacked", False) == (block_size is None)
    assert not getattr(plain.cache, "stacked", False)
    assert 0 < fused.fusion.variants() <= 3  # (Q of 1 and more; not one per layer)
    breaks = sum(counters["graph_break"].values())
    assert (breaks == 0) == (block_size is None), dict(counters["graph_break"])
    if block_size is None:
        assert fused.cache.memory_bytes() == sum(s.numel() * s.element_size() for s in fused.cache._stack)
        slots, positions = fused.cache.allocated()
        assert fused.cache._stack[0].shape[:2] == (3, slots) and fused.cache._stack[0].shape[3] == positions


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_fused_blocks_over_grouped_attention_compile_whole_and_equal_hf_attention(plain_linears, backend):
    """As a GPU runner runs a grouped-query model (`grouped_attention_on`: the query heads of a
    group stacked, no repeated cache): fused blocks with no graph break, one compile for every
    layer, and the logits of HF's own masked SDPA path in plain blocks."""
    from torch._dynamo.utils import counters

    from specserve.engine import attention

    counters.clear()
    counter = CompileCounterWithBackend(backend)
    fused, plain = fused_and_plain(tiny_llama(0, layers=3), counter)
    fused.grouped_attention = True  # (SPECSERVE_CPU_KERNELS=0 turned it off on this CPU)
    assert fused.model.config.num_key_value_heads < fused.model.config.num_attention_heads
    assert not plain.grouped_attention
    with fused.running():  # what the fused blocks are compiled with: the grouped path
        assert fused.model.config._attn_implementation == attention.NAME
    assert forwards_beside(fused, plain, {"a": [1, 2, 3], "b": [4, 5, 6, 7, 8]}, [1, 3, 1, 4]) < 1e-4
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert 0 < fused.fusion.variants() <= 3


def test_a_fused_tapped_target_gives_the_feature_head_its_features(plain_linears, head_dir):
    """The feature head's tap (forward hooks on the target's layers) fires inside fused blocks,
    captured ones too (graphs emulated): the head drafts from the same features and decodes as
    the target alone."""
    from test_feature_drafter import LAYERS, build, prompts as head_prompts, reference

    model = tiny_llama(0, layers=LAYERS)  # test_feature_drafter's target, its linears plain
    engines = {}
    for fused in (False, True):
        engines[fused] = SpeculativeEngine(model, proposer=build(head_dir, model), num_speculative_tokens=3,
                                           adaptive=False)
        if fused:
            engines[fused].verifier.runner.fuse("aot_eager")
            for runner in (engines[fused].verifier.runner, engines[fused].proposer.runner):
                emulate_graphs(runner)
                runner.pad_batches = True
    batch = head_prompts(3, seed=5)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    outs = {fused: engine.generate(batch, params) for fused, engine in engines.items()}
    for prompt, a, b in zip(batch, outs[False], outs[True]):
        assert b.token_ids == a.token_ids == reference(tuple(prompt))
    accepted = [sum(o.metrics.num_accepted_tokens for o in outs[f]) for f in (False, True)]
    assert accepted[1] == accepted[0] > 0  # the same drafts: the same features
    assert len(engines[True].verifier.runner.graphs) > 0  # verify forwards captured over fused blocks


def test_fusion_refusals_and_blocks(plain_linears, monkeypatch):
    """Fused CUDA graphs need one CUDA device; the whole-forward compile mode takes no fusion; a
    model whose linears run through CPU kernels is refused (a compile per layer). The blocks are
    the decoder layers, whatever the model calls them."""
    with pytest.raises(ValueError, match="CUDA"):
        ModelRunner(tiny_llama(0), execution="fused-graph")
    with pytest.raises(ValueError, match="whole forward"):
        ModelRunner(tiny_llama(0), execution="compile").fuse()
    model = tiny_llama(0)
    monkeypatch.setattr(cpu_linear, "MIN_WEIGHT", 0)  # (a tiny model's linears are below the kernels' size)
    cpu_linear.install(model, {tuple(m.weight.shape): ("linear",) * len(cpu_linear.ROW_BUCKETS)
                               for m in model.modules() if isinstance(m, torch.nn.Linear)})
    with pytest.raises(ValueError, match="CPU kernels"):
        ModelRunner(model, execution="eager").fuse()
    gpt2 = tiny_gpt2(0, layers=3)
    assert repeated_blocks(gpt2) is gpt2.transformer.h
