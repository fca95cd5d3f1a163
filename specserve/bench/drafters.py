"""Drafter benchmark: draft model vs layer skip vs prompt lookup vs feature head (alone, and with
prompt lookup for rows that repeat an earlier n-gram), per prompt category.

    python -m specserve.bench.drafters [--per-category 3] [--out bench-results/drafters.json]

On the offline SmolLM2-135M-Instruct (or `--model tiny`), for each category (chat, code,
summarise from `prompts.jsonl`; extraction from `prompts_extraction.jsonl`, whose answers copy
the prompt) and each drafter, greedy batch-1 generation with adaptive γ, against target-only
decoding on the same prompts: α, tokens per step (mean accepted length + 1), c, tok/s and the
speedup; plus HF `generate()` and HF `generate(prompt_lookup_num_tokens=...)`. Every output is
checked against the target-only output. Prints a table, writes JSON.

The layer-skip set comes from the tuner's output (`python -m specserve.tuning.layer_skip`,
`--layer-skip-config`); without one, the untuned baseline (every other layer) is used.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from specserve.bench.rows import SpeedAndAcceptance
from specserve.engine.step import per_token_alpha
from specserve.prompts import EXTRACTION, GENERAL, by_category, encode, load_records
from specserve.engine import RowInput, SamplingParams, SpeculativeEngine
from specserve.engine.model_runner import ModelRunner
from specserve.engine.feature_drafter import FeatureDrafterSpec
from specserve.engine.proposers import (
    DraftModelSpec, LayerSkipSpec, PromptLookupProposer, PromptLookupSpec, target_vocab_size,
)

CATEGORIES = ["chat", "code", "summarise", "extraction"]


@dataclass
class Result(SpeedAndAcceptance):
    category: str
    method: str
    c: float | None = None
    identical: bool = True
    extra: dict = field(default_factory=dict)

    @property
    def alpha(self) -> float | None:  # None (shown as "-") for a run that drafted nothing
        return per_token_alpha(self.accepted, self.rejections)

    @property
    def tokens_per_step(self) -> float | None:
        return self.tokens / self.steps if self.steps else None


class TimedProposer:
    """Wraps a proposer and adds up the wall time of its calls and the draft positions it made."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.seconds = 0.0
        self.positions = 0  # Σ num_tokens over calls (batch 1: one per draft token)

    def propose(self, rows, num_tokens, sampling, uniforms):
        began = time.perf_counter()
        proposal = self.inner.propose(rows, num_tokens, sampling, uniforms)
        self.seconds += time.perf_counter() - began
        self.positions += num_tokens
        return proposal

    def prefill(self, rows):
        began = time.perf_counter()
        forwards = self.inner.prefill(rows)
        self.seconds += time.perf_counter() - began
        return forwards

    def free(self, request_id: str) -> None:
        self.inner.free(request_id)

    def valid_length(self, request_id: str) -> int:
        return self.inner.valid_length(request_id)


# -- loading ------------------------------------------------------------------------------------
def load(kind: str, draft_weights: str | None):
    """(target, tokenizer, draft or None, note)."""
    if kind == "tiny":
        from specserve.models.tiny import byte_tokenizer, tiny_llama

        return tiny_llama(0, layers=6), byte_tokenizer(), tiny_llama(0, layers=6, noise=0.5), ""
    from specserve.models.smollm2 import load_smollm2_draft, load_smollm2_target

    target, tokenizer = load_smollm2_target()
    try:
        draft = load_smollm2_draft(target, weights_dir=draft_weights)
        note = ""
    except (FileNotFoundError, OSError, RuntimeError, KeyError) as err:
        draft, note = None, f"no draft model ({type(err).__name__}: {err}); its rows are skipped"
    return target, tokenizer, draft, note


