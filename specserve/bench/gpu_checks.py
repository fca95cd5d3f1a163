"""The engine's CUDA-graph paths against their eager selves, on a GPU, in a minute or two.

    python -m specserve.bench.gpu_checks [--out bench-results/gpu-checks.json]
    python -m specserve.bench.gpu_checks --device cpu      # a smoke test: eager only

Correctness, not speed: each check runs one engine configuration over a few ragged prompts and
compares its tokens with a reference run; a check fails on the first token that differs. The
configurations are the ones whose graph capture has run on a CPU only under emulation (tests):

- draft model (planted, α 0.7), masked attention: the long-standing graph path, as a control;
- draft model, FlexAttention over the dense cache;
- draft model, FlexAttention reading a fixed paged pool in place (attention.pool_block_mask);
- the feature head: the tapped target's verify forwards and the head's whole draft loop as graphs;
- draft model and feature head again with fused blocks (`execution="fused-graph"`,
  engine/fusion.py: the decoder layers compiled, then captured);
- the feature head over a paged cache with prefix caching: the sampled run's prompts take the
  blocks (and the kept target features) of the greedy run's;
- draft model, masked, short prompts first, then prompts whose contexts cross the dense cache's
  first 256 positions: the cache grows when they join (the engine sizes it at admission), every
  graph the short prompts captured goes stale, and the next ones are captured in a new pool
  (capturing into the old one, all its graphs gone, fails CUDA's allocator).

Then model families off the Llama path (docs/engine.md), each a tiny target with its weights
plus noise as the draft, over random prompts of 9 to 70 tokens, in graphs, greedy tokens against
HF's own `generate` of the target: sliding-window attention (Gemma 3's windowed and full layers, a
window of 16) masked over the dense cache, and paged over a pool per kind of layer
(engine/hybrid_cache.py) under FlexAttention (the full layers reading their pool in place) and
masked (every layer gathered), the windowed layers gathering only their windows' blocks;
experts (Mixtral: whether its routing captures); latent attention (DeepSeek-V3, cached compressed).

Last, q placed for another process (serve/placed_q.py: CUDA IPC on a GPU, shared memory on a
CPU), as a draft worker places it for a target worker on the same GPU: the handshake, then q
[32, 3, 32000] in bfloat16 read back exactly by a child process, three times around the two-buffer
ring, with what placing and reading cost, beside what the same q costs through the host (copied
off the device, packed, unpacked, copied onto it: `wire.pack`, as a channel carries it).

The target alone (the engine without a draft: masked, dense, eager) must first equal HF's own
greedy `generate`. Greedy rows must equal the target alone (the target's greedy choices are
made robust to kernel noise, `peaked`); seeded sampled rows must equal the same configuration run
eagerly (fused checks: eagerly with the same fused blocks, whose roundings differ from the plain
model's). Prints a table and writes JSON; exits 1 when a check fails. Imports torch, transformers
and the engine only (no ray, fastapi or pydantic), like `bench gpu`.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import random
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from specserve.bench import sync
from specserve.bench.gpu import random_llama
from specserve.engine import SamplingParams, SpeculativeEngine
from specserve.engine.feature_drafter import FeatureDrafterProposer
from specserve.engine.planted import PlantedProposer

PROMPTS = [[5, 9, 2, 7], [7] * 19, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [8, 8], [11, 12, 13, 14, 15, 16]]
LONG_PROMPTS = [(p * 250)[: 240 - 3 * i] for i, p in enumerate(PROMPTS)]  # 24 new tokens pass position 256
CHECKS = ("draft, mask", "draft, flex", "draft, flex, paged in place", "feature head", "draft, mask, fused",
          "feature head, fused", "feature head, paged, prefix cache", "draft, mask, cache grows")


def prompts_of(check: str) -> list[list[int]]:
    return LONG_PROMPTS if "grows" in check else PROMPTS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, help="default: cuda when available (graphs), else cpu (eager only)")
    p.add_argument("--max-new", type=int, default=24)
    p.add_argument("--gamma", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("bench-results/gpu-checks.json"))


def engine_for(check: str, target, draft, graphs: bool, references) -> SpeculativeEngine:
    """One check's engine (float32 tiny shapes: its own graphs, captured as met); without graphs,
    the eager engine it is compared with (on a GPU a fused check's is fused too)."""
    vocab = target.get_output_embeddings().weight.shape[0]
    flex = "flex" in check
    fused = "fused" in check and target.device.type == "cuda"
    execution = ("fused-graph" if fused else "graph") if graphs else "eager"
    if check.startswith("feature head"):
        from specserve.distill.train import init_head

        weight = target.get_input_embeddings().weight
        head = init_head(target, torch.arange(vocab))  # untrained: the last layer's weights; drafts little
        head = head.to(device=weight.device, dtype=weight.dtype).eval().requires_grad_(False)  # (made on the CPU)
        proposer = FeatureDrafterProposer(head, vocab, None, execution=execution)
    else:
        proposer = PlantedProposer(draft, vocab, 0.7, references, seed=1, execution=execution,
                                   attention="flex" if flex else "mask")
    paged = "paged" in check
    engine = SpeculativeEngine(target, proposer=proposer, num_speculative_tokens=3, adaptive=False,
                               execution=execution, attention="flex" if flex else "mask",
                               kv_block_size=16 if paged else None, max_cached_tokens=4096 if paged else None,
                               prefix_caching="prefix cache" in check)
    if fused and execution == "eager":  # the reference of a fused check: its fused blocks, run eagerly
        for runner in (engine.verifier.runner, engine.proposer.runner):
            runner.fuse()
    return engine


def tokens(engine: SpeculativeEngine, params: SamplingParams, prompts: list[list[int]]) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(prompts, params)]


