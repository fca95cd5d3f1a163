"""The CPU kernel that attends over a paged pool where it lies (engine/cpu_attention.py): it equals
SDPA over the gathered keys (ragged rows, fragmented pools, blocks of 1 to 32, GQA and MHA, its
vectorised and plain paths); a paged eager runner reads through it and its logits are the dense
runner's; greedy speculative output is the target's with blocks of 1, 7 and 16; without a
compiler, or with the CPU kernels off, the runner gathers as before."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models import VOCAB, hf_greedy, tiny_llama
from specserve import SamplingParams, SpeculativeEngine
from specserve.engine import RowInput, cpu_attention
from specserve.engine.model_runner import ModelRunner


def kernel_model(seed: int, layers: int = 2) -> torch.nn.Module:
    """A tiny Llama whose head size the vectorised kernel takes (128 / 4 heads = 32; GQA, 2 KV heads)."""
    return tiny_llama(seed, layers=layers, hidden=128, init_range=0.1)


def vectorised() -> bool:
    return cpu_attention.available(32, torch.float32)


def pool_and_reads(batch, kv_heads, dim, block_size, lengths, width, seed=0):
    """A fragmented pool holding `batch` rows of the given lengths (their last `width` positions
    the queries') -> (keys, values [N, bs, Hkv, D], reads [B, 1, 1, Q + T], dense keys/values
    [B, Hkv, K, D] holding the same positions in order, positions [B, Q])."""
    generator = torch.Generator().manual_seed(seed)
    entries = max(-(-n // block_size) for n in lengths)
    num_blocks = batch * entries + 5
    order = torch.randperm(num_blocks - 1, generator=generator) + 1  # block 0: scratch
    tables = order[: batch * entries].view(batch, entries)
    keys = torch.randn(num_blocks, block_size, kv_heads, dim, generator=generator)
    values = torch.randn(num_blocks, block_size, kv_heads, dim, generator=generator)
    length = entries * block_size
    dense_keys = keys[tables].reshape(batch, length, kv_heads, dim).transpose(1, 2)
    dense_values = values[tables].reshape(batch, length, kv_heads, dim).transpose(1, 2)
    positions = torch.stack([torch.arange(n - width, n) for n in lengths])  # [B, Q]
    return keys, values, cpu_attention.reads(positions, tables), dense_keys, dense_values, positions


@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 2, 32), (9, 3, 64), (4, 4, 128), (4, 2, 12), (6, 3, 48)])
@pytest.mark.parametrize("block_size", [1, 7, 16, 32])
@pytest.mark.parametrize("width", [1, 4, 6])
def test_the_kernel_equals_sdpa_over_the_gathered_keys(heads, kv_heads, dim, block_size, width):
    if cpu_attention.load() is None:
        pytest.fail("the kernel did not build: is there a C compiler?")
    lengths = [width + 1, 40, 17, 63][: 4]  # ragged, one row only its queries and a key more
    keys, values, reads, dense_keys, dense_values, positions = pool_and_reads(
        len(lengths), kv_heads, dim, block_size, lengths, width, seed=block_size * 7 + width)
    query = torch.randn(len(lengths), heads, width, dim)
    got = cpu_attention.attend(query, keys, values, reads, scale=0.3)  # [B, Q, Hq, D]
    visible = torch.arange(dense_keys.shape[2])[None, None, None, :] <= positions[:, None, :, None]
    expected = F.scaled_dot_product_attention(query, dense_keys, dense_values, attn_mask=visible, scale=0.3,
                                              enable_gqa=True)  # [B, Hq, Q, D]
    torch.testing.assert_close(got, expected.transpose(1, 2), atol=2e-5, rtol=1e-4)


def test_the_kernel_refuses_what_it_cannot_take():
    keys, values, reads, *_ = pool_and_reads(2, 2, 32, 16, [20, 30], 2)
    with pytest.raises(TypeError, match="float32"):
        cpu_attention.attend(torch.randn(2, 4, 2, 32, dtype=torch.float64), keys, values, reads)
    with pytest.raises(ValueError, match="refused"):  # 5 query heads over 2 KV heads
        cpu_attention.attend(torch.randn(2, 5, 2, 32), keys, values, reads)


def test_a_paged_runner_reads_its_pool_through_the_kernel_with_the_dense_runners_logits(monkeypatch):
    """Forwards up to 16 tokens wide (decode, verify, a short prompt) go through the kernel, wider
    prefills gather. Through rows rolled back, freed and re-admitted into a fragmented pool, every
    forward's logits are the dense runner's."""
    if not vectorised():
        pytest.skip("no AVX-512 here: the runner gathers (the kernel tests above still run)")
    widths = []
    attend = cpu_attention.attend
    monkeypatch.setattr(cpu_attention, "attend", lambda q, *a, **k: widths.append(q.shape[2]) or attend(q, *a, **k))
    model = kernel_model(3)
    dense, paged = ModelRunner(model), ModelRunner(model)
    paged.page(7)
    assert paged.in_place == "blocks" and dense.in_place is None
    generator = torch.Generator().manual_seed(5)

    def tokens(n: int) -> list[int]:
        return torch.randint(1, VOCAB, (n,), generator=generator).tolist()

    def both(rows: list[RowInput]) -> None:
        torch.testing.assert_close(paged.forward(rows, logits="all"), dense.forward(rows, logits="all"),
                                   atol=1e-4, rtol=1e-4)

    ends = {}
    for name, n in [("r0", 30), ("r1", 9), ("r2", 52)]:
        both([RowInput(name, 0, tokens(n))])
        ends[name] = n
    assert widths == [9, 9]  # a prompt up to 16 tokens reads in place (each of the 2 layers); longer ones gather
    for step in range(12):
        if step == 4:  # a row freed; a new one takes its blocks and more
            for runner in (dense, paged):
                runner.free("r1")
            del ends["r1"]
            both([RowInput("r3", 0, tokens(23))])
            ends["r3"] = 23
        width = 1 if step % 2 else 5
        rows = [RowInput(name, end, tokens(width)) for name, end in ends.items()]
        both(rows)
        for row in rows:  # a verify keeps some of its tokens (a rollback of the rest)
            ends[row.request_id] = row.start + (width if width == 1 else 1 + step % 4)
    assert set(widths) == {1, 5, 9}


@pytest.mark.parametrize("block_size", [1, 7, 16])
def test_greedy_speculation_through_the_kernel_is_the_targets(block_size, monkeypatch):
    """A draft model and its target, both paged and read through the kernel: the target's greedy
    tokens, ragged rows past several blocks, and the pool back to full."""
    if not vectorised():
        pytest.skip("no AVX-512 here: the runner gathers")
    calls = []
    attend = cpu_attention.attend
    monkeypatch.setattr(cpu_attention, "attend", lambda *a, **k: calls.append(1) or attend(*a, **k))
    target, draft = kernel_model(11, layers=3), kernel_model(12, layers=1)
    generator = torch.Generator().manual_seed(block_size)
    batch = [torch.randint(1, VOCAB, (n,), generator=generator).tolist() for n in (5, 12, 33, 60)]
    engine = SpeculativeEngine(target, draft, num_speculative_tokens=3, adaptive=False, kv_block_size=block_size)
    outs = engine.generate(batch, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(batch, outs):
        assert out.token_ids == hf_greedy(target, prompt, 20)
    assert calls
    for runner in (engine.verifier.runner, engine.proposer.runner):
        assert runner.in_place == "blocks" and runner.cache.allocated()[0] == 1


def test_without_a_compiler_or_with_cpu_kernels_off_the_runner_gathers(monkeypatch, tmp_path, caplog):
    model = kernel_model(3)
    monkeypatch.setenv("SPECSERVE_CPU_KERNELS", "0")
    off = ModelRunner(model)
    off.page(16)
    assert off.in_place is None
    monkeypatch.delenv("SPECSERVE_CPU_KERNELS")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_attention, "_library", None)
    monkeypatch.setattr(cpu_attention, "_tried", False)
    with caplog.at_level("WARNING"):
        runner = ModelRunner(model)
        runner.page(16)
    assert runner.in_place is None and "no C compiler" in caplog.text
    logits = runner.forward([RowInput("r", 0, [1, 2, 3])], logits="all")  # gathered, as before
    torch.testing.assert_close(logits, ModelRunner(model).forward([RowInput("r", 0, [1, 2, 3])], logits="all"))


def test_the_library_is_built_once_per_source_and_machine(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    first = cpu_attention._build()
    assert first.exists() and first.parent == tmp_path / "kernels"
    stamp = first.stat().st_mtime_ns
    assert cpu_attention._build() == first and first.stat().st_mtime_ns == stamp  # found, not rebuilt
    assert list(first.parent.iterdir()) == [first]  # no scratch left behind