def layer_skip_spec(path: str | None, num_layers: int) -> tuple[LayerSkipSpec, int | None, str]:
    """(spec, tuned γ or None, where it came from)."""
    if path and Path(path).is_file():
        tuned = json.loads(Path(path).read_text())
        drafter = tuned["drafter"]
        return LayerSkipSpec(tuple(drafter["skip_layers"])), tuned["speculation"].get("num_speculative_tokens"), path
    return LayerSkipSpec.every_other(num_layers), None, "untuned baseline (every other layer): no tuned config found"


# -- measurements -------------------------------------------------------------------------------
def forward_ratio(target: ModelRunner, other: ModelRunner, context: list[int], reps: int) -> float:
    """Median over reps of (other's batch-1 one-token forward / target's), timed back to back."""
    for runner in (target, other):
        runner.forward([RowInput("__c__", 0, context)], logits="none")
    ratios = []
    for _ in range(reps):
        other.forward([RowInput("__c__", len(context), [context[-1]])], logits="last")
        d = other.last_forward_seconds
        target.forward([RowInput("__c__", len(context), [context[-1]])], logits="last")
        ratios.append(d / target.last_forward_seconds)
    for runner in (target, other):
        runner.free("__c__")
    return statistics.median(ratios)


def run_engine(target, proposer, gamma: int, prompts: list[list[int]], params: SamplingParams, category: str,
               method: str) -> Result:
    engine = SpeculativeEngine(target, proposer=proposer, num_speculative_tokens=gamma, adaptive=gamma > 0)
    if gamma > 0:
        engine.calibrate()
    began = time.perf_counter()
    outs = [engine.generate([p], params)[0] for p in prompts]  # batch 1: latency
    seconds = time.perf_counter() - began
    result = Result(category, method, tokens=sum(len(o.token_ids) for o in outs), seconds=seconds)
    for o in outs:
        result.add_metrics(o.metrics)
    result.extra["outputs"] = [o.token_ids for o in outs]
    return result


def run_hf(target, prompts: list[list[int]], max_new: int, category: str, lookup_tokens: int | None) -> Result:
    kwargs = {"prompt_lookup_num_tokens": lookup_tokens} if lookup_tokens else {}
    began = time.perf_counter()
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                              pad_token_id=target.generation_config.pad_token_id or 0, **kwargs)
        outs.append(out[0, len(prompt):].tolist())
    seconds = time.perf_counter() - began
    method = f"HF lookup({lookup_tokens})" if lookup_tokens else "HF generate"
    result = Result(category, method, tokens=sum(map(len, outs)), seconds=seconds)
    result.extra["outputs"] = outs
    return result


def lookup_cost_ratio(proposer: TimedProposer, target_forward_seconds: float) -> float | None:
    if not proposer.positions:
        return None
    return proposer.seconds / proposer.positions / target_forward_seconds


# -- report -------------------------------------------------------------------------------------
def table(results: list[Result]) -> str:
    head = f"{'category':<11}{'method':<16}{'tok/s':>7}{'α':>7}{'tok/step':>9}{'c':>8}{'speedup':>9}{'same':>6}"
    lines = [head, "-" * len(head)]
    for category in dict.fromkeys(r.category for r in results):
        rows = [r for r in results if r.category == category]
        base = next(r for r in rows if r.method == "target-only")
        for r in rows:
            alpha = f"{r.alpha:>7.3f}" if r.alpha is not None else f"{'-':>7}"
            per_step = f"{r.tokens_per_step:>9.2f}" if r.tokens_per_step is not None else f"{'-':>9}"
            c = f"{r.c:>8.4f}" if r.c is not None else f"{'-':>8}"
            speedup = r.tokens_per_second / base.tokens_per_second
            lines.append(f"{category:<11}{r.method:<16}{r.tokens_per_second:>7.1f}{alpha}{per_step}{c}"
                         f"{speedup:>9.2f}{'yes' if r.identical else 'NO':>6}")
        lines.append("")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"])
    parser.add_argument("--per-category", type=int, default=3, help="prompts per category")
    parser.add_argument("--categories", default=",".join(CATEGORIES))
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=4, help="most drafts per step for the model drafters")
    parser.add_argument("--lookup-gamma", type=int, default=10,
                        help="most drafts per step for prompt lookup (HF's prompt_lookup_num_tokens is 10)")
    parser.add_argument("--lookup-min-n", type=int, default=1)
    parser.add_argument("--lookup-max-n", type=int, default=3)
    parser.add_argument("--hf-lookup-tokens", type=int, default=10, help="HF's prompt_lookup_num_tokens")
    parser.add_argument("--layer-skip-config", default="bench-results/layer-skip/layer_skip.json")
    parser.add_argument("--draft-weights", default=None, help="draft weights dir (default: the shipped one)")
    parser.add_argument("--feature-head", default="smollm2-eagle",
                        help="feature head dir or shipped name (SmolLM2 only; '' to skip its rows)")
    parser.add_argument("--head-lookup-min-n", type=int, default=3,
                        help="the 'head + lookup' rows: n-gram length from which a row drafts by lookup (0: no such rows)")
    parser.add_argument("--reps", type=int, default=9, help="timed forward pairs per c measurement")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--out", default="bench-results/drafters.json")
    return parser.parse_args(argv)