@contextmanager
def checked(row: dict) -> Iterator[dict]:
    """Times the check that fills `row` ("seconds"); one that raises is reported in it (ok False,
    the error), and the others still run."""
    began = time.perf_counter()
    try:
        yield row
    except Exception as e:
        row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
    row["seconds"] = round(time.perf_counter() - began, 1)


def hf_check(target, alone: dict, max_new: int) -> dict:
    """The reference itself against HF's own greedy `generate` (HF's attention, not the runner's:
    on a GPU the runner's grouped-query call is otherwise checked only against itself)."""
    with checked({"check": "target alone = HF generate", "sampled_same": None, "graphs": 0}) as row:
        same = True
        for prompts in (PROMPTS, LONG_PROMPTS):
            for prompt, mine in zip(prompts, alone[id(prompts)]):
                same = same and hf_greedy(target, prompt, max_new) == mine
        row.update(greedy_same=same, ok=same)
    return row


def run_check(check: str, target, draft, graphs: bool, alone: list[list[int]], max_new: int) -> dict:
    """alone: the target's own greedy tokens for this check's prompts."""
    greedy = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=max_new, temperature=0.8, seed=7, ignore_eos=True)
    prompts = prompts_of(check)
    references = [p + o for p, o in zip(prompts, alone)]
    with checked({"check": check}) as row:
        engine = engine_for(check, target, draft, graphs, references)
        if "grows" in check:  # graphs captured over the cache the short prompts need, then it grows
            tokens(engine, greedy, PROMPTS)
        row["greedy_same"] = tokens(engine, greedy, prompts) == alone
        got = tokens(engine, sampled, prompts)
        row["sampled_same"] = got == tokens(engine_for(check, target, draft, False, references), sampled, prompts)
        runners = [engine.verifier.runner, engine.proposer.runner]
        row["graphs"] = sum(len(r.graphs) for r in runners if r.graphs is not None)
        row["ok"] = row["greedy_same"] and row["sampled_same"] and (row["graphs"] > 0 or not graphs)
    return row


PLACED_SHAPE = (32, 3, 32000)  # [R, G', V]: 32 sampled rows, γ 3, a 32k vocabulary


def placed_check(device: str, rounds: int = 3, repeats: int = 20) -> dict:
    """q placed here and read by a child process, as a draft worker's q by its target's."""
    from specserve.serve import placed_q

    context = multiprocessing.get_context("spawn")
    mine, theirs = context.Pipe()
    child = context.Process(target=_placed_reader, args=(theirs, device, repeats), daemon=True)
    child.start()
    box = placed_q.Outbox()
    with checked({"check": "q placed, read by another process", "graphs": 0}) as row, _closing(mine, child, box):
        mine.send(placed_q.offer(box, device))
        same = _answer(mine) is True
        for turn in range(rounds):
            q = torch.rand(PLACED_SHAPE, generator=torch.Generator().manual_seed(turn)).to(device, torch.bfloat16)
            placed, place_ms = _timed(lambda: box.place(q), device, repeats)
            mine.send(placed)
            digest, read_ms = _answer(mine)
            same = same and digest == _digest(q)
        host_ms = _timed(lambda: _through_host(q, device), device, repeats)[1]
        row.update(read_same=same, ok=same, place_ms=round(place_ms, 3), read_ms=round(read_ms, 3),
                   host_ms=round(host_ms, 3),
                   note=f"place {place_ms:.3f} + read {read_ms:.3f} ms; through the host {host_ms:.3f} ms "
                        f"(q {list(PLACED_SHAPE)} bfloat16, {q.numel() * 2 / 1e6:.2f} MB)")
        row["after_placer_dies"] = _after_placer_dies(mine, context, device)
        row["ok"] = same and row["after_placer_dies"] != "differs"
        row["note"] += f"; read after its placer died: {row['after_placer_dies']}"
    return row


