"""Host time per engine step, the device's part taken out: the engine's graphs replay for free.

    python -m specserve.bench.host [--batches 1,16] [--gammas 0,3] [--layers 32] [--steps 300]
        [--out bench-results/host.json]

On a GPU a captured step costs the device's time plus the host's between the step's replays,
while the device waits for it: planning the step and drawing its random numbers, staging the
inputs, launching the rule's kernels, reading the one result back, applying the verdict. This
bench measures that host half on any machine. The target and the draft (tiny Llamas with the
layer count of the shapes they stand for: a per-layer cost on the host shows) run in graph mode
with a graph set whose capture runs the function once and whose replay runs nothing, so the
static outputs keep what that run left. Everything else is the engine as it runs on a GPU:
padded batches, captured shapes, the draft's whole loop as one replay. Tokens are meaningless
(the outputs never change); every request runs to its length.

Per (γ, batch): the median, p90 and mean of the steps' wall (after 20 warm-up steps, prompts
prefilled); the host time per generated token (a step's tokens: the batch times 1 + accepted
drafts; on frozen outputs a draft is accepted or not by chance, so that column is for γ=0); the
graph replays per step (1 at γ=0, 2 with a draft: its loop and the verify; fewer would mean eager
forwards, whose model code this bench does not price as a GPU would); and graphs captured while
timed (0: the engine captured every shape it met ahead). Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from specserve.bench import write_json
from specserve.engine import SamplingParams, SpeculativeEngine
from specserve.engine.model_runner import GraphSet, ModelRunner


class _NoReplay:
    def __init__(self, graphs: "FreeGraphs") -> None:
        self.graphs = graphs

    def replay(self) -> None:
        self.graphs.replays += 1


class FreeGraphs(GraphSet):
    """A GraphSet whose capture runs the function once (its allocations and cache writes happen)
    and whose replays run nothing but a count: a captured forward then costs the host what a GPU
    replay costs it, about nothing, and the device nothing at all."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.replays = 0

    def drop_stale(self, generation: int) -> None:
        self._entries = {k: v for k, v in self._entries.items() if k[-1] == generation}

    def _capture(self, fn, inputs):
        began = time.perf_counter()
        saved = [t.clone() for t in inputs]
        out = fn()
        for t, s in zip(inputs, saved):
            t.copy_(s)
        self.capture_seconds += time.perf_counter() - began
        return _NoReplay(self), out


def free_graphs(runner: ModelRunner) -> None:
    """Put an eager CPU runner in graph mode over FreeGraphs (as a runner made in graph mode:
    batches padded to their buckets, keys in graph-mode steps)."""
    runner.execution, runner.graphs = "graph", FreeGraphs(runner.device)
    runner.pad_batches = True
    runner.cache.key_step = runner._key_step()


def tiny_llama(layers: int, seed: int, max_len: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_len,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).eval()


def measure(gamma: int, batch: int, args) -> dict:
    """One engine's steps: build, free its graphs, capture, prefill, warm, time."""
    max_len = args.prompt_len + (args.warmup + args.steps) * (gamma + 1) + 16
    target = tiny_llama(args.layers, 0, max_len)
    draft = tiny_llama(args.draft_layers, 1, max_len) if gamma else None
    engine = SpeculativeEngine(target, draft, num_speculative_tokens=gamma, adaptive=False, eos_token_ids=[],
                               max_batch_size=batch, max_model_len=max_len, execution="eager")
    for runner in (engine.verifier.runner, getattr(engine.proposer, "runner", None)):
        if runner is not None:
            free_graphs(runner)
    engine.capture_graphs(progress=False, key_buckets=args.key_buckets, kinds=(0.0,))
    params = SamplingParams(max_tokens=max_len - args.prompt_len, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", [(7 * i + j) % 500 + 1 for j in range(args.prompt_len)], params)
    for _ in range(args.warmup):
        engine.step()
    seqs = [engine.sequence(f"r{i}") for i in range(batch)]
    graphs = [r.graphs for r in (engine.verifier.runner, getattr(engine.proposer, "runner", None)) if r]
    captured, replays = sum(len(g) for g in graphs), sum(g.replays for g in graphs)
    walls, before = [], sum(len(s.output) for s in seqs)
    for _ in range(args.steps):
        began = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - began)
    tokens = sum(len(s.output) for s in seqs) - before
    walls.sort()
    median = statistics.median(walls)
    return {"gamma": gamma, "batch": batch, "step_median_ms": median * 1e3,
            "step_p90_ms": walls[int(0.9 * (len(walls) - 1))] * 1e3, "step_mean_ms": statistics.fmean(walls) * 1e3,
            "tokens_per_step": tokens / args.steps, "host_us_per_token": median * 1e6 * args.steps / tokens,
            "replays_per_step": (sum(g.replays for g in graphs) - replays) / args.steps,
            "captured_while_timed": sum(len(g) for g in graphs) - captured}


def table(rows: list[dict], args) -> str:
    lines = [f"Host time per engine step, forwards free (target {args.layers} layers, draft {args.draft_layers}; "
             f"torch threads {torch.get_num_threads()}; {args.steps} steps after {args.warmup})",
             "| γ | batch | step median ms | p90 ms | mean ms | tokens / step | host µs / token | replays / step | "
             "captured while timed |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['gamma']} | {r['batch']} | {r['step_median_ms']:.3f} | {r['step_p90_ms']:.3f} | "
                     f"{r['step_mean_ms']:.3f} | {r['tokens_per_step']:.2f} | {r['host_us_per_token']:.1f} | "
                     f"{r['replays_per_step']:.2f} | {r['captured_while_timed']} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="specserve bench host", description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,16")
    p.add_argument("--gammas", default="0,3")
    p.add_argument("--layers", type=int, default=32, help="the target's layers (a 7B's: 32)")
    p.add_argument("--draft-layers", type=int, default=22, help="the draft's layers (a 1.1B's: 22)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--key-buckets", type=int, default=4, help="key lengths captured ahead")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the host's own work is one thread)")
    p.add_argument("--out", type=Path, default=Path("bench-results/host.json"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for gamma in (int(g) for g in args.gammas.split(",")):
        for batch in (int(b) for b in args.batches.split(",")):
            rows.append(measure(gamma, batch, args))
            print(f"γ={gamma} b={batch}: {rows[-1]['step_median_ms']:.3f} ms a step", flush=True)
    report = table(rows, args)
    print(report)
    write_json(args.out, args, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
