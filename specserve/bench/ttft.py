"""Time to first token in process: a prompt's last chunk computed with the first step (one target
forward before the first token) against the earlier order (that chunk prefilled, then the first
step's forward of the prompt's last token), side by side in one run.

    python -m specserve.bench.ttft [--model smollm2|tiny] [--out bench-results/ttft.json]

One request at a time, greedy, on the demo's engine (SmolLM2-135M-Instruct drafted by its shipped
feature head, paged with prefix caching, adaptive γ up to 6) or `--drafter draft` (the shipped
draft model). The shipped prompts in turn, through the chat template, so their system prompt's
blocks are cached after the first; `--long N` adds a prompt of N words, a new one each time
(nothing cached but the system prompt). The two orders alternate request by request on two engines
(a shared machine's load bursts hit both). Per order: TTFT p50 (add to the first token back from
`step`), the target's forwards before the first token, the time to `--max-tokens` tokens, and
whether the tokens equal the other order's. A speed figure, so a benchmark, not a test.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

from specserve import prompts as prompt_sets
from specserve.engine import SamplingParams, SpeculativeEngine
from specserve.engine import loop as loop_module

ORDERS = ("chunk, then first step", "first step carries the chunk")


@contextmanager
def earlier_order(enabled: bool):
    """While enabled: no prompt's last chunk goes with its first step (`folding` folds nothing),
    so the target prefills all of the prompt but its last token first, as before."""
    folding = loop_module.folding
    if enabled:
        loop_module.folding = lambda seqs, budget: frozenset()
    try:
        yield
    finally:
        loop_module.folding = folding


def build(kind: str, drafter: str) -> tuple[list[SpeculativeEngine], object]:
    if kind == "smollm2":
        from specserve.models.smollm2 import load_smollm2_draft, load_smollm2_target

        target, tokenizer = load_smollm2_target()
    else:
        from specserve.models.tiny import byte_tokenizer, tiny_llama

        target, tokenizer = tiny_llama(0, layers=4), byte_tokenizer()
    engines = []
    for _ in ORDERS:
        if drafter == "draft":
            from specserve.engine.proposers import DraftModelSpec

            draft = load_smollm2_draft(target) if kind == "smollm2" else tiny_llama(0, layers=4, noise=0.5)
            spec = DraftModelSpec(draft)
        else:
            from specserve.engine.feature_drafter import FeatureDrafterSpec

            spec = FeatureDrafterSpec("smollm2-eagle", 0.35, 3)
        engine = SpeculativeEngine(target, drafter=spec, num_speculative_tokens=6, max_batch_size=16,
                                   max_model_len=2048, kv_block_size=16, prefix_caching=True)
        engine.calibrate()
        engines.append(engine)
    return engines, tokenizer


def prompts(tokenizer, long_words: int, count: int) -> list[tuple[str, list[int]]]:
    records = prompt_sets.interleaved(prompt_sets.load_records(prompt_sets.GENERAL))
    chosen = [("chat", prompt_sets.encode(tokenizer, r)) for r in records[:count]]
    if long_words:
        words = " ".join(r["prompt"] for r in records).split()
        for i in range(count):
            text = f"Request {i}. " + " ".join(words[(i * 97) % len(words):][:long_words])
            chosen.append(("long", prompt_sets.encode(tokenizer, {"chat": True, "prompt": text})))
    return chosen


def one(engine: SpeculativeEngine, rid: str, prompt: list[int], max_tokens: int) -> dict:
    runner = engine.verifier.runner
    counted = []
    forward, prefill_last = runner.forward, runner.prefill_last
    runner.forward = lambda *a, **k: counted.append(1) or forward(*a, **k)
    runner.prefill_last = lambda *a, **k: counted.append(1) or prefill_last(*a, **k)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    began = time.perf_counter()
    engine.add_request(rid, prompt, params)
    seq, tokens, first, forwards = engine.sequence(rid), [], None, None
    try:
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.new_token_ids
            if first is None and tokens:
                first, forwards = time.perf_counter() - began, len(counted)
    finally:
        runner.forward, runner.prefill_last = forward, prefill_last
    return {"ttft": first, "total": time.perf_counter() - began, "forwards": forwards, "tokens": tokens,
            "cached": seq.cached_tokens}


def run(args: argparse.Namespace) -> dict:
    engines, tokenizer = build(args.model, args.drafter)
    cases = prompts(tokenizer, args.long, args.count)
    results = {(kind, order): [] for kind in ("chat", "long") for order in ORDERS}
    for rep in range(args.rounds):
        for i, (kind, prompt) in enumerate(cases):
            turn = ORDERS if (i + rep) % 2 == 0 else ORDERS[::-1]  # alternate which goes first
            for order in turn:
                engine = engines[ORDERS.index(order)]
                with earlier_order(order == ORDERS[0]):
                    results[kind, order].append(one(engine, f"{rep}-{i}", prompt, args.max_tokens))
    rows = []
    for kind in ("chat", "long"):
        runs = {order: results[kind, order] for order in ORDERS}
        if not runs[ORDERS[0]]:
            continue
        same = all(a["tokens"] == b["tokens"] for a, b in zip(*runs.values()))
        base = statistics.median(r["ttft"] for r in runs[ORDERS[0]])
        for order, rs in runs.items():
            ttft = statistics.median(r["ttft"] for r in rs)
            rows.append({"prompts": kind, "order": order, "requests": len(rs),
                         "prompt_tokens_mean": statistics.mean(len(p) for k, p in cases if k == kind),
                         "ttft_p50_ms": 1000 * ttft, "ttft_ratio": ttft / base,
                         "target_forwards_to_first_token": statistics.median(r["forwards"] for r in rs),
                         "cached_tokens_mean": statistics.mean(r["cached"] for r in rs),
                         f"time_to_{args.max_tokens}_tokens_p50_ms": 1000 * statistics.median(r["total"] for r in rs),
                         "same_tokens": same})
    return {"model": args.model, "drafter": args.drafter, "max_tokens": args.max_tokens, "rows": rows}


def table(report: dict) -> str:
    key = f"time_to_{report['max_tokens']}_tokens_p50_ms"
    lines = [f"| prompts | order | tokens (cached) | TTFT p50 (ms) | vs chunk first | target forwards to token 1 | "
             f"{report['max_tokens']} tokens p50 (ms) | same tokens |", "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['prompts']} | {r['order']} | {r['prompt_tokens_mean']:.0f} ({r['cached_tokens_mean']:.0f}) | "
                     f"{r['ttft_p50_ms']:.1f} | "
                     f"{r['ttft_ratio']:.3f} | {r['target_forwards_to_first_token']:g} | {r[key]:.1f} | "
                     f"{'yes' if r['same_tokens'] else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"])
    p.add_argument("--drafter", default="head", choices=["head", "draft"])
    p.add_argument("--count", type=int, default=8, help="shipped prompts (and long prompts) per round")
    p.add_argument("--long", type=int, default=300, help="words of each long prompt (0: none)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--out", type=Path, default=Path("bench-results/ttft.json"))
    args = p.parse_args(argv)
    if args.model == "tiny" and args.drafter == "head":
        raise SystemExit("the shipped feature head drafts for SmolLM2 only: use --drafter draft with --model tiny")
    report = run(args)
    print(table(report))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