@contextmanager
def _closing(conn, child, box) -> Iterator[None]:
    """The reader told to stop and joined, and the outbox closed, however the check ended."""
    try:
        yield
    finally:
        try:
            conn.send(None)
        except OSError:  # the reader is gone
            pass
        child.join(30)
        box.close()


def _after_placer_dies(reader, context, device: str) -> str:
    """A draft worker killed between placing q and the target's read: another child places q and
    exits at once (no clean-up), after the reader opened its buffer; the reader reads it again ->
    "same", "differs" (the rule would read wrong values), or the error it got ("reader died": its
    process was lost with it)."""
    mine, theirs = context.Pipe()
    placer = context.Process(target=_placer, args=(theirs, device), daemon=True)
    placer.start()
    try:
        placed, digest = _answer(mine)
        reader.send(placed)
        if _answer(reader)[0] != digest:
            return "differs"
        mine.send("exit")
        placer.join(30)
        reader.send(placed)
        try:
            return "same" if _answer(reader, 60)[0] == digest else "differs"
        except TimeoutError:
            return "reader died"
        except Exception as e:
            return f"{type(e).__name__}: {str(e)[:120]}"
    finally:
        if placer.is_alive():
            placer.kill()


def _placer(conn, device: str) -> None:
    """A child that places one q, says so, and on the word exits as a killed worker would."""
    import os

    from specserve.serve import placed_q

    q = torch.rand(PLACED_SHAPE, generator=torch.Generator().manual_seed(9)).to(device, torch.bfloat16)
    conn.send((placed_q.Outbox().place(q), _digest(q)))
    conn.recv()
    os._exit(0)


def _placed_reader(conn, device: str, repeats: int) -> None:
    """The child: accept the probe, then read each placed q -> (its digest, median ms a read)."""
    from specserve.serve import placed_q

    conn.send(placed_q.accept(conn.recv(), device))
    while (placed := conn.recv()) is not None:
        try:
            q, read_ms = _timed(lambda: placed_q.read(placed, device), device, repeats)
            conn.send((_digest(q), read_ms))
        except Exception as e:
            conn.send(RuntimeError(f"{type(e).__name__}: {e}"))


def _through_host(q: torch.Tensor, device: str) -> torch.Tensor:
    """q as it crosses without placement: off the device into a packed message, and back onto it."""
    from specserve.engine import Proposal
    from specserve.serve.wire import Reply, RowsProbs, pack, unpack

    tokens = torch.zeros(q.shape[:2], dtype=torch.long)  # [R, G']
    sent = Reply(Proposal(tokens, RowsProbs(q, tuple(range(q.shape[0])), q.shape[1]), []), 0.0)
    return unpack(pack(sent)).result.probs.resolve(tokens, device)


def _answer(conn, timeout: float = 120.0):
    if not conn.poll(timeout):
        raise TimeoutError("the reading process did not answer")
    answer = conn.recv()
    if isinstance(answer, Exception):
        raise answer
    return answer


def _timed(fn, device: str, repeats: int):
    """(fn()'s last result, its median milliseconds over `repeats` calls, the device's work included)."""
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        out = fn()
        sync(device)
        times.append(1e3 * (time.perf_counter() - began))
    return out, statistics.median(times)


def _digest(q: torch.Tensor) -> str:
    return hashlib.sha1(q.detach().view(torch.int16).cpu().numpy().tobytes()).hexdigest()


