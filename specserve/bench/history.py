"""Drafting from earlier answers (`speculation.history`): what it gains where requests repeat
structures, and what it costs where they do not.

    python -m specserve.bench.history [--model smollm2|tiny] [--gamma 6] [--out bench-results/history.json]

Three workloads, each through the same engines, greedy batch 1, prompt by prompt across every row
(so that the machine's drift falls on all of them alike):

- template: one extraction task over different inputs (a JSON object of the same four fields from
  a different sentence each time), as an agent or a batch job sends it. The history holds the
  answers to the earlier prompts of the run: the first prompt recalls nothing.
- repeat: held-out prompts asked a second time (a FAQ, a retried call); their first answers are in
  the history, given before the timed run.
- unrelated: held-out prompts whose history holds the answers to other held-out prompts: where
  nothing repeats, the cost of looking (and of the odd wrong recall).

Rows, per workload: target only, then per drafter (the shipped feature head as the demo
configures it; no drafter but the history, `drafter: {kind: prediction}`) without and with the
history: tok/s, tokens per step, recalled drafts verified and accepted, the speedup over target
only, and whether every output is target only's. Prints a table, writes JSON.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from specserve.bench.prediction import blank, encode, interleaved, load
from specserve.engine import SamplingParams, SpeculativeEngine
from specserve.engine.feature_drafter import FeatureDrafterSpec
from specserve.engine.history import History
from specserve.engine.proposers import PredictionSpec
from specserve.prompts import GENERAL, by_category, load_records
from specserve.prompts import encode as encode_record

PEOPLE = [
    "Maria Lopez, 34, works as a nurse in Valencia.",
    "Our new intern is Tom Becker; he is 21 and lives in Hamburg, studying law.",
    "Dr. Aiko Tanaka (52) teaches physics at a university in Kyoto.",
    "Samuel Okafor is a 45-year-old engineer based in Lagos.",
    "The baker on the corner, Pierre Martin, turned 60 this year in Lyon.",
    "Priya Sharma, a 29 year old software developer, moved to Bangalore.",
    "In Toronto, 38-year-old lawyer Emily Chen opened her own firm.",
    "Lars Nilsson, 67, retired fisherman from Bergen.",
    "Ana Costa is 26 and works as a journalist in Lisbon.",
    "Chef Marco Rossi, aged 41, runs a restaurant in Naples.",
]


def template_prompt(sentence: str) -> str:
    return (f"Extract the person's details from this sentence as a JSON object with the keys "
            f'"name", "age", "city" and "job". Reply with the JSON only.\n\nSentence: {sentence}')


def run_workload(name: str, target, drafters: dict, prompts: list[list[int]], given: list[list[int]],
                 params: SamplingParams, gamma: int, history_tokens: int, min_match: int) -> list[dict]:
    """Every row on every prompt, interleaved; `given`: prompts whose answers the history holds first."""
    alone = SpeculativeEngine(target, None, num_speculative_tokens=0)
    reference = [alone.generate([p], params)[0].token_ids for p in prompts]
    cases = [(blank("target only"), alone, [params] * len(prompts))]
    for label, spec in drafters.items():
        for recall in (False, True):
            history = History(history_tokens, min_match) if recall else None
            engine = SpeculativeEngine(target, drafter=spec, num_speculative_tokens=gamma, adaptive=True,
                                       history=history)
            engine.generate([prompts[0][:16]], SamplingParams(max_tokens=4, temperature=0.0))  # (warm-up)
            if history is not None:
                history.clear()  # (the warm-up's answer forgotten)
                for p in given:
                    history.add(p + alone.generate([p], params)[0].token_ids)
            cases.append((blank(f"{label} + history" if recall else label), engine, [params] * len(prompts)))
    interleaved(cases, prompts, reference)
    base = cases[0][0]
    rows = []
    for row, engine, _ in cases:
        history = engine.loop.history
        rows.append({**row.as_dict(), "workload": name, "tokens_per_second": row.tokens_per_second,
                     "speedup": row.tokens_per_second / base.tokens_per_second,
                     "tokens_per_step": row.tokens / row.steps if row.steps else 0.0,
                     "history_found": None if history is None else history.num_found,
                     "history_lookups": None if history is None else history.num_lookups})
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'workload':<10} {'method':<26} {'tok/s':>7} {'tok/step':>8} {'recalled':>8} {'accepted':>8} "
             f"{'found':>9} {'speedup':>7} same"]
    for r in rows:
        found = "" if r["history_found"] is None else f"{r['history_found']}/{r['history_lookups']}"
        lines.append(f"{r['workload']:<10} {r['method']:<26} {r['tokens_per_second']:7.1f} "
                     f"{r['tokens_per_step']:8.2f} {r['recalled']:8d} {r['recalled_accepted']:8d} {found:>9} "
                     f"{r['speedup']:7.2f} {r['identical']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"])
    parser.add_argument("--gamma", type=int, default=6, help="the most drafts a step verifies")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=8, help="timed prompts per workload")
    parser.add_argument("--history-tokens", type=int, default=200_000)
    parser.add_argument("--min-match", type=int, default=8)
    parser.add_argument("--workloads", default="template,repeat,unrelated")
    parser.add_argument("--out", default="bench-results/history.json")
    args = parser.parse_args(argv)
    target, tokenizer, head = load(args.model)
    drafters = {"history alone": PredictionSpec()}
    if head is not None:  # as configs/local.yaml drafts
        drafters = {"feature head": FeatureDrafterSpec(head.path, 0.35, 3), **drafters}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    held = [encode_record(tokenizer, r) if args.model == "smollm2" else encode(tokenizer, r["prompt"])[:200]
            for r in by_category(load_records(GENERAL))["chat"]]
    n = args.prompts
    workloads = {
        "template": ([encode(tokenizer, template_prompt(s)) for s in PEOPLE[:n]], []),
        "repeat": (held[:n], held[:n]),
        "unrelated": (held[n : 2 * n], held[:n]),
    }
    rows = []
    for name in args.workloads.split(","):
        prompts, given = workloads[name]
        rows += run_workload(name, target, drafters, prompts, given, params, args.gamma, args.history_tokens,
                             args.min_match)
        print(table([r for r in rows if r["workload"] == name]))
    print(f"\ngreedy batch 1, γ <= {args.gamma}, {args.max_tokens} tokens, {args.model}, min_match {args.min_match}")
    print(table(rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "gamma": args.gamma, "max_tokens": args.max_tokens,
                               "min_match": args.min_match, "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
