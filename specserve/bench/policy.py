"""The γ policy replayed on measured forward costs: adaptive against every fixed γ, no model run.

    python -m specserve.bench.policy [--costs costs.json] [--out bench-results/policy.json]
    python -m specserve.bench.policy --costs bench-results/gpu.json --select random/16/0.8
    python -m specserve.bench.policy --fixture cpu-demo --staggered --offer 0.41 --max-gamma 6 --tokens 48
    python -m specserve.bench.policy --fixture cpu-demo --trace smollm2-head --staggered --max-gamma 6 --tokens 64

A step's cost is what the GPU measured per forward size (`Costs`, by default the H100 fixture
below; `--fixture cpu-demo`: the README demo's on a 2-core CPU), its acceptances are drawn i.i.d.
at α, and the real `SpeculationPolicy` picks γ every step from what it has observed, exactly as in
the engine: start-up calibration, live timings with noise, per-request acceptance estimates,
probes, the draft's catch-up over tokens it skipped. Each (batch, α) cell serves `rounds` rounds of
`batch` new requests of `tokens` tokens each (or, `--staggered`, as many requests each joining as
another ends), one policy throughout (a server's); with `--offer` below 1 the drafter declines
positions as a confidence floor does; with `--trace` each request is one a real drafter met, its
offers and hits position by position as recorded (`specserve bench acceptance`). It reports
tokens per simulated second for the adaptive policy and for every fixed γ, side by side. What this
checks is the policy's own loss (probes, wrong γ, learning), which no GPU noise hides; whether the
costs are right is for `bench gpu` to say.
"""
from __future__ import annotations

import argparse
import itertools
import json
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specserve.engine.model_runner import CALIBRATION_SIZES, DRAFT_ROW_TOKENS, ForwardTiming
from specserve.engine.policy import AcceptanceEstimate, SpeculationPolicy, expected_tokens_summed, interpolate


@dataclass
class Costs:
    """Seconds of one forward by tokens processed, read as the policy reads its own tables
    (`interpolate`: linear between the sizes given, along the last segment beyond them, never
    downwards), plus host seconds per call (a verify, a draft loop)."""

    target: dict[int, float]
    draft: dict[int, float]
    overhead: float = 0.0
    source: str = ""

    def seconds(self, model: str, tokens: int) -> float:
        return interpolate(self.target if model == "target" else self.draft, tokens)

    @classmethod
    def load(cls, path: str | Path, select: str | None = None) -> "Costs":
        """A Costs JSON file; or, with select "section/batch/α", what the adaptive engine of that
        cell of a `bench gpu` JSON had measured (its "costs" → section → batch → "policy" → α)."""
        raw = json.loads(Path(path).read_text())
        if select is not None:
            section, batch, alpha = select.split("/")
            raw = raw["costs"][section][batch]["policy"][alpha]
        return cls({int(k): v for k, v in raw["target"].items()}, {int(k): v for k, v in raw["draft"].items()},
                   raw.get("overhead", 0.0), raw.get("source", f"{path} {select or ''}".strip()))

    @classmethod
    def measured(cls, policy: SpeculationPolicy, source: str) -> "Costs":
        """What a live policy has learnt: each model's cost at every size it knows, its overhead."""
        return cls(policy.target_cost.table(), policy.draft_cost.table(), policy.overhead, source)


# One H100, random-weight Llama-2-7B target / TinyLlama-1.1B draft shapes, bf16, CUDA graphs
# (docs/engine.md, "Measured on an H100"): γ=0 steps of 9.1 ms at batch 1 and 12.2 ms at 16;
# γ=2 steps of 17.3 ms at batch 1 and 36.5 ms at 16 (from their speedups at α 0.6 and 0.8),
# split with c ≈ 0.3 (draft 2.7 ms at batch 1, 4.0 ms at 16); a probe's catch-up over ~1,000
# skipped tokens at batch 16 took 55 ms. Sizes between are interpolated.
H100_7B = Costs(
    target={1: 9.1e-3, 3: 11.9e-3, 5: 13.5e-3, 16: 12.2e-3, 48: 28.5e-3, 80: 40.0e-3},
    draft={1: 2.7e-3, 16: 4.0e-3, 1024: 55e-3},
    overhead=0.3e-3,
    source="H100, 7B/1.1B shapes, bf16, CUDA graphs (docs/engine.md)",
)