WINDOW = 16
TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=1024, initializer_range=0.02, bos_token_id=None, eos_token_id=None, pad_token_id=None)
# (check, transformers model type, its config fields past TINY's (None: the row above's model), attention, paged)
FAMILIES = [
    ("windowed, mask", "gemma3_text", dict(num_hidden_layers=3, head_dim=32, query_pre_attn_scalar=32,
                                           sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention",
                                                                               "sliding_attention"]), "mask", False),
    ("windowed, flex, paged in place", "gemma3_text", None, "flex", True),
    ("windowed, mask, paged gathered", "gemma3_text", None, "mask", True),  # (a pool per kind; windows' blocks)
    ("experts (Mixtral), mask", "mixtral", dict(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2),
     "mask", False),
    ("latent (DeepSeek-V3), mask", "deepseek_v3", dict(
        num_hidden_layers=2, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32,
        first_k_dense_replace=1, n_group=1, topk_group=1), "mask", False),
]


def family_model(model_type: str, fields: dict, device: str, seed: int, noise: float = 0.0) -> torch.nn.Module:
    """A tiny model of that type (float32) on `device`; with noise, its weights plus that much
    relative Gaussian noise (a draft right some of the time)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**TINY, **fields}),
                                                 attn_implementation="sdpa").eval()
    if noise:
        generator = torch.Generator(device=device).manual_seed(seed + 1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, device=device, generator=generator) * noise * p.std())
    return model


def family_checks(device: str, graphs: bool, max_new: int) -> list[dict]:
    """Model families off the Llama path, each target with a noisy copy as its draft, greedy
    against HF's own `generate` of the target (docs/engine.md: sliding windows, experts, latent
    attention cached compressed)."""
    rng = random.Random(0)  # (on these, the windowed model's outputs differ from its own with no window)
    prompts = [[rng.randrange(1, 512) for _ in range(n)] for n in (9, 20, 33, 47, 70)]
    rows, pair, want = [], None, None
    for check, model_type, fields, attention, paged in FAMILIES:
        with checked({"check": check, "sampled_same": None}) as row:
            if fields is not None:
                pair = family_model(model_type, fields, device, 0), family_model(model_type, fields, device, 0, 0.3)
                want = [hf_greedy(pair[0], p, max_new) for p in prompts]
            engine = SpeculativeEngine(*pair, num_speculative_tokens=3, adaptive=False,
                                       execution="graph" if graphs else "eager", attention=attention,
                                       kv_block_size=16 if paged else None, max_cached_tokens=4096 if paged else None)
            outs = engine.generate(prompts, SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True))
            row["greedy_same"] = [o.token_ids for o in outs] == want
            row["graphs"] = sum(len(r.graphs) for r in (engine.verifier.runner, engine.proposer.runner)
                                if r.graphs is not None)
            row["note"] = f"accepted {sum(o.metrics.num_accepted_tokens for o in outs)} drafts"
            row["ok"] = row["greedy_same"] and (row["graphs"] > 0 or not graphs)
        rows.append(row)
    return rows


def hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, min_new_tokens=max_new,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def table(rows: list[dict], device: str) -> str:
    lines = [f"graph paths against eager, {device}",
             f"{'check':<34} {'ok':>4} {'greedy = alone':>15} {'sampled = eager':>16} {'graphs':>7} {'s':>6}"]
    for r in rows:
        lines.append(f"{r['check']:<34} {'yes' if r['ok'] else 'NO':>4} {str(r.get('greedy_same', '-')):>15} "
                     f"{str(r.get('sampled_same', '-')):>16} {r.get('graphs', '-')!s:>7} {r['seconds']:>6}")
        for extra in ("error", "note"):
            if extra in r:
                lines.append(f"    {r[extra]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specserve bench gpu-checks", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    graphs = device.startswith("cuda")
    target = random_llama("tiny-target", device, torch.float32, 0, peaked=True)
    draft = random_llama("tiny-draft", device, torch.float32, 1, peaked=False)
    greedy = SamplingParams(max_tokens=args.max_new, temperature=0.0, ignore_eos=True)
    plain = SpeculativeEngine(target, num_speculative_tokens=0, execution="eager")
    alone = {id(p): tokens(plain, greedy, p) for p in (PROMPTS, LONG_PROMPTS)}
    rows = [hf_check(target, alone, args.max_new)]
    rows += [run_check(check, target, draft, graphs, alone[id(prompts_of(check))], args.max_new) for check in CHECKS]
    rows += family_checks(device, graphs, args.max_new)
    rows.append(placed_check(device))
    name = torch.cuda.get_device_name() if graphs else "cpu (eager: no graphs to check)"
    print(table(rows, name))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": name, "torch": torch.__version__, "rows": rows}, indent=2))
    print(f"wrote {args.out}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
