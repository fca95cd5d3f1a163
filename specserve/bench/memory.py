"""KV memory by the block against the dense cache, at one budget, in one run (in process).

    python -m specserve.bench.memory [--tiny] [--budget 8192] [--block-size 16]
    python -m specserve.bench.memory --shapes llama2-7b --budget 65536 --batch 16   # a GPU: random 7B/1.1B, bf16

Two workloads, each run with the dense cache and with the paged one (`kv_block_size`), side by side:

- mix: one long request (a --long-token prompt) and --short short chats (held-out prompts) arrive
  together at a budget of --budget KV positions per model (`max_cached_tokens`). Reported: the most
  requests running at once while the long one runs (once it is done, the dense cache is no longer
  sized by it), generated tokens/s over the whole run, TTFT p50/p99 (arrival to the first
  generated token).
- uniform: --batch equal requests and no budget pressure: decode tokens/s at equal batch (the
  paged forward gathers keys through block tables, or under `--attention flex` reads the pool in
  place; this is what that costs), in --repeats rounds alternating the layouts (and attentions:
  `--attention mask,flex` runs all four).
- prefix: a --system-token system prompt, then --later requests with it and a question of their
  own, one at a time, paged without and with `prefix_caching`: TTFT p50 of the later requests.

Greedy; the draft model drafts γ --gamma (fixed, so the two layouts run the same steps); every
request's tokens are checked identical between the layouts. Prints a table, writes JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from specserve import prompts as prompt_sets
from specserve.bench.gpu import release_memory
from specserve.engine import SamplingParams, SpeculativeEngine


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tiny", action="store_true", help="tiny seeded models (a quick check) instead of SmolLM2")
    p.add_argument("--shapes", default=None, help="a random-weight target shape of bench gpu (e.g. llama2-7b), "
                   "on the GPU in bf16, instead of SmolLM2")
    p.add_argument("--draft-shape", default="tinyllama-1.1b", help="with --shapes: the draft's")
    p.add_argument("--budget", type=int, default=8192, help="max_cached_tokens of the mix")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--long", type=int, default=1536, help="the long request's prompt tokens")
    p.add_argument("--short", type=int, default=40, help="short chats in the mix")
    p.add_argument("--new", type=int, default=48, help="tokens each request generates")
    p.add_argument("--batch", type=int, default=16, help="requests of the uniform workload")
    p.add_argument("--uniform-prompt", type=int, default=128)
    p.add_argument("--gamma", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--system", type=int, default=1024, help="the shared system prompt's tokens")
    p.add_argument("--later", type=int, default=8, help="requests after the first with that system prompt")
    p.add_argument("--attention", default="mask", help="how the models attend (mask, flex), or a comma list: the "
                   "uniform workload then runs each layout under each (the mix and the prefix section under the first)")
    p.add_argument("--out", type=Path, default=Path("bench-results/memory.json"))


def load(tiny: bool, shapes: str | None = None, draft_shape: str = "tinyllama-1.1b"):
    """(target, draft, tokenizer)"""
    if shapes:
        from specserve.bench.gpu import random_llama
        from specserve.models.tiny import byte_tokenizer

        device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        return (random_llama(shapes, device, dtype, 0, peaked=True),
                random_llama(draft_shape, device, dtype, 1, peaked=False), byte_tokenizer())
    if tiny:
        from specserve.models.tiny import byte_tokenizer, tiny_llama

        return tiny_llama(0, layers=4, max_position_embeddings=4096), tiny_llama(
            0, layers=4, noise=0.3, max_position_embeddings=4096), byte_tokenizer()
    from specserve.models.smollm2 import load_smollm2_draft, load_smollm2_target

    target, tokenizer = load_smollm2_target()
    return target, load_smollm2_draft(target), tokenizer


def workloads(tokenizer, args) -> tuple[list[list[int]], list[list[int]]]:
    """(the mix's prompts: the long one first, then the short chats; the uniform prompts)."""
    records = prompt_sets.interleaved(prompt_sets.load_records(prompt_sets.GENERAL, prompt_sets.EXTRACTION))
    chats = [prompt_sets.encode(tokenizer, r) for r in records]
    text = [t for c in chats for t in c]
    long = (text * (args.long // len(text) + 1))[: args.long]
    short = [chats[i % len(chats)] for i in range(args.short)]
    uniform = [(text[i * 7:] + text)[: args.uniform_prompt] for i in range(args.batch)]
    return [long] + short, uniform


def run(engine: SpeculativeEngine, batch: list[list[int]], new: int, each_step: Callable[[], None] | None = None
        ) -> dict:
    """Every prompt at once; steps until all finish -> peak running (while the first request
    runs), wall, TTFTs (p50, p99, and by request), tokens. each_step: called after every step
    (what a caller watches)."""
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    began = time.perf_counter()
    for i, prompt in enumerate(batch):
        engine.add_request(f"r{i}", prompt, params)
    first: dict[str, float] = {}
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(batch))}
    peak = 0
    while engine.has_unfinished():
        outs = engine.step()
        if "r0" in engine.admission.running:
            peak = max(peak, len(engine.admission.running))
        if each_step is not None:
            each_step()
        now = time.perf_counter() - began
        for out in outs:
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = now
            tokens[out.request_id] += out.new_token_ids
    wall = time.perf_counter() - began
    ttfts = sorted(first.values())
    return {"peak_running": peak, "wall_s": wall, "tokens_per_s": sum(map(len, tokens.values())) / wall,
            "ttft_p50_s": ttfts[len(ttfts) // 2], "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
            "ttft_s": first, "tokens": tokens}


def engine_for(target, draft, args, block_size: int | None, budget: int | None, batch: int,
               prefix_caching: bool = False, attention: str | None = None) -> SpeculativeEngine:
    engine = SpeculativeEngine(target, draft, args.gamma, adaptive=False, max_batch_size=batch,
                               max_cached_tokens=budget, kv_block_size=block_size, max_model_len=4096,
                               prefix_caching=prefix_caching, attention=attention or attentions(args)[0])
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    return engine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specserve bench memory", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    target, draft, tokenizer = load(args.tiny, args.shapes, args.draft_shape)
    mix, uniform = workloads(tokenizer, args)
    layouts = {"dense": None, "paged": args.block_size}
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "mix": {}, "uniform": {}}
    for name, block_size in layouts.items():
        engine = engine_for(target, draft, args, block_size, args.budget, 64)
        result["mix"][name] = run(engine, mix, args.new)
        print(f"mix {name}: peak running {result['mix'][name]['peak_running']}, "
              f"{result['mix'][name]['tokens_per_s']:.1f} tok/s", flush=True)
        del engine  # its cache (a budget's worth: 34 GB at 7B shapes) goes before the next one's comes
        release_memory("cuda" if torch.cuda.is_available() else "cpu")
    result["uniform"] = uniform_section(target, draft, args, uniform, layouts)
    result["prefix"] = prefix_section(target, draft, args, mix)
    same_mix = result["mix"]["dense"]["tokens"] == result["mix"]["paged"]["tokens"]
    runs = list(result["uniform"].values())
    same_uniform = all(r["tokens"] == runs[0]["tokens"] for r in runs)
    print(table(result, same_mix, same_uniform))
    result.update(same_mix=same_mix, same_uniform=same_uniform)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0 if same_mix and same_uniform and result["prefix"]["same_tokens"] else 1


def attentions(args) -> list[str]:
    names = args.attention.split(",")
    unknown = [n for n in names if n not in ("mask", "flex")]
    if unknown:
        raise SystemExit(f"--attention: unknown {unknown} (mask, flex)")
    return names


def uniform_section(target, draft, args, uniform: list[list[int]], layouts: dict) -> dict:
    """Each layout under each attention, the same equal requests, rounds alternating -> {row name:
    median tok/s, every round's, the tokens}. Rows are named by layout ("dense", "paged"), plus
    the attention when there are several ("paged flex")."""
    several = len(attentions(args)) > 1
    engines = {}
    for attention in attentions(args):
        for name, block_size in layouts.items():
            engines[f"{name} {attention}" if several else name] = engine_for(
                target, draft, args, block_size, None, args.batch, attention=attention)
    rounds: dict[str, list[dict]] = {name: [] for name in engines}
    for _ in range(args.repeats):
        for name, engine in engines.items():
            rounds[name].append(run(engine, uniform, args.new))
    return {name: {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
                   "rounds": [r["tokens_per_s"] for r in runs], "tokens": runs[0]["tokens"]}
            for name, runs in rounds.items()}


def prefix_section(target, draft, args, mix: list[list[int]]) -> dict:
    """TTFT of requests that share a system prompt, paged without and with prefix caching."""
    text = mix[0] * (args.system // len(mix[0]) + 1)
    system = text[: args.system]
    questions = [q[-24:] for q in mix[1 : args.later + 2]]  # the first request's and each later one's
    out = {}
    for name, sharing in (("paged", False), ("paged+prefix", True)):
        engine = engine_for(target, draft, args, args.block_size, None, 8, sharing)
        runs = [run(engine, [system + q], 8) for q in questions]
        later = sorted(r["ttft_p50_s"] for r in runs[1:])
        out[name] = {"first_ttft_s": runs[0]["ttft_p50_s"], "later_ttft_p50_s": later[len(later) // 2],
                     "tokens": [r["tokens"]["r0"] for r in runs]}
    out["same_tokens"] = out["paged"]["tokens"] == out["paged+prefix"]["tokens"]
    return out


def table(result: dict, same_mix: bool, same_uniform: bool) -> str:
    mix, uni = result["mix"], result["uniform"]
    lines = [f"{'workload':<10} {'layout':<6} {'peak running':>12} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9}"]
    for name, row in mix.items():
        lines.append(f"{'mix':<10} {name:<6} {row['peak_running']:>12} {row['tokens_per_s']:>8.1f} "
                     f"{row['ttft_p50_s']:>8.2f}s {row['ttft_p99_s']:>8.2f}s")
    for name, row in uni.items():
        lines.append(f"{'uniform':<10} {name:<10} {'':>8} {row['tokens_per_s']:>8.1f}")
    for suffix in sorted({name[len("dense"):] for name in uni if name.startswith("dense")}):
        lines.append(f"uniform paged{suffix} / dense{suffix}: "
                     f"{uni['paged' + suffix]['tokens_per_s'] / uni['dense' + suffix]['tokens_per_s']:.3f}x tok/s")
    prefix = result["prefix"]
    for name in ("paged", "paged+prefix"):
        lines.append(f"{'prefix':<10} {name:<12} first TTFT {prefix[name]['first_ttft_s']:.2f}s, later TTFT p50 "
                     f"{prefix[name]['later_ttft_p50_s']:.3f}s")
    ratio = mix["paged"]["peak_running"] / max(mix["dense"]["peak_running"], 1)
    faster = prefix["paged"]["later_ttft_p50_s"] / prefix["paged+prefix"]["later_ttft_p50_s"]
    lines.append(f"paged / dense: {ratio:.1f}x requests at once in the mix; prefix cache: later TTFT {faster:.1f}x "
                 f"lower; same tokens: mix {same_mix}, uniform {same_uniform}, prefix {prefix['same_tokens']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
