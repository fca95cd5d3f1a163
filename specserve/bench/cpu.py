"""CPU kernels benchmark: the engine with its CPU forward kernels on and off, side by side.

    python -m specserve.bench.cpu [--threads 2] [--per-category 4] [--out bench-results/cpu.json]

On the offline SmolLM2-135M-Instruct pair (engine/cpu_linear.py and engine/attention.py):

1. Forward cost by width: one forward of Q tokens (after 64 of context) for the target, the draft
   model and the feature head, kernels off and on, interleaved, best of `--reps`; v(Q) = cost(Q) /
   cost(1) is what a verify of γ = Q-1 drafts costs in forwards.
2. End to end: greedy batch-1 generation of the held-out prompts (chat, code, summarise), target
   alone and with the draft model or the feature head (adaptive γ), each with the kernels off and
   on; prompts interleaved across the six engines so that load drifts hit all of them alike. Every
   output is checked against the target alone with the kernels off.

Prints both tables and writes JSON.
"""
from __future__ import annotations

import argparse
import copy
import json
import time
from types import SimpleNamespace
from pathlib import Path

import torch
from tqdm import tqdm

from specserve.engine.step import RequestMetrics, per_token_alpha
from specserve.prompts import GENERAL, by_category, encode, load_records
from specserve.engine import RowInput, SamplingParams, SpeculativeEngine
from specserve.engine import attention
from specserve.engine.feature_drafter import FeatureDrafterSpec
from specserve.engine.model_runner import ModelRunner

WIDTHS = (1, 2, 3, 4, 5, 8)


def set_kernels(runner: ModelRunner, on: bool) -> None:
    runner.linear_kernels = on and runner.device.type == "cpu"
    runner.grouped_attention = runner.linear_kernels and attention.dispatches(runner.model)


def engine_runners(engine: SpeculativeEngine) -> list[ModelRunner]:
    runners = [engine.verifier.runner]
    inner = getattr(engine.proposer, "runner", None)
    return runners + ([inner] if isinstance(inner, ModelRunner) else [])


def forward_costs(runner: ModelRunner, reps: int) -> dict[str, dict[int, float]]:
    """{"off"/"on": {Q: best seconds}} for one model, the two interleaved."""
    context = list(range(100, 164))
    best = {mode: {q: float("inf") for q in WIDTHS} for mode in ("off", "on")}
    runner.forward([RowInput("__cpu__", 0, context)], logits="none")
    for _ in range(reps):
        for q in WIDTHS:
            for mode in ("off", "on"):
                set_kernels(runner, mode == "on")
                began = time.perf_counter()
                runner.forward([RowInput("__cpu__", len(context), list(range(200, 200 + q)))], logits="all")
                best[mode][q] = min(best[mode][q], time.perf_counter() - began)
    runner.free("__cpu__")
    set_kernels(runner, True)
    return best


def build_engines(target, draft, heads: list[str], gamma: int, modes=("off", "on"), floors=(None,),
                  lookups=(None,)) -> dict[tuple[str, str], SpeculativeEngine]:
    """{(method, "off"/"on"): engine}, each calibrated with its own kernels; a head row per
    confidence floor in `floors` (None: the head drafts every planned position) and lookup
    n-gram length in `lookups` (None: the head drafts every row)."""
    makers = {"target-only": lambda: SpeculativeEngine(target, num_speculative_tokens=0)}
    if draft is not None:
        makers["draft model"] = lambda: SpeculativeEngine(target, draft, num_speculative_tokens=gamma)
    for i, head in enumerate(heads):
        for floor in floors:
            for lookup in lookups:
                name = (("feature head" if i == 0 else f"head {Path(head).name}")
                        + ("" if floor is None else f" c{floor:g}") + ("" if lookup is None else f" +lookup{lookup}"))
                makers[name] = lambda head=head, floor=floor, lookup=lookup: SpeculativeEngine(
                    target, drafter=FeatureDrafterSpec(head, floor, lookup), num_speculative_tokens=gamma)
    engines = {}
    for method, make in makers.items():
        for mode in modes:
            engine = make()
            for runner in engine_runners(engine):
                set_kernels(runner, mode == "on")
            if method != "target-only":
                engine.calibrate()
            engines[method, mode] = engine
    return engines


