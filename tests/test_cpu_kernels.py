"""The CPU forward's kernels: linears over a few rows through W @ xᵀ (engine/cpu_linear.py) and
grouped-query attention without a per-head copy of the cache (engine/attention.py). Each computes
what HF's own path computes; the engine with them stays token-identical to HF greedy."""
import pytest
import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from models import hf_greedy, tiny_llama
from specserve import SamplingParams, SpeculativeEngine
from specserve.engine import ModelRunner, RowInput, attention, cpu_linear


@pytest.mark.parametrize("name", sorted(cpu_linear.KERNELS))
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 13, 16, 21, 40, 64])
def test_every_kernel_computes_the_linear(name, rows):
    torch.manual_seed(rows)
    weight, x = torch.randn(300, 256), torch.randn(rows, 256)
    out = cpu_linear.KERNELS[name](x, weight)
    assert out.shape == (rows, 300) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight), atol=1e-4, rtol=1e-5)


def test_a_dispatched_linear_is_plain_outside_a_runner_forward(monkeypatch):
    torch.manual_seed(0)
    layer = torch.nn.Linear(256, 300)  # 76,800 weights: eligible, with a bias
    cpu_linear.install(layer, {(300, 256): ("mm",) * len(cpu_linear.ROW_BUCKETS)})
    rows_seen = []
    monkeypatch.setitem(cpu_linear.KERNELS, "mm", lambda x2, w: rows_seen.append(len(x2)) or F.linear(x2, w))
    x = torch.randn(2, 3, 256)  # 6 rows
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))  # not selected: F.linear itself
    assert rows_seen == []
    with cpu_linear.selected(True):
        inside = layer(x)
        many = layer(torch.randn(5, 13, 256))  # 65 rows > MAX_ROWS: F.linear
    assert rows_seen == [6]
    assert inside.shape == (2, 3, 300) and many.shape == (5, 13, 300)
    torch.testing.assert_close(inside, F.linear(x, layer.weight, layer.bias), atol=1e-4, rtol=1e-5)


def test_plan_times_each_eligible_shape_per_row_count():
    model = tiny_llama(0, hidden=128, vocab=600)  # 128 x 600 head and 256 x 128 MLP: eligible
    choices = cpu_linear.plan(model)
    assert set(choices) == {(600, 128)}  # the 128 x 128 attention and 256 x 128 MLP weights are too small
    assert all(len(c) == len(cpu_linear.ROW_BUCKETS) and set(c) <= set(cpu_linear.KERNELS)
               for c in choices.values())
    assert cpu_linear.plan(model) is choices  # timed once per process


@pytest.mark.parametrize("kernel", ["mm", "mm_pad"])
def test_engine_with_forced_kernels_is_greedy_identical(kernel, monkeypatch):
    calls = []
    real = cpu_linear.KERNELS[kernel]
    monkeypatch.setitem(cpu_linear.KERNELS, kernel, lambda x2, w: calls.append(len(x2)) or real(x2, w))
    target = tiny_llama(0, layers=2, hidden=256, vocab=300)  # every linear but k/v eligible
    draft = tiny_llama(1, layers=1, hidden=256, vocab=300)
    for model in (target, draft):
        shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)}
        cpu_linear.install(model, {s: (kernel,) * len(cpu_linear.ROW_BUCKETS) for s in shapes})
    prompts = [[5, 17, 42, 9], [3, 3, 8, 1, 2, 7, 90]]
    engine = SpeculativeEngine(target, draft, num_speculative_tokens=4, adaptive=False)
    assert engine.verifier.runner.linear_kernels
    outs = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0))
    assert 10 in calls  # the batch's verify (2 rows of γ+1) went through the kernel
    count = len(calls)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(target, prompt, 24)
    assert len(calls) == count  # HF's generate did not


def _attend(fn, module, q, k, v, mask):
    out, _ = fn(module, q, k, v, mask, dropout=0.0, scaling=q.shape[-1] ** -0.5)
    return out