# The README demo on a 2-core CPU: SmolLM2-135M-Instruct target, fp32, and its shipped feature head
# (as a live engine's policy learnt them under a staggered batch of 4); the head drafts inside the
# target's step (no catch-up forwards of its own worth pricing apart). With its confidence floor
# (0.35) it drafted about 0.41 of each row's next planned positions (`--offer 0.41`), and about 0.65
# of those were accepted.
CPU_DEMO = Costs(
    target={1: 41.9e-3, 2: 41.7e-3, 3: 52.5e-3, 4: 54.6e-3, 5: 57.5e-3, 6: 68.2e-3, 7: 75.9e-3, 8: 77.6e-3,
            16: 101.0e-3, 32: 141.6e-3, 64: 211.1e-3},
    draft={1: 3.4e-3, 4: 5.0e-3, 8: 7.0e-3, 16: 9.2e-3, 64: 16.6e-3},
    overhead=1.0e-3,
    source="2-core CPU, SmolLM2-135M target + shipped feature head, fp32 (the README demo)",
)
# The same target with its trained draft model (configs/local-draft.yaml's pair) in one engine on the
# 2-core CPU, as a live engine's policy learnt them under a staggered batch of 4 (c ≈ 0.14 at one
# token; the draft catches up on the tokens it skipped, at its cost by size).
CPU_DRAFT = Costs(
    target={1: 43.9e-3, 2: 36.4e-3, 3: 47.6e-3, 4: 47.6e-3, 5: 59.5e-3, 6: 65.6e-3, 7: 78.7e-3, 8: 73.0e-3,
            16: 96.9e-3, 20: 128.2e-3, 28: 146.4e-3, 32: 153.3e-3, 64: 248.1e-3},
    draft={1: 6.0e-3, 2: 5.9e-3, 3: 7.2e-3, 4: 6.7e-3, 5: 9.0e-3, 6: 9.7e-3, 7: 11.3e-3, 8: 9.7e-3, 16: 12.7e-3,
           32: 18.7e-3, 64: 31.1e-3},
    overhead=0.97e-3,
    source="2-core CPU, SmolLM2-135M target + its draft model, fp32, in one engine",
)
FIXTURES = {"h100-7b": H100_7B, "cpu-demo": CPU_DEMO, "cpu-draft": CPU_DRAFT}

# Recorded with `specserve bench acceptance` (γ 6, 64 greedy tokens of each of the 40 prompts of
# prompts.jsonl, SmolLM2-135M): smollm2-head, the README demo's head (its defaults: floor 0.35, prompt
# lookup from 3 tokens); smollm2-draft, the trained draft model (`--drafter draft-model`).
TRACES = {name: Path(__file__).parent / "traces" / f"{name}.json" for name in ("smollm2-head", "smollm2-draft")}


@dataclass(frozen=True)
class TraceRequest:
    """One request as a real drafter met it (`specserve bench acceptance`): [t] for t output tokens
    generated, how many drafts the drafter offers for the step that starts there (at most the
    trace's γ) and how many of them the target keeps. [0] is the prefill's token (no drafts)."""

    drafted: tuple[int, ...]
    accepted: tuple[int, ...]


@dataclass(frozen=True)
class Trace:
    """A drafter's acceptance on real prompts: each request's per-position offers and keeps,
    replayed instead of i.i.d. draws (`serve(trace=...)`), so that what the policy meets varies
    between requests and runs in streaks as the drafter's real misses do."""

    requests: tuple[TraceRequest, ...]
    gamma: int  # the most drafts a step of the recording planned: a replayed γ above it is clipped
    source: str = ""

    @classmethod
    def of(cls, rows: list[dict], gamma: int, source: str = "") -> "Trace":
        """From the recorder's rows ({"drafted": [...], "accepted": [...], ...}: a trace file's "requests")."""
        return cls(tuple(TraceRequest(tuple(r["drafted"]), tuple(r["accepted"])) for r in rows), gamma, source)

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        """A trace file, or the name of one shipped in specserve/bench/traces (`TRACES`)."""
        path = TRACES.get(str(path), path)
        raw = json.loads(Path(path).read_text())
        trace = cls.of(raw["requests"], int(raw["gamma"]), raw.get("source", str(path)))
        for i, r in enumerate(trace.requests):
            if len(r.drafted) != len(r.accepted) or any(a > d for a, d in zip(r.accepted, r.drafted)):
                raise ValueError(f"{path}: request {i} keeps more drafts than it offers, or its lists differ in length")
        return trace

    def alpha(self) -> float:
        """ρ over every position: kept / (kept + misses) of steps planned at the trace's γ."""
        kept = sum(sum(r.accepted[1:]) for r in self.requests)
        misses = sum(a < self.gamma for r in self.requests for a in r.accepted[1:])
        return kept / max(kept + misses, 1)


