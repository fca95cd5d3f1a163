"""A drafter's acceptance position by position on held-out prompts: the trace `bench policy --trace`
replays in place of i.i.d. draws.

    python -m specserve.bench.acceptance [--drafter feature-head|draft-model] [--per-category 14]
        [--tokens 64] [--gamma 6] [--out bench-results/acceptance.json]
    python -m specserve.bench.policy --fixture cpu-demo --trace bench-results/acceptance.json --staggered \
        --max-gamma 6 --tokens 64 --batches 1,2,4,8

For each prompt (chat, code, summarise from `prompts.jsonl`, greedy) the target's own output of
`--tokens` tokens comes first (a γ=0 engine). Then, for every position t ≥ 1 of it, a request whose
prompt is the prompt and the output's first t - 1 tokens: its prefill gives token t - 1, and its
next step, planned at γ, is the step a request would take t tokens into its answer. The trace keeps
that step's drafts offered (a confidence floor declines the rest) and kept, per position; every
token the requests make is checked against the target's own output. All positions of one prompt
run as one batch of an engine with a fixed γ.

Why a trace: how a drafter's hits fall is not i.i.d. Requests differ (the demo's head keeps most of
a code answer's drafts and few of a chat's), and hits and misses come in streaks. A policy that
learns per request meets exactly that; its replay on a trace shows what it makes of it, with no
timing noise (the costs are a fixture's or a measured table, as in `bench policy`).
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

from specserve.bench.policy import Trace
from specserve.engine import SamplingParams, SpeculativeEngine
from specserve.prompts import GENERAL, by_category, encode, load_records

CATEGORIES = ("chat", "code", "summarise")


@dataclass
class _Pending:
    t: int  # the output position the request's first decoding step starts at
    seen: tuple[int, int, int] | None = None  # metrics (steps, drafts, kept) once its prefill token came


def drafter_engine(model: str, drafter: str, gamma: int, floor: float | None, lookup_min_n: int | None):
    """(tokenizer, the fixed-γ engine that drafts, a γ=0 engine, label)."""
    from specserve.bench.drafters import load
    from specserve.engine.feature_drafter import FeatureDrafterSpec
    from specserve.engine.proposers import DraftModelSpec

    if drafter == "feature-head":
        if model != "smollm2":
            raise SystemExit("--drafter feature-head needs --model smollm2 (the shipped head is SmolLM2's)")
        from specserve.models.smollm2 import load_smollm2_target

        target, tokenizer = load_smollm2_target()  # (the head attaches to it: no draft model to load)
        spec, label = FeatureDrafterSpec("smollm2-eagle", floor, lookup_min_n), f"feature head, floor {floor}"
    else:
        target, tokenizer, draft, note = load(model, None)
        if draft is None:
            raise SystemExit(note)
        spec, label = DraftModelSpec(draft), "draft model"
    # (no prefix caching: `positions` needs each request's first step to be its own prefill, which
    # drafts nothing, and checks that it is)
    drafting = SpeculativeEngine(target, drafter=spec, num_speculative_tokens=gamma, adaptive=False, max_batch_size=64)
    plain = SpeculativeEngine(target, num_speculative_tokens=0)
    return tokenizer, drafting, plain, f"{model} target, {label}, γ {gamma}"


def output_of(engine: SpeculativeEngine, prompt: list[int], tokens: int) -> list[int]:
    """The target's greedy output (γ=0), up to `tokens` tokens or its end of sequence."""
    return engine.generate([prompt], SamplingParams(max_tokens=tokens, temperature=0.0))[0].token_ids


