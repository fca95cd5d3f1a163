"""Engine benchmark: speculative vs target-only vs HF generate / assisted generation, one run.

    python -m specserve.bench.engine [--out bench-results/engine.json]

For each speculation length γ (fixed, then adaptive) at batch 1: α, mean accepted length, the
measured draft/target cost ratio c, the measured verify cost v (γ+1 tokens over 1), the Leviathan
bound and the same bound with v, and the measured speedup over γ=0; then HF `generate()` and HF
`generate(assistant_model=draft)` on the same prompts; then throughput at several batch sizes,
speculative vs not. Every speculative output is checked against the target-only output.
"""
from __future__ import annotations

import argparse
import copy
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from specserve import prompts as prompt_sets
from specserve.bench.rows import SpeedAndAcceptance
from specserve.engine import RowInput, SamplingParams, SpeculativeEngine
from specserve.engine.model_runner import ModelRunner
from specserve.engine.policy import expected_tokens



@dataclass
class Pair:
    name: str
    target: torch.nn.Module
    draft: torch.nn.Module
    prompts: list[list[int]]  # token ids, categories interleaved
    categories: list[str]


@dataclass
class Row(SpeedAndAcceptance):
    label: str
    gamma: int | None  # None = adaptive
    batch: int
    identical: bool = True
    extra: dict = field(default_factory=dict)

    @property
    def mean_accepted_length(self) -> float:
        return self.tokens / self.steps if self.steps else 1.0


# -- loading ------------------------------------------------------------------------------------
def load_prompts(tokenizer, limit: int | None) -> tuple[list[list[int]], list[str]]:
    """The shipped prompt set, categories interleaved (chat, code, summarise, chat, ...)."""
    chosen = prompt_sets.interleaved(prompt_sets.load_records(prompt_sets.GENERAL), limit)
    return [prompt_sets.encode(tokenizer, r) for r in chosen], [r["category"] for r in chosen]


def load_pair(kind: str, limit: int | None) -> Pair:
    if kind == "smollm2":
        from specserve.models.smollm2 import load_smollm2_draft, load_smollm2_target

        target, tokenizer = load_smollm2_target()
        draft = load_smollm2_draft(target)
    elif kind == "tiny":
        from specserve.models.tiny import byte_tokenizer, tiny_llama

        target, draft = tiny_llama(0, layers=4), tiny_llama(0, layers=4, noise=0.5)
        tokenizer = byte_tokenizer()
    else:
        raise SystemExit(f"unknown model kind {kind!r}")
    prompts, categories = load_prompts(tokenizer, limit)
    return Pair(kind, target, draft, prompts, categories)


# -- measurements -------------------------------------------------------------------------------
def best_forward_seconds(runner: ModelRunner, context: list[int], widths: list[int], reps: int) -> dict[int, float]:
    """Fastest of `reps` forwards over each width of new tokens after `context` (batch 1).

    The widths are interleaved within each repetition and the minimum is kept, so a burst of load
    from elsewhere on a shared machine skews no width against another."""
    runner.forward([RowInput("ctx", 0, context)], logits="none")
    best = {w: float("inf") for w in widths}
    for _ in range(reps):
        for w in widths:
            runner.forward([RowInput("ctx", len(context), [1] * w)], logits="all")
            best[w] = min(best[w], runner.last_forward_seconds)
    runner.free("ctx")
    return best


def measure_costs(pair: Pair, gammas: list[int], reps: int) -> dict:
    context = pair.prompts[0]
    widths = sorted({1, *(g + 1 for g in gammas)})
    target = best_forward_seconds(ModelRunner(pair.target), context, widths, reps)
    draft_one = best_forward_seconds(ModelRunner(pair.draft), context, [1], reps)[1]
    one = target[1]
    verify = {g: target[g + 1] / one for g in gammas if g > 0}
    return {"target_forward_s": one, "draft_forward_s": draft_one, "c": draft_one / one, "v": verify}