@dataclass
class _Row:
    tokens: int  # tokens held (prompt + output)
    draft_len: int  # of them, cached by the draft
    left: int  # tokens still to generate
    estimate: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)  # ρ
    offers: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)  # κ
    drafted_for: bool = False
    trace: TraceRequest | None = None  # where the drafts' fate comes from (None: i.i.d. at α)
    done: int = 0  # output tokens generated (a trace's position)

    def _at(self) -> int:
        """The trace's position this row stands at (its last one past the end)."""
        return min(self.done, len(self.trace.drafted) - 1)

    def offered(self, gamma: int, offer: float, rng: random.Random) -> int:
        """Drafts the drafter offers in a step that plans γ: from the trace, or each next position
        with chance `offer` until it first declines."""
        if self.trace is not None:
            return min(self.trace.drafted[self._at()], gamma)
        return gamma if offer >= 1.0 else next((i for i in range(gamma) if rng.random() >= offer), gamma)

    def kept(self, drafted: int, alpha: float, rng: random.Random) -> int:
        """Of `drafted` drafts, how many the target keeps: from the trace, or each with chance α."""
        if self.trace is not None:
            return min(self.trace.accepted[self._at()], drafted)
        accepted = 0
        while accepted < drafted and rng.random() < alpha:
            accepted += 1
        return accepted