def positions(engine: SpeculativeEngine, prompt: list[int], output: list[int], gamma: int,
              tag: str) -> tuple[list[int], list[int]]:
    """([t] drafts offered, [t] kept) for the step at each output position t ≥ 1 ([0]: 0, the
    prefill's). Raises where a request's tokens are not the target's own (`output`)."""
    params = SamplingParams(max_tokens=2 * gamma + 4, temperature=0.0, ignore_eos=True)  # (never done in 2 steps)
    pending = {}
    for t in range(1, len(output)):
        rid = f"{tag}-{t}"
        engine.add_request(rid, prompt + output[: t - 1], params)
        pending[rid] = _Pending(t)
    drafted, kept = [0] * len(output), [0] * len(output)
    while pending:
        engine.step()
        for rid, p in list(pending.items()):
            seq = engine.sequence(rid)
            made = seq.output[: len(output) - p.t + 1]
            if made != output[p.t - 1 : p.t - 1 + len(made)]:
                raise RuntimeError(f"{rid}: tokens {made} are not the target's own {output[p.t - 1:][:len(made)]}")
            m = seq.metrics
            if p.seen is None and seq.output:
                if len(seq.output) != 1 or m.num_draft_tokens:
                    raise RuntimeError(f"{rid}: its first step drafted (a cached prompt?): it is not position {p.t}'s")
                p.seen = (m.num_steps, m.num_draft_tokens, m.num_accepted_tokens)
            elif p.seen is not None and m.num_steps > p.seen[0]:
                drafted[p.t], kept[p.t] = m.num_draft_tokens - p.seen[1], m.num_accepted_tokens - p.seen[2]
                engine.abort(rid)
                del pending[rid]
    return drafted, kept


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--drafter", choices=["feature-head", "draft-model"], default="feature-head")
    parser.add_argument("--floor", type=float, default=0.35, help="the head's confidence floor (the demo's)")
    parser.add_argument("--lookup-min-n", type=int, default=3, help="the head's prompt lookup (the demo's; 0: off)")
    parser.add_argument("--gamma", type=int, default=6, help="drafts planned per step (the most a replay can ask)")
    parser.add_argument("--tokens", type=int, default=64, help="output tokens per prompt")
    parser.add_argument("--per-category", type=int, default=14)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="bench-results/acceptance.json")
    args = parser.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    tokenizer, drafting, plain, label = drafter_engine(args.model, args.drafter, args.gamma, args.floor,
                                                          args.lookup_min_n or None)
    groups = by_category(load_records(GENERAL))
    requests, lines = [], ["| category | prompts | positions | offered / position | kept / position | ρ |",
                           "|---|---|---|---|---|---|"]
    for category in CATEGORIES:
        rows = []
        for i, record in enumerate(groups.get(category, [])[: args.per_category]):
            began = time.perf_counter()
            prompt = encode(tokenizer, record)
            output = output_of(plain, prompt, args.tokens)
            if len(output) < 2:
                continue
            drafted, kept = positions(drafting, prompt, output, args.gamma, f"{category}{i}")
            rows.append({"category": category, "prompt_tokens": len(prompt), "drafted": drafted, "accepted": kept})
            print(f"{category} {i}: {len(output)} tokens, {sum(kept) / (len(output) - 1):.2f} kept a position "
                  f"({time.perf_counter() - began:.1f} s)", flush=True)
        requests += rows
        lines.append(_line(category, rows, args.gamma))
    lines.append(_line("all", requests, args.gamma))
    table = "\n".join(lines)
    print(f"{label}\n{table}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"gamma": args.gamma, "source": label, "tokens": args.tokens, "table": table,
                               "requests": requests}))
    return 0


def _line(category: str, rows: list[dict], gamma: int) -> str:
    n = sum(len(r["drafted"]) - 1 for r in rows)
    offered = sum(sum(r["drafted"]) for r in rows)
    kept = sum(sum(r["accepted"]) for r in rows)
    rho = Trace.of(rows, gamma).alpha()
    return f"| {category} | {len(rows)} | {n} | {offered / max(n, 1):.2f} | {kept / max(n, 1):.2f} | {rho:.3f} |"


if __name__ == "__main__":
    raise SystemExit(main())