def run_engine(pair: Pair, gamma: int | None, max_gamma: int, prompts: list[list[int]], max_new: int,
               reference: list[list[int]] | None, batch: int = 1) -> Row:
    engine = SpeculativeEngine(
        pair.target, pair.draft if (gamma or 0) > 0 or gamma is None else None,
        num_speculative_tokens=max_gamma if gamma is None else gamma, adaptive=gamma is None,
    )
    if gamma is None:  # steady state, as in a running server: measured costs and a learnt α
        engine.calibrate()
        engine.generate(prompts[:1], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
    began = time.perf_counter()
    outs = []
    for i in range(0, len(prompts), batch):
        outs += engine.generate(prompts[i : i + batch], params)
    seconds = time.perf_counter() - began
    row = Row("auto" if gamma is None else f"γ={gamma}", gamma, batch, tokens=sum(len(o.token_ids) for o in outs),
              seconds=seconds)
    for o in outs:
        row.add_metrics(o.metrics)
    if reference is not None:
        row.identical = [o.token_ids for o in outs] == reference
    row.extra["outputs"] = [o.token_ids for o in outs]
    return row


def run_hf(pair: Pair, prompts: list[list[int]], max_new: int, reference, assistant: torch.nn.Module | None) -> Row:
    # No EOS for HF either (ours runs with ignore_eos): min_new_tokens would instead mask EOS out
    # of the logits and so change the greedy choice wherever EOS was the argmax.
    config = copy.deepcopy(pair.target.generation_config)
    config.update(eos_token_id=None, max_new_tokens=max_new, do_sample=False, pad_token_id=0)
    began = time.perf_counter()
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        kwargs = dict(assistant_model=assistant) if assistant is not None else {}
        out = pair.target.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, **kwargs)
        outs.append(out[0, len(prompt):].tolist())
    seconds = time.perf_counter() - began
    label = "HF assisted" if assistant is not None else "HF generate"
    # HF still stops at the model's EOS, so compare up to where it stopped.
    same = all(ref[: len(out)] == out for ref, out in zip(reference, outs))
    return Row(label, None, 1, tokens=sum(map(len, outs)), seconds=seconds, identical=same)


def full_vocab_view(draft: torch.nn.Module, vocab: int) -> torch.nn.Module:
    """The draft as a plain HF model whose logits span the target vocabulary (for HF's assistant API)."""
    token_map = getattr(draft, "draft_token_map", None)
    if token_map is None:
        return draft

    class FullVocab(type(draft)):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            full = out.logits.new_full((*out.logits.shape[:-1], vocab), float("-inf"))
            out.logits = full.index_copy_(-1, token_map.to(full.device), out.logits)
            return out

    view = copy.copy(draft)
    view.__class__ = FullVocab
    return view


# -- the report ---------------------------------------------------------------------------------
def bounds(alpha: float, gamma: int, c: float, v: float) -> tuple[float, float]:
    gain = expected_tokens(alpha, gamma)
    return gain / (gamma * c + 1), gain / (gamma * c + v)