@dataclass
class Served:
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    drafts: int = 0  # draft tokens proposed
    # γ chosen -> [steps, tokens the policy expected of them (Σ over rows of expected_tokens), tokens made]
    by_gamma: dict[int, list[float]] = field(default_factory=dict)

    def add(self, other: "Served") -> None:
        self.tokens, self.seconds = self.tokens + other.tokens, self.seconds + other.seconds
        self.steps, self.drafts = self.steps + other.steps, self.drafts + other.drafts
        for g, counts in other.by_gamma.items():
            self.by_gamma[g] = [a + b for a, b in zip(self.by_gamma.get(g, [0, 0.0, 0]), counts)]

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def serve(policy: SpeculationPolicy, costs: Costs, batch: int, alpha: float, rounds: int, tokens: int,
          prompt: int = 128, noise: float = 0.03, seed: int = 0, staggered: bool = False, offer: float = 1.0,
          trace: Trace | None = None) -> Served:
    """`rounds` x `batch` requests (prompt, then `tokens` generated each) under one policy: in rounds of
    `batch` that start together, or `staggered`: `batch` slots, each taking the next request as soon as
    its own ends (a server under steady load, where a new request joins a batch of older ones every
    tokens / batch steps); the first ones in a slot are already 0, 1/batch, 2/batch ... of the way in.
    offer: the chance that the drafter drafts each next planned position of a row (below 1: a
    confidence floor; `_step`). trace: the requests are the trace's, in an order the seed shuffles,
    each at most `tokens` long (`alpha` and `offer` are then unused)."""
    rng = random.Random(seed)
    calibrate(policy, costs)
    served = Served()
    requests = _requests(trace, seed)

    def new_row(done: int = 0) -> _Row:
        return _new_row(next(requests), prompt, tokens, done)

    if staggered:
        rows = [new_row(tokens * i // batch) for i in range(batch)]
        waiting = (rounds - 1) * batch
        while rows:
            _step(policy, costs, rows, alpha, rng, noise, served, offer)
            ended = sum(r.left <= 0 for r in rows)
            joining = min(ended, waiting)
            waiting -= joining
            rows = [r for r in rows if r.left > 0] + [new_row() for _ in range(joining)]
        return served
    for _ in range(rounds):
        rows = [new_row() for _ in range(batch)]
        while rows:
            _step(policy, costs, rows, alpha, rng, noise, served, offer)
            rows = [r for r in rows if r.left > 0]
    return served


def _requests(trace: Trace | None, seed: int) -> Iterator[TraceRequest | None]:
    """The requests rows take in turn: the trace's, shuffled by the seed, round and round (None: i.i.d.)."""
    if trace is None:
        return itertools.repeat(None)
    order = list(trace.requests)
    random.Random(seed).shuffle(order)
    return itertools.cycle(order)


def _new_row(request: TraceRequest | None, prompt: int, tokens: int, done: int) -> _Row:
    """A row `done` tokens into its output. A trace's row starts after the prefill's token (its [0])."""
    if request is None:
        return _Row(prompt + done, prompt - 1, tokens - done, done=done)
    length = min(tokens, len(request.drafted))
    done = min(max(done, 1), length - 1)
    return _Row(prompt + done, prompt - 1, length - done, trace=request, done=done)


def calibrate(policy: SpeculationPolicy, costs: Costs) -> None:
    """What an engine's start-up calibration gives the policy: each model's forward sizes."""
    for model in ("target", "draft"):
        policy.calibrate_costs(model, [ForwardTiming(n, costs.seconds(model, n)) for n in CALIBRATION_SIZES])


def _step(policy: SpeculationPolicy, costs: Costs, rows: list[_Row], alpha: float, rng: random.Random,
          noise: float, served: Served, offer: float = 1.0) -> None:
    """One step. With `offer` < 1 the drafter drafts each row's next planned position with that
    chance until it first declines (a confidence floor), the target verifies the longest run
    drafted, and the draft loop stops once no row drafts (the eager loop's early stop)."""
    alphas = [policy.alpha(r.estimate) for r in rows]
    backlog = sum(max(r.tokens - r.draft_len - DRAFT_ROW_TOKENS, 0) for r in rows)
    gamma = policy.choose(alphas, backlog, sum(not r.drafted_for for r in rows),
                          [policy.offer(r.offers) for r in rows])
    made = served.tokens

    def timed(model: str, n: int) -> ForwardTiming:
        return ForwardTiming(n, costs.seconds(model, n) * max(1.0 + rng.gauss(0.0, noise), 0.5))

    offered = [row.offered(gamma, offer, rng) for row in rows]
    width = max(offered, default=0)
    drafts = []
    if gamma > 0:
        loop = min(gamma, width + 1)  # (every row drafting all γ: γ forwards)
        drafts = ([timed("draft", backlog + len(rows))] if backlog else []) + [timed("draft", len(rows))] * loop
    verify = [timed("target", len(rows) * (width + 1))]
    wall = sum(f.seconds for f in (*drafts, *verify)) + costs.overhead * (1 + (gamma > 0))
    for row, drafted in zip(rows, offered):
        accepted = row.kept(drafted, alpha, rng)
        gained = min(accepted + 1, row.left)
        if gamma > 0:
            row.draft_len = row.tokens + min(accepted, gamma - 1)
            row.drafted_for = True
        row.tokens += gained
        row.done += gained
        row.left -= gained
        served.tokens += gained
        served.drafts += drafted
        policy.observe_acceptance(row.estimate, accepted, gamma)  # (as the engine: a decline is a miss)
        policy.observe_offers(row.offers, drafted, gamma)
    policy.observe_step(wall, drafts, verify, len(rows), gamma, backlog)
    served.seconds += wall
    served.steps += 1
    counts = served.by_gamma.setdefault(gamma, [0, 0.0, 0])
    counts[0] += 1
    counts[1] += expected_tokens_summed(alphas, gamma)[gamma]
    counts[2] += served.tokens - made


def compare(costs: Costs, batch: int, alpha: float, max_gamma: int, rounds: int, tokens: int,
            seeds: int = 4, staggered: bool = False, offer: float = 1.0, trace: Trace | None = None) -> dict:
    """{"adaptive": Served, "fixed": {γ: Served}} for one (batch, α) cell: each policy serves the
    same `seeds` independent runs (a fresh policy each), summed."""
    def total(make) -> Served:
        runs = [serve(make(), costs, batch, alpha, rounds, tokens, seed=seed, staggered=staggered, offer=offer,
                      trace=trace)
                for seed in range(seeds)]
        summed = Served()
        for run in runs:
            summed.add(run)
        return summed

    return {"adaptive": total(lambda: SpeculationPolicy(max_gamma)),
            "fixed": {g: total(lambda g=g: SpeculationPolicy(g, adaptive=False)) for g in range(max_gamma + 1)}}


def report(cells: list[tuple[int, float, dict]]) -> str:
    lines = ["| batch | α | γ=0 tok/s | best fixed γ (tok/s) | adaptive tok/s | drafts/step | adaptive / max |",
             "|---|---|---|---|---|---|---|"]
    for batch, alpha, cell in cells:
        fixed, adaptive = cell["fixed"], cell["adaptive"]
        best = max(fixed, key=lambda g: fixed[g].rate)
        ratio = adaptive.rate / max(fixed[0].rate, fixed[best].rate)
        lines.append(f"| {batch} | {alpha} | {fixed[0].rate:.0f} | {best} ({fixed[best].rate:.0f}) | "
                     f"{adaptive.rate:.0f} | {adaptive.drafts / max(adaptive.steps * batch, 1):.2f} | {ratio:.3f} |")
    return "\n".join(lines)


def report_by_gamma(cells: list[tuple[int, float, dict]]) -> str:
    """The adaptive policy's steps by the γ it chose: what it expected of them and what they made
    (an expectation above what the steps make, at the wide γ, is a policy widening on estimates
    that then regress)."""
    lines = ["| batch | α | γ chosen | steps | expected tokens a step | made |", "|---|---|---|---|---|---|"]
    for batch, alpha, cell in cells:
        for g, (steps, expected, made) in sorted(cell["adaptive"].by_gamma.items()):
            lines.append(f"| {batch} | {alpha} | {g} | {steps} | {expected / steps:.2f} | {made / steps:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--costs", default=None, help="JSON {target: {n: s}, draft: {n: s}, overhead: s}, or a "
                        "bench gpu JSON with --select")
    parser.add_argument("--fixture", choices=sorted(FIXTURES), default="h100-7b",
                        help="the built-in costs to replay without --costs")
    parser.add_argument("--select", default=None, help="with a bench gpu JSON: section/batch/α, e.g. random/16/0.8")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--alphas", default="0.6,0.8")
    parser.add_argument("--max-gamma", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--seeds", type=int, default=4, help="independent runs per policy, summed")
    parser.add_argument("--staggered", action="store_true",
                        help="requests join as others end (steady load) instead of in rounds that start together")
    parser.add_argument("--offer", type=float, default=1.0,
                        help="chance the drafter drafts each next planned position (below 1: a confidence floor)")
    parser.add_argument("--trace", default=None,
                        help="a drafter's recorded acceptance (`specserve bench acceptance`; or a shipped one: "
                        "smollm2-head, smollm2-draft) replayed instead of draws at --alphas / --offer; its α column "
                        "is the trace's ρ")
    parser.add_argument("--by-gamma", action="store_true",
                        help="also the adaptive policy's steps by γ chosen: the tokens it expected and those made")
    parser.add_argument("--out", default="bench-results/policy.json")
    args = parser.parse_args(argv)
    if not 0.0 < args.offer <= 1.0:
        parser.error("--offer must be in (0, 1]")
    trace = Trace.load(args.trace) if args.trace else None
    if trace is not None and args.max_gamma > trace.gamma:
        parser.error(f"--max-gamma {args.max_gamma} is above the trace's γ ({trace.gamma}): "
                     "it cannot say what more drafts would do")
    costs = Costs.load(args.costs, args.select) if args.costs else FIXTURES[args.fixture]
    alphas = [round(trace.alpha(), 3)] if trace else [float(a) for a in args.alphas.split(",")]
    cells = [(b, a, compare(costs, b, a, args.max_gamma, args.rounds, args.tokens, args.seeds, args.staggered,
                                 args.offer, trace))
             for b in map(int, args.batches.split(",")) for a in alphas]
    table = report(cells)
    source = f"trace {trace.source} ({len(trace.requests)} requests)" if trace else f"offer {args.offer}"
    print(f"costs: {costs.source}; {'staggered arrivals' if args.staggered else 'rounds'}; {source}\n{table}")
    if args.by_gamma:
        print(f"\nthe adaptive policy's steps\n{report_by_gamma(cells)}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"batch": b, "alpha": a, "adaptive": asdict(c["adaptive"]),
             "fixed": {g: asdict(s) for g, s in c["fixed"].items()}} for b, a, c in cells]
    out.write_text(json.dumps({"costs": asdict(costs), "staggered": args.staggered, "offer": args.offer,
                               "trace": trace and trace.source,
                               "table": table, "cells": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
