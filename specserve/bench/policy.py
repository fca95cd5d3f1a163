"""The γ policy replayed on measured forward costs: adaptive against every fixed γ, no model run.

    python -m specserve.bench.policy [--costs costs.json] [--out bench-results/policy.json]
    python -m specserve.bench.policy --costs bench-results/gpu.json --select random/16/0.8
    python -m specserve.bench.policy --fixture cpu-demo --staggered --offer 0.41 --max-gamma 6 --tokens 48

A step's cost is what the GPU measured per forward size (`Costs`, by default the H100 fixture
below; `--fixture cpu-demo`: the README demo's on a 2-core CPU), its acceptances are drawn i.i.d.
at α, and the real `SpeculationPolicy` picks γ every step from what it has observed, exactly as in
the engine: start-up calibration, live timings with noise, per-request acceptance estimates,
probes, the draft's catch-up over tokens it skipped. Each (batch, α) cell serves `rounds` rounds of
`batch` new requests of `tokens` tokens each (or, `--staggered`, as many requests each joining as
another ends), one policy throughout (a server's); with `--offer` below 1 the drafter declines
positions as a confidence floor does. It reports tokens per simulated second for the adaptive
policy and for every fixed γ, side by side. What this checks is the policy's own loss (probes,
wrong γ, learning), which no GPU noise hides; whether the costs are right is for `bench gpu` to say.
"""
from __future__ import annotations

import argparse
import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specserve.engine.model_runner import CALIBRATION_SIZES, DRAFT_ROW_TOKENS, ForwardTiming
from specserve.engine.policy import AcceptanceEstimate, SpeculationPolicy, interpolate


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
FIXTURES = {"h100-7b": H100_7B, "cpu-demo": CPU_DEMO}


@dataclass
class _Row:
    tokens: int  # tokens held (prompt + output)
    draft_len: int  # of them, cached by the draft
    left: int  # tokens still to generate
    estimate: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)  # ρ
    offers: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)  # κ
    drafted_for: bool = False


@dataclass
class Served:
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    drafts: int = 0  # draft tokens proposed

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def serve(policy: SpeculationPolicy, costs: Costs, batch: int, alpha: float, rounds: int, tokens: int,
          prompt: int = 128, noise: float = 0.03, seed: int = 0, staggered: bool = False, offer: float = 1.0) -> Served:
    """`rounds` x `batch` requests (prompt, then `tokens` generated each) under one policy: in rounds of
    `batch` that start together, or `staggered`: `batch` slots, each taking the next request as soon as
    its own ends (a server under steady load, where a new request joins a batch of older ones every
    tokens / batch steps); the first ones in a slot are already 0, 1/batch, 2/batch ... of the way in.
    offer: the chance that the drafter drafts each next planned position of a row (below 1: a
    confidence floor; `_step`)."""
    rng = random.Random(seed)
    calibrate(policy, costs)
    served = Served()
    if staggered:
        rows = [_Row(prompt + done, prompt - 1, tokens - done) for done in (tokens * i // batch for i in range(batch))]
        waiting = (rounds - 1) * batch
        while rows:
            _step(policy, costs, rows, alpha, rng, noise, served, offer)
            ended = sum(r.left <= 0 for r in rows)
            joining = min(ended, waiting)
            waiting -= joining
            rows = [r for r in rows if r.left > 0] + [_Row(prompt, prompt - 1, tokens) for _ in range(joining)]
        return served
    for _ in range(rounds):
        rows = [_Row(prompt, prompt - 1, tokens) for _ in range(batch)]
        while rows:
            _step(policy, costs, rows, alpha, rng, noise, served, offer)
            rows = [r for r in rows if r.left > 0]
    return served


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

    def timed(model: str, n: int) -> ForwardTiming:
        return ForwardTiming(n, costs.seconds(model, n) * max(1.0 + rng.gauss(0.0, noise), 0.5))

    offered = [gamma] * len(rows)
    if offer < 1.0:
        offered = [next((i for i in range(gamma) if rng.random() >= offer), gamma) for _ in rows]
    width = max(offered, default=0)
    drafts = []
    if gamma > 0:
        loop = min(gamma, width + 1)  # (every row drafting all γ: γ forwards)
        drafts = ([timed("draft", backlog + len(rows))] if backlog else []) + [timed("draft", len(rows))] * loop
    verify = [timed("target", len(rows) * (width + 1))]
    wall = sum(f.seconds for f in (*drafts, *verify)) + costs.overhead * (1 + (gamma > 0))
    for row, drafted in zip(rows, offered):
        accepted = 0
        while accepted < drafted and rng.random() < alpha:
            accepted += 1
        gained = min(accepted + 1, row.left)
        if gamma > 0:
            row.draft_len = row.tokens + min(accepted, gamma - 1)
            row.drafted_for = True
        row.tokens += gained
        row.left -= gained
        served.tokens += gained
        served.drafts += drafted
        policy.observe_acceptance(row.estimate, accepted, gamma)  # (as the engine: a decline is a miss)
        policy.observe_offers(row.offers, drafted, gamma)
    policy.observe_step(wall, drafts, verify, len(rows), gamma, backlog)
    served.seconds += wall
    served.steps += 1


def compare(costs: Costs, batch: int, alpha: float, max_gamma: int, rounds: int, tokens: int,
            seeds: int = 4, staggered: bool = False, offer: float = 1.0) -> dict:
    """{"adaptive": Served, "fixed": {γ: Served}} for one (batch, α) cell: each policy serves the
    same `seeds` independent runs (a fresh policy each), summed."""
    def total(make) -> Served:
        runs = [serve(make(), costs, batch, alpha, rounds, tokens, seed=seed, staggered=staggered, offer=offer)
                for seed in range(seeds)]
        return Served(*(sum(getattr(r, f) for r in runs) for f in ("tokens", "seconds", "steps", "drafts")))

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
    parser.add_argument("--out", default="bench-results/policy.json")
    args = parser.parse_args(argv)
    if not 0.0 < args.offer <= 1.0:
        parser.error("--offer must be in (0, 1]")
    costs = Costs.load(args.costs, args.select) if args.costs else FIXTURES[args.fixture]
    cells = [(b, a, compare(costs, b, a, args.max_gamma, args.rounds, args.tokens, args.seeds, args.staggered,
                                 args.offer))
             for b in map(int, args.batches.split(",")) for a in map(float, args.alphas.split(","))]
    table = report(cells)
    print(f"costs: {costs.source}; {'staggered arrivals' if args.staggered else 'rounds'}; offer {args.offer}\n{table}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"batch": b, "alpha": a, "adaptive": asdict(c["adaptive"]),
             "fixed": {g: asdict(s) for g, s in c["fixed"].items()}} for b, a, c in cells]
    out.write_text(json.dumps({"costs": asdict(costs), "staggered": args.staggered, "offer": args.offer,
                               "table": table, "cells": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