@dataclass
class Drafters:
    """What the runs share: the models, each model drafter's c, the target's batch-1 forward."""

    target: torch.nn.Module
    draft: torch.nn.Module | None
    vocab: int
    skip_spec: LayerSkipSpec
    skip_gamma: int | None
    head_spec: FeatureDrafterSpec | None
    costs: dict[str, float]  # drafter -> c (its batch-1 forward over the target's)
    target_forward: float  # seconds


def measure_costs(target, draft, vocab: int, skip_spec: LayerSkipSpec, skip_gamma, context: list[int],
                  args) -> Drafters:
    """c for the model drafters (one batch-1 forward against the target's, side by side) and the
    target's own forward time; a feature head that cannot be loaded is left out."""
    target_runner = ModelRunner(target)
    costs = {"layer skip": forward_ratio(target_runner, skip_spec.build(target, vocab, None).runner, context, args.reps)}
    head_spec = FeatureDrafterSpec(args.feature_head) if args.feature_head and args.model == "smollm2" else None
    if head_spec is not None:
        try:
            costs["feature head"] = forward_ratio(target_runner, head_spec.build(target, vocab, None).runner,
                                                  context, args.reps)
        except FileNotFoundError as err:
            print(f"no feature head ({err}); its rows are skipped")
            head_spec = None
    if draft is not None:
        costs["draft model"] = forward_ratio(target_runner, DraftModelSpec(draft).build(target, vocab, None).runner,
                                             context, args.reps)
    target_runner.forward([RowInput("__t__", 0, context)], logits="none")
    times = []
    for _ in range(args.reps):
        target_runner.forward([RowInput("__t__", len(context), [context[-1]])], logits="last")
        times.append(target_runner.last_forward_seconds)
    return Drafters(target, draft, vocab, skip_spec, skip_gamma, head_spec, costs, statistics.median(times))


def method_names(d: Drafters, args) -> list[str]:
    methods = ["target-only"] + (["draft model"] if d.draft is not None else []) + ["layer skip", "prompt lookup"]
    methods += ["feature head"] if d.head_spec is not None else []
    methods += ["head + lookup"] if d.head_spec is not None and args.head_lookup_min_n > 0 else []
    return methods + ([] if args.no_hf else ["HF generate", f"HF lookup({args.hf_lookup_tokens})"])