class HFGenerate:
    """HF `generate` (greedy, the model's own EOS and generation config) behind the engine's
    `generate` call: the baseline users compare the engine's target-only decoding with, one more
    end-to-end row interleaved with the engines'."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list:
        config = copy.deepcopy(self.model.generation_config)
        config.update(max_new_tokens=params.max_tokens, do_sample=False)
        outs = []
        for prompt in prompts:
            ids = torch.tensor([prompt])
            with torch.no_grad():
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            outs.append(SimpleNamespace(token_ids=out[0, len(prompt):].tolist(), metrics=RequestMetrics()))
        return outs


def end_to_end(engines, prompts: dict[str, list[list[int]]], max_new: int) -> list[dict]:
    params = SamplingParams(max_tokens=max_new, temperature=0.0)
    rows = []
    total = sum(map(len, prompts.values())) * len(engines)
    with tqdm(total=total, desc="generate", unit="run") as bar:
        for category, items in prompts.items():
            acc = {key: {"tokens": 0, "seconds": 0.0, "drafted": 0, "accepted": 0, "rejections": 0,
                          "outputs": []} for key in engines}
            for prompt in items:
                for key, engine in engines.items():
                    began = time.perf_counter()
                    out = engine.generate([prompt], params)[0]
                    a = acc[key]
                    a["seconds"] += time.perf_counter() - began
                    a["tokens"] += len(out.token_ids)
                    a["drafted"] += out.metrics.num_draft_tokens
                    a["accepted"] += out.metrics.num_accepted_tokens
                    a["rejections"] += out.metrics.num_rejections
                    a["outputs"].append(out.token_ids)
                    bar.update(1)
            reference = acc["target-only", "off" if ("target-only", "off") in acc else "on"]
            base_rate = reference["tokens"] / reference["seconds"]
            for (method, mode), a in acc.items():
                rate = a["tokens"] / a["seconds"]
                rows.append({"category": category, "method": method, "kernels": mode, "tok_s": rate,
                             "tokens": a["tokens"], "seconds": a["seconds"],
                             "alpha": per_token_alpha(a["accepted"], a["rejections"]),
                             "accept_ratio": a["accepted"] / a["drafted"] if a["drafted"] else None,
                             "draft_tokens": a["drafted"], "identical": a["outputs"] == reference["outputs"],
                             "speedup_vs_off": rate / base_rate})
            bases = {r["kernels"]: r for r in rows if r["category"] == category and r["method"] == "target-only"}
            base_on = bases.get("on") or bases["off"]
            for r in rows:
                if r["category"] == category:
                    r["speedup_vs_on"] = r["tok_s"] / base_on["tok_s"]
    return rows


def cost_table(costs: dict[str, dict]) -> str:
    head = f"{'model':<22}{'kernels':<9}" + "".join(f"{f'Q={q} ms':>10}" for q in WIDTHS) + "".join(
        f"{f'v({q})':>7}" for q in WIDTHS[1:])
    lines = [head, "-" * len(head)]
    for model, by_mode in costs.items():
        for mode, best in by_mode.items():
            lines.append(f"{model:<22}{mode:<9}" + "".join(f"{best[q] * 1e3:>10.1f}" for q in WIDTHS)
                         + "".join(f"{best[q] / best[1]:>7.2f}" for q in WIDTHS[1:]))
    return "\n".join(lines)


def e2e_table(rows: list[dict]) -> str:
    head = (f"{'category':<11}{'method':<22}{'kernels':<9}{'tok/s':>7}{'α':>7}{'acc/dr':>7}{'drafts':>8}"
            f"{'vs target off':>15}{'vs target on':>14}{'same':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        alpha = "".join(f"{r[k]:>7.3f}" if r[k] is not None else f"{'-':>7}" for k in ("alpha", "accept_ratio"))
        lines.append(f"{r['category']:<11}{r['method']:<22}{r['kernels']:<9}{r['tok_s']:>7.1f}{alpha}"
                     f"{r['draft_tokens']:>8}{r['speedup_vs_off']:>15.2f}{r['speedup_vs_on']:>14.2f}"
                     f"{'yes' if r['identical'] else 'NO':>6}")
    return "\n".join(lines)


def hf_summary(rows: list[dict], mode: str) -> str:
    """The engine's target-only decoding against HF generate over every prompt: tokens per second
    summed over categories as time, each side's own tokens."""
    def rate(method: str, kernels: str) -> float:
        picked = [r for r in rows if r["method"] == method and r["kernels"] == kernels]
        return sum(r["tokens"] for r in picked) / sum(r["seconds"] for r in picked)

    engine, hf = rate("target-only", mode), rate("HF generate", "-")
    same = all(r["identical"] for r in rows if r["method"] == "HF generate")
    return (f"target-only (kernels {mode}) {engine:.1f} tok/s, HF generate {hf:.1f} tok/s: "
            f"{engine / hf:.3f}x; same tokens: {'yes' if same else 'NO'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--per-category", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=4, help="most drafts per step (adaptive below it)")
    parser.add_argument("--feature-head", nargs="*", default=["smollm2-eagle"],
                        help="head directories or shipped names (none: no head rows); the first is 'feature head'")
    parser.add_argument("--min-confidence", nargs="*", default=["none"],
                        help="confidence floors of the head rows ('none': every planned draft), e.g. none 0.3")
    parser.add_argument("--lookup-min-n", nargs="*", default=["none"],
                        help="head rows' prompt-lookup n-gram lengths ('none': the head drafts every row), e.g. none 3")
    parser.add_argument("--prompts", default=str(GENERAL),
                        help="a prompt set (JSON lines with category), default the held-out benchmark set")
    parser.add_argument("--kernels", default="off,on", help="which modes to run end to end: off,on / on / off")
    parser.add_argument("--reps", type=int, default=6, help="forwards per width and mode (best kept)")
    parser.add_argument("--no-hf", action="store_true", help="no HF generate row")
    parser.add_argument("--no-draft-model", action="store_true", help="no draft-model row")
    parser.add_argument("--out", default="bench-results/cpu.json")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from specserve.models.smollm2 import load_smollm2_draft, load_smollm2_target

    target, tokenizer = load_smollm2_target()
    draft = load_smollm2_draft(target)
    modes = tuple(args.kernels.split(","))
    floors = tuple(None if f == "none" else float(f) for f in args.min_confidence)
    lookups = tuple(None if n == "none" else int(n) for n in args.lookup_min_n)
    engines = build_engines(target, None if args.no_draft_model else draft, args.feature_head, args.gamma, modes,
                            floors, lookups)
    costs = {method: forward_costs(engine_runners(engine)[-1], args.reps)
             for (method, mode), engine in engines.items() if mode == modes[-1]}
    print(cost_table(costs))
    if not args.no_hf:
        engines["HF generate", "-"] = HFGenerate(target)
    prompts = {category: [encode(tokenizer, r) for r in records[: args.per_category]]
               for category, records in by_category(load_records(Path(args.prompts))).items()}
    rows = end_to_end(engines, prompts, args.max_new_tokens)
    print(e2e_table(rows))
    if not args.no_hf:
        print(hf_summary(rows, modes[-1]))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"threads": torch.get_num_threads(), "widths": list(WIDTHS), "end_to_end": rows,
              "forward_seconds": {m: {mode: {str(q): s for q, s in b.items()} for mode, b in d.items()}
                                  for m, d in costs.items()}}
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