@pytest.mark.parametrize("width", [1, 2, 5])
def test_grouped_attention_equals_hf_sdpa(width):
    torch.manual_seed(width)
    module = torch.nn.Module()
    module.num_key_value_groups = 3
    q, k, v = torch.randn(2, 6, width, 16), torch.randn(2, 2, 40, 16), torch.randn(2, 2, 40, 16)
    positions = torch.tensor([[10], [31]]) + torch.arange(width)  # [B, Q]: each row its own length
    mask = (torch.arange(40)[None, None, :] <= positions[:, :, None])[:, None]  # [B, 1, Q, K]
    got = _attend(attention.grouped_sdpa, module, q, k, v, mask)
    want = _attend(sdpa_attention_forward, module, q, k, v, mask)
    assert got.shape == (2, width, 6, 16)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["none", "per-head"])
def test_grouped_attention_leaves_other_masks_to_hf_sdpa(kind):
    """No mask, or one mask per head (Doge's dynamic masks): HF's SDPA function, as it would run."""
    torch.manual_seed(1)
    module = torch.nn.Module()
    module.num_key_value_groups = 2
    q, k, v = torch.randn(1, 4, 5, 16), torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    mask = None if kind == "none" else torch.randn(1, 4, 5, 5)  # [B, Hq, Q, K] additive
    got = _attend(attention.grouped_sdpa, module, q, k, v, mask)
    torch.testing.assert_close(got, _attend(sdpa_attention_forward, module, q, k, v, mask))


def test_grouped_attention_compiles_whole_and_equals_hf_sdpa():
    """As a captured GPU forward runs it: compiled with no graph break (fused blocks, or a
    compiled forward), it computes what HF's masked SDPA computes, without repeating the cache."""
    torch.manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups = 4
    q, k, v = torch.randn(3, 8, 1, 16), torch.randn(3, 2, 48, 16), torch.randn(3, 2, 48, 16)
    positions = torch.tensor([[5], [20], [47]])  # [B, Q]
    mask = (torch.arange(48)[None, None, :] <= positions[:, :, None])[:, None]  # [B, 1, Q, K]
    compiled = torch.compile(lambda *a: _attend(attention.grouped_sdpa, module, *a), fullgraph=True)
    got = compiled(q, k, v, mask)
    torch.testing.assert_close(got, _attend(sdpa_attention_forward, module, q, k, v, mask), atol=1e-5, rtol=1e-5)


def test_grouped_attention_is_on_for_cuda_runners_too(monkeypatch):
    """HF's masked SDPA repeats the cache per query head on CUDA as on a CPU: a GPU runner takes the
    grouped path; only SPECSERVE_CPU_KERNELS=0 on a CPU keeps HF's."""
    from specserve.engine.model_runner import grouped_attention_on

    assert grouped_attention_on(torch.device("cuda", 0)) and grouped_attention_on(torch.device("cpu"))
    monkeypatch.setenv("SPECSERVE_CPU_KERNELS", "0")
    assert grouped_attention_on(torch.device("cuda")) and not grouped_attention_on(torch.device("cpu"))


def test_runner_selects_grouped_attention_for_its_own_forwards_only():
    model = tiny_llama(0, layers=2)
    seen = []
    original = attention.grouped_sdpa

    def spy(module, query, *args, **kwargs):
        seen.append(tuple(query.shape))
        return original(module, query, *args, **kwargs)

    from transformers import AttentionInterface

    AttentionInterface.register(attention.NAME, spy)
    try:
        runner = ModelRunner(model, max_model_len=64)
        assert runner.grouped_attention
        logits = runner.forward([RowInput("a", 0, [4, 8, 15, 16, 23])], logits="all")
        assert seen and seen[0][2] == 5 and model.config._attn_implementation == "sdpa"
        count = len(seen)
        model(torch.tensor([[4, 8, 15, 16, 23]]))  # any other caller: HF's own SDPA path
        assert len(seen) == count
        runner.grouped_attention = False
        plain = runner.forward([RowInput("b", 0, [4, 8, 15, 16, 23])], logits="all")
        torch.testing.assert_close(logits, plain, atol=1e-5, rtol=1e-5)
    finally:
        AttentionInterface.register(attention.NAME, original)


def test_the_environment_turns_the_cpu_kernels_off(monkeypatch):
    assert ModelRunner(tiny_llama(0)).linear_kernels
    monkeypatch.setenv("SPECSERVE_CPU_KERNELS", "0")
    runner = ModelRunner(tiny_llama(0))
    assert not runner.grouped_attention and not runner.linear_kernels