def run_method(method: str, d: Drafters, batch: list[list[int]], params: SamplingParams, category: str,
               args) -> Result:
    """One drafter (or target-only, or HF) over one category's prompts."""
    target, vocab = d.target, d.vocab
    if method == "target-only":
        return run_engine(target, None, 0, batch, params, category, method)
    if method in ("draft model", "layer skip", "feature head"):
        spec = {"draft model": lambda: DraftModelSpec(d.draft), "layer skip": lambda: d.skip_spec,
                "feature head": lambda: d.head_spec}[method]()
        gamma = (d.skip_gamma or args.gamma) if method == "layer skip" else args.gamma
        r = run_engine(target, spec.build(target, vocab, None), gamma, batch, params, category, method)
        r.c = d.costs[method]
        return r
    if method == "head + lookup":
        proposer = dataclasses.replace(d.head_spec, lookup_min_n=args.head_lookup_min_n).build(target, vocab, None)
        r = run_engine(target, proposer, args.gamma, batch, params, category, method)
        r.c = d.costs["feature head"]  # per head forward; a looked-up row runs none
        r.extra["looked_up_rows"] = proposer.num_looked_up / max(proposer.num_rows, 1)
        return r
    if method == "prompt lookup":
        proposer = TimedProposer(PromptLookupSpec(args.lookup_min_n, args.lookup_max_n).build(target, vocab, None))
        r = run_engine(target, proposer, args.lookup_gamma, batch, params, category, method)
        r.c = lookup_cost_ratio(proposer, d.target_forward)
        inner: PromptLookupProposer = proposer.inner
        r.extra["lookup_match_rate"] = inner.num_matches / max(inner.num_lookups, 1)
        return r
    if method == "HF generate":
        return run_hf(target, batch, args.max_new_tokens, category, None)
    return run_hf(target, batch, args.max_new_tokens, category, args.hf_lookup_tokens)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        target, tokenizer, draft, note = load(args.model, args.draft_weights)
    except (FileNotFoundError, ImportError) as err:
        print(f"SmolLM2 is not available here ({err}); nothing to benchmark (try --model tiny)")
        return 0
    if note:
        print(note)
    vocab = target_vocab_size(target)
    skip_spec, skip_gamma, skip_source = layer_skip_spec(args.layer_skip_config, target.config.num_hidden_layers)
    print(f"layer skip: {list(skip_spec.skip_layers)} ({skip_source})")
    groups = by_category(load_records(GENERAL, EXTRACTION))
    categories = [c for c in args.categories.split(",") if c in groups]
    prompts = {c: [encode(tokenizer, r) for r in groups[c][: args.per_category]] for c in categories}
    params = SamplingParams(max_tokens=args.max_new_tokens, temperature=0.0)
    context = prompts[categories[0]][0]
    d = measure_costs(target, draft, vocab, skip_spec, skip_gamma, context, args)
    methods = method_names(d, args)
    run_engine(target, None, 0, [context[:8]], SamplingParams(max_tokens=4, temperature=0.0), "warm-up", "warm-up")
    bar = tqdm(total=len(categories) * len(methods), desc="drafter bench", unit="run")
    results: list[Result] = []
    for category in categories:
        reference = None
        for method in methods:
            bar.set_postfix_str(f"{category}: {method}")
            r = run_method(method, d, prompts[category], params, category, args)
            reference = r.extra["outputs"] if method == "target-only" else reference
            r.identical = r.extra["outputs"] == reference
            results.append(r)
            bar.update(1)
    bar.close()
    text = table(results)
    print(text)
    print(f"target forward (batch 1) {d.target_forward * 1e3:.1f} ms; threads={torch.get_num_threads()}; "
          "c of prompt lookup = its propose time per draft position over that")
    _write(args, results, d.costs, d.target_forward, skip_spec, skip_source, text, note)
    return 0


def _write(args, results, costs, target_forward, skip_spec, skip_source, text, note) -> None:
    def plain(r: Result) -> dict:
        d = r.as_dict("extra")
        d.update(tokens_per_second=r.tokens_per_second, alpha=r.alpha, tokens_per_step=r.tokens_per_step,
                 **{k: v for k, v in r.extra.items() if k != "outputs"})
        return d

    out = {
        "args": vars(args), "threads": torch.get_num_threads(), "target_forward_s": target_forward,
        "c": costs, "layer_skip": {"skip_layers": list(skip_spec.skip_layers), "source": skip_source},
        "note": note, "results": [plain(r) for r in results], "table": text,
    }
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