def report(rows: list[Row], costs: dict, throughput: list[tuple[int, Row, Row]]) -> str:
    base = next(r for r in rows if r.gamma == 0)
    head = f"{'run':<12}{'tok/s':>8}{'α':>7}{'acc.len':>9}{'c':>7}{'v':>7}{'bound':>8}{'bound_v':>9}{'speedup':>9}{'eff.':>7}{'same':>6}"
    lines = [head, "-" * len(head)]
    for r in rows:
        g = r.gamma
        c, v = costs["c"], costs["v"].get(g, 1.0) if g else 1.0
        if g:
            b, bv = bounds(r.alpha, g, c, v)
            cols = f"{r.alpha:>7.3f}{r.mean_accepted_length:>9.2f}{c:>7.3f}{v:>7.2f}{b:>8.2f}{bv:>9.2f}"
        else:
            bv = None
            cols = f"{r.alpha:>7.3f}{r.mean_accepted_length:>9.2f}" + " " * 31
        speedup = r.tokens_per_second / base.tokens_per_second
        eff = f"{speedup / bv:>7.2f}" if bv else " " * 7
        lines.append(f"{r.label:<12}{r.tokens_per_second:>8.1f}{cols}{speedup:>9.2f}{eff}{'yes' if r.identical else 'NO':>6}")
    lines += ["", f"{'batch':<8}{'spec tok/s':>12}{'γ=0 tok/s':>12}{'ratio':>8}"]
    for batch, spec, plain in throughput:
        lines.append(f"{batch:<8}{spec.tokens_per_second:>12.1f}{plain.tokens_per_second:>12.1f}"
                     f"{spec.tokens_per_second / plain.tokens_per_second:>8.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"])
    parser.add_argument("--gammas", default="0,2,4,6")
    parser.add_argument("--prompts", type=int, default=6, help="prompts per batch-1 run (categories interleaved)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--reps", type=int, default=7, help="repetitions per cost measurement (the fastest is kept)")
    parser.add_argument("--no-hf", action="store_true", help="skip the HF generate / assisted rows")
    parser.add_argument("--out", default="bench-results/engine.json")
    args = parser.parse_args(argv)
    gammas = sorted({0, *map(int, args.gammas.split(","))})
    batches = [int(b) for b in args.batches.split(",")]
    pair = load_pair(args.model, None)
    prompts = pair.prompts[: args.prompts]
    steps = ["costs", *[f"γ={g}" for g in gammas], "auto"] + ([] if args.no_hf else ["HF", "HF assisted"])
    steps += [f"batch {b}" for b in batches]
    bar = tqdm(total=len(steps), desc="engine bench", unit="run")

    def advance(label):
        bar.set_postfix_str(label)
        bar.update(1)

    run_engine(pair, 0, 0, prompts[:1], 4, None)  # warm-up
    costs = measure_costs(pair, gammas, args.reps)
    advance("costs")
    rows = [run_engine(pair, 0, 0, prompts, args.max_new_tokens, None)]
    reference = rows[0].extra["outputs"]
    rows[0] = _faster(rows[0], run_engine(pair, 0, 0, prompts, args.max_new_tokens, None))  # the baseline twice
    advance("γ=0")
    for g in gammas[1:]:
        rows.append(run_engine(pair, g, g, prompts, args.max_new_tokens, reference))
        advance(f"γ={g}")
    rows.append(run_engine(pair, None, max(gammas), prompts, args.max_new_tokens, reference))
    advance("auto")
    hf_rows = []
    if not args.no_hf:
        hf_rows.append(run_hf(pair, prompts, args.max_new_tokens, reference, None))
        advance("HF")
        vocab = pair.target.get_output_embeddings().weight.shape[0]
        hf_rows.append(run_hf(pair, prompts, args.max_new_tokens, reference, full_vocab_view(pair.draft, vocab)))
        advance("HF assisted")
    throughput = []
    for b in batches:
        batch_prompts = (pair.prompts * (b // len(pair.prompts) + 1))[:b]
        spec = plain = None
        for _ in range(2):  # alternate, keep each one's faster run: load elsewhere hits both alike
            spec = _faster(spec, run_engine(pair, None, max(gammas), batch_prompts, args.max_new_tokens, None, batch=b))
            plain = _faster(plain, run_engine(pair, 0, 0, batch_prompts, args.max_new_tokens, None, batch=b))
        spec.identical = spec.extra["outputs"] == plain.extra["outputs"]
        throughput.append((b, spec, plain))
        advance(f"batch {b}")
    bar.close()
    table = report(rows + hf_rows, costs, throughput)
    print(table)
    auto = rows[-1]
    for hf in hf_rows:
        print(f"auto speculative vs {hf.label}: {auto.tokens_per_second / hf.tokens_per_second:.2f}x")
    _write_json(args, pair, costs, rows + hf_rows, throughput, table)
    return 0


def _faster(a: Row | None, b: Row) -> Row:
    return b if a is None or b.seconds < a.seconds else a


def _write_json(args, pair, costs, rows, throughput, table) -> None:
    def plain(r: Row) -> dict:
        d = r.as_dict("extra")
        d.update(tokens_per_second=r.tokens_per_second, alpha=r.alpha, mean_accepted_length=r.mean_accepted_length)
        return d

    out = {
        "model": pair.name, "device": str(next(pair.target.parameters()).device),
        "threads": torch.get_num_threads(), "args": vars(args), "costs": costs,
        "rows": [plain(r) for r in rows],
        "throughput": [{"batch": b, "speculative": plain(s), "target_only": plain(p)} for b, s, p in throughput],
        "table": table,
    }
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2, default=str))
    print(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
