"""A model whose every layer is windowed, paged: its blocks given back as the window passes them,
against kept, at one KV budget, and its keys gathered by window against whole, in one run (in
process). With --hybrid, a model with windowed and full layers: its windowed layers' own pool,
which gives back, against one pool for all, at the same KV memory.

    python -m specserve.bench.windows [--requests 8] [--prompt 512] [--new 128] [--budget 2048] [--gathered]
                                      [--settings "given back,kept,whole reads"] [--hybrid]
    python -m specserve.bench.windows --shape mistral-7b --budget 65536 --requests 16 --prompt 6144 --new 512  # a GPU
    python -m specserve.bench.windows --hybrid --shape gemma3-12b --budget 65536 --requests 16 --prompt 6144 --new 256

Random weights of a Mistral-style shape (every layer attends the latest `sliding_window`
positions; on the CPU a small one, --window positions; `--shape mistral-7b`: Mistral-7B-v0.1's,
bf16 on the GPU), a target whose greedy token does not flip between kernels (`peaked`). --requests
requests of --prompt + --new tokens arrive together at a budget of --budget KV positions
(`max_cached_tokens`), prompts prefilled --chunk tokens a step, target alone, greedy, once per
setting (--settings; the first three by default):

- given back: the runner returns each request's blocks more than its window (and a rollback
  slack) behind its row (`ModelRunner._forget_behind`), and admission counts only what requests
  still hold (`Admission.held`: while a prompt goes in, up to the chunk each cache takes next);
- kept: every position held and counted, as for a model with a full-attention layer;
- whole reads: given back, but a forward that gathers its rows' keys (under a mask: a GPU's
  default, and on the CPU forwards wider than its kernel reads, or every forward with --gathered)
  gathers every block up to its key length, as before windowed layers read only their windows
  (`ModelRunner._window_reads`);
- whole prompts: given back, but admission counts a prompt whole until it is prefilled, as before
  it counted by the chunk.

Reported per setting: the most requests running at once, preemptions (requests whose caches were
given up to make room, prefilled again later), the most blocks in use, generated tokens/s over the
whole run, TTFT p50 / p99 and the long requests' last (with --long: the last --long requests'
prompts are --long-prompt tokens, queued behind the others); and whether the settings' tokens are
identical (they must be: nothing the window hides is ever read). Prints a table, writes JSON;
exits 1 if the tokens differ.

--hybrid: a Gemma-3-style model instead (on the CPU a small one: five windowed layers to each full
one, as Gemma 3's; `--shape` a named shape with both kinds), and the settings mean:

- given back: the windowed layers keep their keys in a pool of their own that gives back
  (engine/hybrid_cache.py), the full layers in one of --budget less what that pool costs, so
  that both settings hold the same KV bytes: the budget admission counts grows by what the
  windowed layers no longer hold;
- kept: one pool of --budget positions for every layer, as before;
- whole reads: given back, the windowed layers gathering every block of theirs up to K.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from specserve.bench import memory
from specserve.config import RandomSource
from specserve.engine import SamplingParams, SpeculativeEngine
from specserve.engine.admission import widest_forward
from specserve.engine.engine import kept_behind
from specserve.models.loading import load_random

# the CPU's shape: Mistral's layout, small enough for a 2-core machine (the window is --window)
CPU_SHAPE = dict(model_type="mistral", vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=32768)
SETTINGS = ("given back", "kept", "whole reads", "whole prompts")
# --hybrid on the CPU: Gemma 3's layout (five windowed layers to each full one), as small
HYBRID_CPU_SHAPE = dict(model_type="gemma3_text", vocab_size=4096, hidden_size=256, intermediate_size=512,
                        num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                        query_pre_attn_scalar=32, max_position_embeddings=32768, tie_word_embeddings=False,
                        layer_types=["sliding_attention"] * 5 + ["full_attention"])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", default=None, help="a kind: random shape (mistral-7b; gemma3-12b with --hybrid) on "
                   "the GPU in bf16, instead of the CPU's small model")
    p.add_argument("--window", type=int, default=128, help="the CPU shape's sliding window")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt", type=int, default=512, help="tokens of each request's prompt")
    p.add_argument("--new", type=int, default=128, help="tokens each request generates")
    p.add_argument("--budget", type=int, default=2048, help="max_cached_tokens (KV positions)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk", type=int, default=512, help="prefill_chunk_tokens")
    p.add_argument("--long", type=int, default=0, help="how many of the requests (the last) have long prompts")
    p.add_argument("--long-prompt", type=int, default=0, help="tokens of a long request's prompt")
    p.add_argument("--settings", default=",".join(SETTINGS[:3]), help=f"comma-separated, of {', '.join(SETTINGS)}")
    p.add_argument("--hybrid", action="store_true", help="a model with windowed and full layers (Gemma 3's "
                   "layout): a pool for the windowed layers against one for all, at equal KV memory")
    p.add_argument("--gathered", action="store_true", help="on the CPU, gather every forward's keys (a GPU's "
                   "path under a mask) instead of reading decode steps' blocks in place through the CPU kernel")
    p.add_argument("--out", type=Path, default=Path("bench-results/windows.json"))


def load(args) -> tuple[torch.nn.Module, str]:
    """(the target, the device it lives on)"""
    if args.shape:
        gpus = [0] if torch.cuda.is_available() else []
        source = RandomSource(shape=args.shape, dtype="bfloat16" if gpus else "float32", peaked=True)
        return load_random(source, gpus), "cuda" if gpus else "cpu"
    shape = HYBRID_CPU_SHAPE if args.hybrid else CPU_SHAPE
    source = RandomSource(shape={**shape, "sliding_window": args.window}, dtype="float32", peaked=True)
    return load_random(source, []), "cpu"


def prompts(args, vocab: int) -> list[list[int]]:
    """--requests prompts of --prompt tokens, the last --long of them --long-prompt tokens instead."""
    generator = torch.Generator().manual_seed(0)
    lengths = [args.prompt] * (args.requests - args.long) + [args.long_prompt] * args.long
    return [torch.randint(1, vocab, (n,), generator=generator).tolist() for n in lengths]


def engine_for(target, args, setting: str) -> SpeculativeEngine:
    engine = SpeculativeEngine(target, None, num_speculative_tokens=0, kv_block_size=args.block_size,
                               max_cached_tokens=args.budget, max_batch_size=args.requests,
                               max_model_len=max(args.prompt, args.long_prompt) + args.new + 64,
                               prefill_chunk_tokens=args.chunk)
    (pool_setting if args.hybrid else give_back_setting)(engine, args, setting)
    runner = engine.verifier.runner
    runner.read_windows = setting != "whole reads"
    if args.gathered:  # (after the runner was paged again, if it was: `page` sets its layout)
        runner.in_place = None
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    return engine


def give_back_setting(engine: SpeculativeEngine, args, setting: str) -> None:
    """A model windowed everywhere: whether its cache gives back and admission counts it so."""
    give_back = setting != "kept"
    if not give_back:  # every position held (no forward is ever far enough past a row) and counted
        engine.verifier.runner.forget_slack = 1 << 40
        engine.admission.kept_behind = {}
    if setting == "whole prompts":
        engine.admission.chunk = None
    if give_back and kept_behind(engine.verifier, engine.proposer).get("target_len") is None:
        raise SystemExit("this model has a layer that attends its whole context: it gives nothing back")


def pool_setting(engine: SpeculativeEngine, args, setting: str) -> None:
    """--hybrid: the runner paged again, a pool per kind of layer or one for all, of the same KV
    bytes (`same_bytes_budget`)."""
    runner = engine.verifier.runner
    if not runner.hybrid:
        raise SystemExit("--hybrid needs a model with both windowed and full layers")
    if setting == "whole prompts":
        raise SystemExit("--hybrid: admission counts such a model's prompts whole anyway (its full layers hold them)")
    if setting == "kept":  # one pool for every layer (paged again, before any request)
        runner.window_pool = False
        runner.page(args.block_size, max(args.budget // args.block_size, 2))
    else:
        budget = engine.admission.budget = same_bytes_budget(runner, args.budget)
        runner.page(args.block_size, budget // args.block_size, False, args.requests, widest_forward(args.chunk, 0))


def same_bytes_budget(runner, budget: int) -> int:
    """--hybrid: the full layers' budget (positions) that, beside the windowed layers' own pool
    (as the runner sized it: W positions), holds as many KV bytes as `budget` positions in every
    layer: (budget x layers - W x windowed layers) / full layers, whole blocks."""
    layers = runner.model.config.num_hidden_layers
    windowed = sum(runner.windows.windowed(i) for i in range(layers))
    size = runner.cache.block_size
    pool = runner.cache.num_window_blocks * size
    return (budget * layers - pool * windowed) // (layers - windowed) // size * size


def run(engine: SpeculativeEngine, batch: list[list[int]], new: int, long: int = 0) -> dict:
    """Every prompt at once (`bench memory`'s run) -> its figures, with the peak running over the
    whole run, preemptions, the peak blocks in use and the last of the `long` last requests' TTFTs."""
    admission, cache = engine.admission, engine.verifier.runner.cache
    preempt, moved, peaks = admission.preempt, [], {"running": 0, "blocks": 0}

    def counted() -> list:
        now = preempt()
        moved.extend(now)
        return now

    def watch() -> None:
        peaks["running"] = max(peaks["running"], len(admission.running))
        peaks["blocks"] = max(peaks["blocks"], cache.allocated()[0])

    admission.preempt = counted
    try:
        out = memory.run(engine, batch, new, each_step=watch)
    finally:
        admission.preempt = preempt
    longs = [t for rid, t in out["ttft_s"].items() if int(rid[1:]) >= len(batch) - long]
    return {**out, "peak_running": peaks["running"], "preemptions": len(moved), "peak_blocks": peaks["blocks"],
            "blocks": cache.num_blocks, "long_ttft_s": max(longs, default=None),
            "budget": admission.budget, "kv_bytes": cache.memory_bytes()}


def chosen(text: str) -> list[str]:
    """--settings -> the settings to run, "given back" first (every other one is compared with it)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = sorted(set(names) - set(SETTINGS))
    if unknown:
        raise SystemExit(f"unknown settings {unknown}: choose among {', '.join(SETTINGS)}")
    return ["given back"] + [n for n in SETTINGS[1:] if n in names]


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


def table(result: dict) -> str:
    names = [n for n in SETTINGS if n in result]
    lines = [f"{'setting':<13} {'budget':>7} {'KV MB':>7} {'peak running':>12} {'preempted':>9} {'peak blocks':>13} "
             f"{'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'long TTFT':>9}"]
    for name in names:
        row = result[name]
        lines.append(f"{name:<13} {row['budget']:>7} {row['kv_bytes'] / 2**20:>7.1f} {row['peak_running']:>12} "
                     f"{row['preemptions']:>9} {row['peak_blocks']:>6} / {row['blocks']:<4} {row['tokens_per_s']:>8.1f} "
                     f"{row['ttft_p50_s']:>8.2f}s {row['ttft_p99_s']:>8.2f}s {seconds(row['long_ttft_s']):>9}")
    given = result["given back"]
    for name in names[1:]:
        other = result[name]
        lines.append(f"given back / {name}: {given['tokens_per_s'] / other['tokens_per_s']:.2f}x tok/s, "
                     f"{given['peak_running'] / max(other['peak_running'], 1):.1f}x requests at once, "
                     f"TTFT p50 {given['ttft_p50_s'] / other['ttft_p50_s']:.2f}x")
    lines.append(f"same tokens: {result['same_tokens']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specserve bench windows", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    names = chosen(args.settings)
    target, device = load(args)
    batch = prompts(args, target.config.vocab_size)
    result: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "device": device,
                    "window": target.config.sliding_window}
    for name in names:
        engine = engine_for(target, args, name)
        result[name] = run(engine, batch, args.new, args.long)
        print(f"{name}: peak running {result[name]['peak_running']}, {result[name]['preemptions']} preempted, "
              f"{result[name]['tokens_per_s']:.1f} tok/s", flush=True)
        del engine  # (its pool goes before the next one's comes)
        if device == "cuda":
            torch.cuda.empty_cache()
    result["same_tokens"] = all(result[name]["tokens"] == result["given back"]["tokens"] for name in names)
    print(table(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0 if result["same_tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())
