"""Tune a layer-skip drafter: which decoder layers should the self-speculative draft skip?

    python -m specserve.tuning.layer_skip --model smollm2 --trials 80 --time-budget 600

An Optuna TPE search over skip sets (one yes/no per decoder layer). Each trial measures, on a few
prompts of `specserve/prompts/prompts.jsonl`:

- α: the engine runs greedy with the layer-skip drafter at a fixed γ (all prompts in one batch);
  α = accepted / (accepted + rejections), the per-token rate of the geometric model;
- c: the median time of one batch-1 forward of the skip view over that of the full target,
  measured side by side (interleaved) so that load on a shared machine hits both alike;

and maximises the speedup bound (1 - α^(γ+1)) / ((1 - α)(γc + v(γ))), with v(γ) the target's cost
of verifying γ+1 tokens over one token (measured once at the start; docs/architecture.md §1), at the
best γ <= --gamma (α measured at one γ holds for all under the geometric model), or, with
`--objective speed`, the measured tokens/s over target-only tokens/s at the same batch and γ.
The untuned baseline (skip every other layer) is the first trial. Writes the best skip set as a
JSON and a YAML config snippet, and a PNG plot of the trials.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specserve.engine.step import per_token_alpha
from specserve.prompts import GENERAL, encode, interleaved, load_records
from specserve.engine import RowInput, SamplingParams, SpeculativeEngine
from specserve.engine.model_runner import ModelRunner
from specserve.engine.proposers import LayerSkipProposer, LayerSkipSpec, decoder_layers, target_vocab_size
from specserve.engine.policy import expected_tokens


@dataclass
class Evaluation:
    skip_layers: tuple[int, ...]
    alpha: float
    mean_accepted_length: float  # tokens per step
    c: float
    bound: float  # the speedup bound with v, at the best γ <= the searched γ
    best_gamma: int  # that γ
    speedup: float  # measured tokens/s over target-only tokens/s (noisy)
    seconds: float  # the trial's wall time

    def objective(self, kind: str) -> float:
        return self.bound if kind == "bound" else self.speedup


def load_model(kind: str):
    """(target, tokenizer)."""
    if kind == "smollm2":
        from specserve.models.smollm2 import load_smollm2_target

        return load_smollm2_target()
    if kind == "tiny":
        from specserve.models.tiny import byte_tokenizer, tiny_llama

        return tiny_llama(0, layers=6), byte_tokenizer()
    raise SystemExit(f"unknown model {kind!r} (smollm2 | tiny)")


class Evaluator:
    def __init__(self, target: torch.nn.Module, prompts: list[list[int]], gamma: int, max_new: int, reps: int):
        self.target = target
        self.prompts = prompts
        self.gamma = gamma
        self.max_new = max_new
        self.reps = reps
        self.vocab = target_vocab_size(target)
        self.num_layers = len(decoder_layers(target)[1])
        self.target_runner = ModelRunner(target)
        self.params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
        self._run(None)  # warm-up
        self.v = self._verify_ratios(prompts[0])  # {γ: v(γ)} for γ = 1..gamma
        self.target_tokens_per_second = self._run(None)[0]
        self.cache: dict[tuple[int, ...], Evaluation] = {}

    def _run(self, proposer) -> tuple[float, int, int, int, int]:
        """(tokens/s, steps, tokens, accepted, rejections) of greedy generation over all prompts, one batch."""
        gamma = self.gamma if proposer is not None else 0
        engine = SpeculativeEngine(self.target, proposer=proposer, num_speculative_tokens=gamma, adaptive=False,
                                   max_batch_size=len(self.prompts))
        began = time.perf_counter()
        outs = engine.generate(self.prompts, self.params)
        seconds = time.perf_counter() - began
        tokens = sum(len(o.token_ids) for o in outs)
        steps = sum(o.metrics.num_steps for o in outs)
        accepted = sum(o.metrics.num_accepted_tokens for o in outs)
        rejections = sum(o.metrics.num_rejections for o in outs)
        return tokens / seconds, steps, tokens, accepted, rejections

    def evaluate(self, skip: tuple[int, ...]) -> Evaluation:
        skip = LayerSkipSpec(skip).skip_layers
        if skip in self.cache:
            return self.cache[skip]
        began = time.perf_counter()
        proposer = LayerSkipProposer(self.target, skip, self.vocab)
        speed, steps, tokens, accepted, rejections = self._run(proposer)
        alpha = per_token_alpha(accepted, rejections) or 0.0
        c = self._cost_ratio(proposer.runner)
        bound, best_gamma = self.bound(alpha, c)
        result = Evaluation(skip, alpha, tokens / max(steps, 1), c, bound, best_gamma,
                            speed / self.target_tokens_per_second, time.perf_counter() - began)
        self.cache[skip] = result
        return result

    def bound(self, alpha: float, c: float) -> tuple[float, int]:
        """(best speedup bound, its γ) over γ = 1..gamma: α measured at one γ holds for all (geometric model)."""
        return max((expected_tokens(alpha, g) / (g * c + self.v[g]), g) for g in self.v)

    def _verify_ratios(self, context: list[int]) -> dict[int, float]:
        """v(γ): median over reps of (target forward over γ+1 tokens / over 1 token), timed back to back."""
        runner = self.target_runner
        runner.forward([RowInput("__v__", 0, context)], logits="none")
        ratios: dict[int, list[float]] = {g: [] for g in range(1, self.gamma + 1)}
        for _ in range(self.reps):
            for g in ratios:
                runner.forward([RowInput("__v__", len(context), [context[-1]])], logits="last")
                one = runner.last_forward_seconds
                runner.forward([RowInput("__v__", len(context), [context[-1]] * (g + 1))], logits="all")
                ratios[g].append(runner.last_forward_seconds / one)
        runner.free("__v__")
        return {g: max(statistics.median(r), 1.0) for g, r in ratios.items()}

    def _cost_ratio(self, view: ModelRunner) -> float:
        """Median over reps of (view forward / target forward), the two timed one after the other."""
        context = self.prompts[0]
        ratios = []
        for ctx in ("__a__", "__b__"):
            self.target_runner.forward([RowInput(ctx, 0, context)], logits="none")
            view.forward([RowInput(ctx, 0, context)], logits="none")
        for i in range(self.reps):
            ctx = "__a__" if i % 2 == 0 else "__b__"
            view.forward([RowInput(ctx, len(context), [context[-1]])], logits="last")
            d = view.last_forward_seconds
            self.target_runner.forward([RowInput(ctx, len(context), [context[-1]])], logits="last")
            t = self.target_runner.last_forward_seconds
            ratios.append(d / t)
        for ctx in ("__a__", "__b__"):
            self.target_runner.free(ctx)
            view.free(ctx)
        return statistics.median(ratios)


def search(evaluator: Evaluator, trials: int, time_budget: float, objective: str, seed: int, show_progress: bool,
           max_skip: int | None = None, allow_ends: bool = False):
    """The baseline (every other layer) first, then a TPE search.

    Parameterisation: how many layers to skip (1..max_skip), and a score per candidate layer; the
    lowest-scored layers are skipped. Unlike one yes/no per layer, this lets random start-up trials
    try small skip sets as often as large ones (on a small model, skipping half the layers leaves
    almost nothing accepted). The first and last layers are not candidates unless allow_ends.
    """
    import optuna
    from tqdm import tqdm

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    n = evaluator.num_layers
    candidates = list(range(n)) if allow_ends else list(range(1, n - 1))
    max_skip = max(1, min(max_skip or n // 2, len(candidates)))
    bar = tqdm(total=trials + 1, desc="layer-skip search", unit="trial", disable=not show_progress)
    evaluations = [evaluator.evaluate(LayerSkipSpec.every_other(n).skip_layers)]
    bar.update(1)
    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=min(8, max(trials // 4, 1)), multivariate=True)
    study = optuna.create_study(direction="maximize", sampler=sampler)

    def run_trial(trial) -> float:
        count = trial.suggest_int("num_skip", 1, max_skip)
        scores = {i: trial.suggest_float(f"score_{i}", 0.0, 1.0) for i in candidates}
        skip = tuple(sorted(sorted(candidates, key=scores.__getitem__)[:count]))
        result = evaluator.evaluate(skip)
        evaluations.append(result)
        for key, value in asdict(result).items():
            trial.set_user_attr(key, list(value) if isinstance(value, tuple) else value)
        return result.objective(objective)

    def advance(study, trial) -> None:
        best = max(evaluations, key=lambda e: e.objective(objective))
        bar.set_postfix_str(f"best {objective}={best.objective(objective):.3f} α={best.alpha:.2f} c={best.c:.2f}")
        bar.update(1)

    study.optimize(run_trial, n_trials=trials, timeout=time_budget, callbacks=[advance])
    bar.close()
    return evaluations[0], max(evaluations, key=lambda e: e.objective(objective)), evaluations


def plot(evaluations: list[Evaluation], baseline: Evaluation, best: Evaluation, objective: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = [e.objective(objective) for e in evaluations]
    running = [max(values[: i + 1]) for i in range(len(values))]
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(16, 4.5))
    left.scatter(range(len(values)), values, s=14, label="trial")
    left.plot(range(len(values)), running, color="C1", label="best so far")
    left.axhline(baseline.objective(objective), color="C2", ls="--", label="baseline (every other layer)")
    left.axhline(1.0, color="grey", lw=0.8)
    left.set(xlabel="trial", ylabel=f"objective ({objective})", title="search progress")
    left.legend(fontsize=8)
    scatter = middle.scatter([e.c for e in evaluations], [e.alpha for e in evaluations], c=values, s=16, cmap="viridis")
    middle.scatter([baseline.c], [baseline.alpha], marker="s", s=60, facecolors="none", edgecolors="C2", label="baseline")
    middle.scatter([best.c], [best.alpha], marker="*", s=140, color="C3", label="best")
    middle.set(xlabel="c (skip view / target forward)", ylabel="α", title="acceptance vs cost")
    middle.legend(fontsize=8)
    fig.colorbar(scatter, ax=middle, label=objective)
    num_layers = max(max(e.skip_layers, default=0) for e in evaluations) + 1
    top = sorted(evaluations, key=lambda e: e.objective(objective), reverse=True)[: max(5, len(evaluations) // 5)]
    share = [sum(i in e.skip_layers for e in top) / len(top) for i in range(num_layers)]
    right.bar(range(num_layers), share, color="C0", label="top trials")
    right.scatter(best.skip_layers, [1.02] * len(best.skip_layers), marker="v", color="C3", label="best set")
    right.set(xlabel="decoder layer", ylabel="share of top trials skipping it", ylim=(0, 1.1),
              title="which layers are skipped")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def snippet(gamma: int, best: Evaluation) -> dict:
    """The fields of a serve application's `args` (specserve.config.AppConfig) this result sets:
    `drafter` is a top-level field, next to `speculation`."""
    return {
        "drafter": {"kind": "layer_skip", "skip_layers": list(best.skip_layers)},
        "speculation": {"num_speculative_tokens": gamma, "adaptive": True},
    }


def snippet_header(model: str, best: Evaluation) -> str:
    return (f"# Layer-skip drafter tuned for {model}: alpha={best.alpha:.4f} c={best.c:.4f} bound={best.bound:.4f}.\n"
            "# Merge these keys into an application's `args` in a serve config (e.g. configs/local.yaml).\n")


def describe(label: str, e: Evaluation, num_layers: int, gamma: int) -> str:
    return (f"{label:<9} skip {len(e.skip_layers):>2}/{num_layers} {list(e.skip_layers)}\n"
            f"{'':<9} α={e.alpha:.3f}  tokens/step={e.mean_accepted_length:.2f}  c={e.c:.3f}  "
            f"bound={e.bound:.3f} at γ={e.best_gamma}  measured speedup at γ={gamma}: {e.speedup:.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"])
    parser.add_argument("--trials", type=int, default=80)
    parser.add_argument("--time-budget", type=float, default=600.0, help="seconds of searching (model loading excluded)")
    parser.add_argument("--gamma", type=int, default=4, help="fixed speculation length during the search")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per trial (categories interleaved)")
    parser.add_argument("--prompts-file", default=str(GENERAL))
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=7, help="timed forward pairs per c measurement")
    parser.add_argument("--objective", default="bound", choices=["bound", "speed"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default="bench-results/layer-skip")
    parser.add_argument("--max-skip", type=int, default=None, help="most layers to skip (default: half)")
    parser.add_argument("--allow-ends", action="store_true", help="let the search skip the first and last layers")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.trials < 1 or args.gamma < 1:
        parser.error("--trials and --gamma must be >= 1")

    began = time.perf_counter()
    target, tokenizer = load_model(args.model)
    prompts = [encode(tokenizer, r) for r in interleaved(load_records(Path(args.prompts_file)), args.prompts)]
    evaluator = Evaluator(target, prompts, args.gamma, args.max_new_tokens, args.reps)
    v = " ".join(f"{g}:{x:.2f}" for g, x in evaluator.v.items())
    print(f"{args.model}: {evaluator.num_layers} layers, {len(prompts)} prompts, γ={args.gamma}, "
          f"v(γ)={v}, target-only {evaluator.target_tokens_per_second:.1f} tok/s "
          f"(threads={torch.get_num_threads()}); setup {time.perf_counter() - began:.0f}s")
    baseline, best, evaluations = search(evaluator, args.trials, args.time_budget, args.objective, args.seed,
                                         not args.no_progress, args.max_skip, args.allow_ends)
    num_layers = evaluator.num_layers
    print(describe("baseline", baseline, num_layers, args.gamma))
    print(describe("tuned", best, num_layers, args.gamma))
    gain = best.objective(args.objective) / baseline.objective(args.objective) if baseline.objective(args.objective) else math.inf
    print(f"{len(evaluations)} trials in {time.perf_counter() - began:.0f}s; tuned/baseline {args.objective}: {gain:.2f}x")

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = snippet(best.best_gamma, best)
    result = {
        **config,
        "objective": args.objective, "v": evaluator.v, "target_tokens_per_second": evaluator.target_tokens_per_second,
        "baseline": asdict(baseline), "best": asdict(best), "trials": [asdict(e) for e in evaluations],
        "args": vars(args),
    }
    (out / "layer_skip.json").write_text(json.dumps(result, indent=2) + "\n")
    try:
        import yaml

        text = yaml.safe_dump(config, sort_keys=False, default_flow_style=None)
        (out / "layer_skip.yaml").write_text(snippet_header(args.model, best) + text)
    except ImportError:
        pass
    plot(evaluations, baseline, best, args.objective, out / "layer_skip_trials.png")
    print(f"wrote {out / 'layer_skip.json'}, {out / 'layer_skip.yaml'}, {out / 'layer_skip_trials.png'}")
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    raise SystemExit(main())
