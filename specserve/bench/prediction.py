"""Predicted outputs benchmark: code edits with and without the original code as the prediction.

    python -m specserve.bench.prediction [--model smollm2|tiny] [--gamma 8] [--out bench-results/prediction.json]

Each prompt asks the model to return a short Python function with one small edit (rename a
variable, change a constant). Two predictions: the function as it stood (what OpenAI's guide sends
for such edits; a small model rewrites more than it edits, so its answer follows it only in
stretches), and the target-only answer itself with one token in every `--edit-every` changed (a
client that knows most of the answer: the mechanism's reach). For each drafter (the shipped feature
head, prompt lookup, and the predictions alone with no draft model: `drafter: {kind: prediction}`)
greedy batch-1 generation without and with each, against target-only decoding on the same
prompts, in one run, prompt by prompt across every row: tok/s, tokens per step, the prediction's
drafted and accepted tokens and the speedup over target-only. Every output is checked against the
target-only output (a prediction never changes a token). Prints a table, writes JSON.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

from specserve.bench.rows import SpeedAndAcceptance
from specserve.engine import SamplingParams, SpeculativeEngine
from specserve.engine.feature_drafter import FeatureDrafterSpec
from specserve.engine.proposers import PredictionSpec, PromptLookupSpec

SNIPPETS = [
    ("rename `x` to `value`", '''def clamp(x, low, high):
    """Return x limited to the range [low, high]."""
    if x < low:
        return low
    if x > high:
        return high
    return x
'''),
    ("change the default port from 8080 to 9090", '''def server_url(host, port=8080, secure=False):
    scheme = "https" if secure else "http"
    return f"{scheme}://{host}:{port}/"
'''),
    ("rename `items` to `records`", '''def total_price(items, tax_rate):
    subtotal = 0.0
    for item in items:
        subtotal += item["price"] * item["quantity"]
    return subtotal * (1 + tax_rate)
'''),
    ("make it skip empty lines", '''def read_names(path):
    names = []
    with open(path) as handle:
        for line in handle:
            names.append(line.strip())
    return names
'''),
    ("rename `n` to `count`", '''def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
'''),
    ("add a docstring", '''def mean(values):
    if not values:
        raise ValueError("mean of an empty list")
    return sum(values) / len(values)
'''),
]


@dataclass
class Row(SpeedAndAcceptance):
    method: str
    predicted: int = 0  # predicted drafts verified, and of those accepted
    predicted_accepted: int = 0
    recalled: int = 0  # drafts recalled from earlier requests verified, and of those accepted (bench history)
    recalled_accepted: int = 0
    identical: bool = True


def blank(method: str) -> Row:
    return Row(method=method, tokens=0, seconds=0.0)


def prompt_text(edit: str, code: str) -> str:
    return f"Here is a Python function:\n\n```python\n{code}```\n\nPlease {edit}. Reply with the whole function only."


def run_one(engine: SpeculativeEngine, prompt: list[int], params: SamplingParams, row: Row,
            reference: list[int] | None) -> list[int]:
    """One prompt through `engine`, its time and counts added to `row` -> its tokens."""
    began = time.perf_counter()
    out = engine.generate([prompt], params)[0]
    row.seconds += time.perf_counter() - began
    row.tokens += len(out.token_ids)
    row.add_metrics(out.metrics)
    row.predicted += out.metrics.num_prediction_drafts
    row.predicted_accepted += out.metrics.num_prediction_accepted
    row.recalled += out.metrics.num_recalled_drafts
    row.recalled_accepted += out.metrics.num_recalled_accepted
    row.identical &= reference is None or out.token_ids == reference
    return out.token_ids


def interleaved(cases: list[tuple[Row, SpeculativeEngine, list[SamplingParams]]], prompts: list[list[int]],
                reference: list[list[int]]) -> None:
    """Every case on every prompt, prompt by prompt (the cases' order turning each prompt), so
    that the machine's drift falls on every row alike."""
    for i, prompt in enumerate(prompts):
        for k in range(len(cases)):
            row, engine, params = cases[(i + k) % len(cases)]
            run_one(engine, prompt, params[i], row, reference[i])


def edited(tokens: list[int], every: int, vocab: int) -> tuple[int, ...]:
    """The answer with one token in every `every` replaced: a client that knows most of it."""
    out = list(tokens)
    for i in range(every // 2, len(out), every):
        out[i] = (out[i] + 1) % vocab
    return tuple(out)


def load(model: str):
    """(target, tokenizer, feature head spec or None)."""
    if model == "tiny":
        from specserve.models.tiny import byte_tokenizer, tiny_llama

        return tiny_llama(0, layers=4), byte_tokenizer(), None
    from specserve.models.smollm2 import load_smollm2_target

    target, tokenizer = load_smollm2_target()
    return target, tokenizer, FeatureDrafterSpec("smollm2-eagle")


def encode(tokenizer, text: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"])
    parser.add_argument("--gamma", type=int, default=8, help="the most drafts a step verifies (a predicted run's cap)")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--edit-every", type=int, default=40,
                        help="the near-answer prediction: target-only's answer with one token in this many changed")
    parser.add_argument("--out", default="bench-results/prediction.json")
    args = parser.parse_args(argv)
    target, tokenizer, head = load(args.model)
    prompts = [encode(tokenizer, prompt_text(edit, code)) for edit, code in SNIPPETS]
    predictions = [tuple(tokenizer(code, add_special_tokens=False)["input_ids"]) for _, code in SNIPPETS]
    plain = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    with_prediction = [dataclasses.replace(plain, prediction=p) for p in predictions]
    drafters = {"prompt lookup": PromptLookupSpec(2, 4), "predictions alone": PredictionSpec()}
    if head is not None:
        drafters = {"feature head": head, **drafters}
    alone = SpeculativeEngine(target, None, num_speculative_tokens=0)
    reference = [run_one(alone, p, plain, blank("reference"), None) for p in prompts]  # (a warm-up too)
    near = [dataclasses.replace(plain, prediction=edited(out, args.edit_every, vocab=len(tokenizer)))
            for out in reference]
    cases = [(blank("target only"), alone, [plain] * len(prompts))]
    for name, spec in drafters.items():
        engine = SpeculativeEngine(target, drafter=spec, num_speculative_tokens=args.gamma, adaptive=True)
        run_one(engine, prompts[0], plain, blank("warm-up"), None)
        cases += [(blank(name), engine, [plain] * len(prompts)),
                  (blank(f"{name} + original"), engine, with_prediction),
                  (blank(f"{name} + near answer"), engine, near)]
    interleaved(cases, prompts, reference)
    rows = [row for row, _, _ in cases]
    base = rows[0]
    print(f"\n{len(prompts)} code edits, greedy batch 1, γ <= {args.gamma}, {args.model}")
    print(f"{'method':<30} {'tok/s':>7} {'tok/step':>8} {'α':>5} {'predicted':>9} {'accepted':>8} {'speedup':>7} same")
    for r in rows:
        per_step = r.tokens / r.steps if r.steps else 0.0
        print(f"{r.method:<30} {r.tokens_per_second:7.1f} {per_step:8.2f} {r.alpha:5.2f} {r.predicted:9d} "
              f"{r.predicted_accepted:8d} {r.tokens_per_second / base.tokens_per_second:7.2f} {r.identical}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "gamma": args.gamma, "max_tokens": args.max_tokens,
                               "rows": [{**r.as_dict(), "tokens_per_second": r.tokens_per_second,
                                         "speedup": r.tokens_per_second / base.tokens_per_second} for r in rows]},
                              indent=2))
    print(f"wrote {out}")
    return 0 if all(r.identical for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
