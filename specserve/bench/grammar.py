"""Structured output's drafts, masked or not: what a grammar row drafting unmasked where its
grammar is wide (`engine/grammar.py`, WIDE_SHARE) costs in acceptance, and how many of its draft
calls it frees from the per-position mask (on a GPU, those run the captured loop).

    python -m specserve.bench.grammar [--prompts 12] [--max-tokens 96] [--gamma 4] [--tiny]
                                      [--out bench-results/grammar.json]

The embedded SmolLM2-135M-Instruct drafted by its feature head (`--drafter draft`: the trained
draft model; `--tiny`: the test models and byte tokenizer), held-out chat prompts that ask for a
JSON answer, batch 1, greedy, a fixed γ, under each grammar:

    json_schema   an object of a free-text `answer` (up to 160 characters) and a `confidence` enum
    json_object   any JSON object
    thinking      the same schema after a reasoning model's thinking, the prompt having opened it
                  (this model never closes it: its whole output stands for a long thinking)

each with the proposer's `wide_share` at None (every grammar row's drafts masked: the rule before),
WIDE_SHARE (the default) and 0 (never masked), the three run in turn on each prompt. Per row: α,
the share of draft calls that read no mask, tok/s, and whether every output equals the target
alone under the same grammar (γ=0). Prints a table, writes JSON.

    python -m specserve.bench.grammar --section batch --device cuda [--batch 16] [--tiny]

What one grammar row costs a batch on a GPU: random Llama-2-7B / TinyLlama-1.1B shapes (bf16,
CUDA graphs, a peaked target: `bench gpu`'s), `--batch` rows of which the first is under a
narrow regex (the byte tokenizer's masks are never wide, so `wide_share` forces the setting),
greedy, γ 4: no grammar row (every draft loop captured), the row's drafts masked (every loop
uncaptured, a mask and a host read per position), and unmasked (captured; the row's drafts
rejected where the grammar forbids them). Per row: ms per step, of which drafting, tok/s, and
whether the tokens equal the target alone's. Imports torch, transformers and the engine only.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from specserve.bench import write_json
from specserve.engine import SamplingParams, SpeculativeEngine
from specserve.engine.grammar import WIDE_SHARE, Grammar, Reasoning

ANSWER = {"type": "object", "additionalProperties": False, "required": ["answer", "confidence"],
          "properties": {"answer": {"type": "string", "maxLength": 160},
                         "confidence": {"enum": ["low", "medium", "high"]}}}
GRAMMARS = {
    "json_schema": Grammar.json_schema(ANSWER),
    "json_object": Grammar("json_object"),
    "thinking": Grammar.json_schema(ANSWER).after_reasoning(Reasoning("<think>", "</think>", True)),
}
SETTINGS = {"masked": None, "wide": WIDE_SHARE, "free": 0.0}  # name -> the proposer's wide_share


class MaskCount:
    """Counts a proposer's draft calls with a grammar row, and those that read no mask."""

    def __init__(self, proposer) -> None:
        self.calls = self.unmasked = 0
        inner = proposer._draft_masks

        def counted(sampling, order, padded):
            masks = inner(sampling, order, padded)
            if sampling.grammar is not None:
                self.calls += 1
                self.unmasked += masks is None
            return masks

        proposer._draft_masks = counted


def load(tiny: bool, drafter: str):
    """(target, tokenizer, a callable making a fresh proposer)."""
    from specserve.engine.proposers import DraftModelProposer, DraftModelSpec, target_vocab_size

    if tiny:
        from specserve.models.tiny import byte_tokenizer, tiny_llama

        target, draft = tiny_llama(0, layers=6), tiny_llama(0, layers=6, noise=0.5)
        return target, byte_tokenizer(), lambda: DraftModelProposer(draft, target_vocab_size(target))
    from specserve.engine.feature_drafter import FeatureDrafterSpec
    from specserve.models.smollm2 import load_smollm2_draft, load_smollm2_target

    target, tokenizer = load_smollm2_target()
    spec = DraftModelSpec(load_smollm2_draft(target)) if drafter == "draft" else FeatureDrafterSpec("smollm2-eagle")
    return target, tokenizer, lambda: spec.build(target, target_vocab_size(target), None)


def prompts(tokenizer, count: int, tiny: bool) -> list[list[int]]:
    from specserve.prompts import GENERAL, encode, interleaved, load_records

    records = [r for r in interleaved(load_records(GENERAL)) if r["chat"]][:count]
    if tiny:
        return [list(r["prompt"][:40].encode("latin-1", "replace")) for r in records]
    return [encode(tokenizer, {**r, "prompt": r["prompt"] + " Reply in JSON with an answer and your confidence."})
            for r in records]


def run(args: argparse.Namespace) -> list[dict]:
    target, tokenizer, make = load(args.tiny, args.drafter)
    batch = prompts(tokenizer, args.prompts, args.tiny)
    alone = SpeculativeEngine(target, num_speculative_tokens=0, tokenizer=tokenizer)
    rows = []
    for name, grammar in GRAMMARS.items():
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, grammar=grammar)
        engines, counts = {}, {}
        for setting, wide in SETTINGS.items():
            proposer = make()
            proposer.wide_share = wide
            counts[setting] = MaskCount(proposer)
            engines[setting] = SpeculativeEngine(target, proposer=proposer, num_speculative_tokens=args.gamma,
                                                 adaptive=False, tokenizer=tokenizer)
        totals = {s: {"tokens": 0, "accepted": 0, "drafted": 0, "seconds": 0.0, "same": True} for s in SETTINGS}
        for k, prompt in enumerate(batch):
            (reference,) = alone.generate([prompt], params)
            order = list(SETTINGS)[k % 3:] + list(SETTINGS)[: k % 3]  # (each setting first in turn)
            for setting in order:
                began = time.perf_counter()
                (out,) = engines[setting].generate([prompt], params)
                t = totals[setting]
                t["seconds"] += time.perf_counter() - began
                t["tokens"] += len(out.token_ids)
                t["accepted"] += out.metrics.num_accepted_tokens
                t["drafted"] += out.metrics.num_draft_tokens
                t["same"] &= out.token_ids == reference.token_ids
        for setting, t in totals.items():
            count = counts[setting]
            rows.append({"grammar": name, "drafts": setting, "wide_share": SETTINGS[setting],
                         "alpha": t["accepted"] / t["drafted"] if t["drafted"] else None,
                         "unmasked_calls": count.unmasked / count.calls if count.calls else None,
                         "tok_s": t["tokens"] / t["seconds"], "tokens": t["tokens"], "same": t["same"]})
            print_row(rows[-1])
    return rows


def batch_costs(args: argparse.Namespace) -> list[dict]:
    from specserve.bench import sync
    from specserve.bench.gpu import random_llama
    from specserve.engine.proposers import DraftModelProposer, target_vocab_size
    from specserve.models.tiny import byte_tokenizer

    device, dtype = args.device, torch.bfloat16 if args.device == "cuda" else torch.float32
    shapes = ("tiny-target", "tiny-draft") if args.tiny else ("llama2-7b", "tinyllama-1.1b")
    target = random_llama(shapes[0], device, dtype, 0, peaked=True)
    draft = random_llama(shapes[1], device, dtype, 1, peaked=False)
    tokenizer, vocab = byte_tokenizer(), target_vocab_size(target)
    batch = [[(7 * b + 3 * i) % 250 + 1 for i in range(args.prompt_len)] for b in range(args.batch)]  # byte ids
    free = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    narrow = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True,
                            grammar=Grammar("regex", "[a-z ]+"))
    mixes = {False: [free] * len(batch), True: [narrow] + [free] * (len(batch) - 1)}
    alone = SpeculativeEngine(target, num_speculative_tokens=0, max_batch_size=len(batch), tokenizer=tokenizer)
    references = {g: [o.token_ids for o in alone.generate(batch, mix)] for g, mix in mixes.items()}
    rows = []
    for name, (grammar_row, wide) in {"no grammar row": (False, None), "one row masked": (True, None),
                                      "one row unmasked": (True, 0.0)}.items():
        proposer = DraftModelProposer(draft, vocab)
        proposer.wide_share = wide
        drafting = []
        inner = proposer.propose

        def timed(*a, inner=inner, drafting=drafting, **k):
            began = time.perf_counter()
            out = inner(*a, **k)
            sync(device)
            drafting.append(time.perf_counter() - began)
            return out

        proposer.propose = timed
        engine = SpeculativeEngine(target, proposer=proposer, num_speculative_tokens=args.gamma, adaptive=False,
                                   max_batch_size=len(batch), tokenizer=tokenizer)
        engine.generate(batch, mixes[grammar_row])  # (warm-up: graphs captured, masks compiled)
        drafting.clear()
        sync(device)
        began = time.perf_counter()
        outs = engine.generate(batch, mixes[grammar_row])
        sync(device)
        seconds = time.perf_counter() - began
        steps = max(o.metrics.num_steps for o in outs)
        rows.append({"setting": name, "batch": len(batch), "gamma": args.gamma, "step_ms": 1e3 * seconds / steps,
                     "draft_ms": 1e3 * sum(drafting) / steps, "tok_s": sum(len(o.token_ids) for o in outs) / seconds,
                     "grammar_row_alpha": outs[0].metrics.num_accepted_tokens / max(outs[0].metrics.num_draft_tokens, 1),
                     "same": [o.token_ids for o in outs] == references[grammar_row]})
        r = rows[-1]
        if len(rows) == 1:
            print("| batch | setting | ms / step | of which drafting | tok/s | grammar row's α | same |\n"
                  "|---|---|---|---|---|---|---|")
        print(f"| {r['batch']} | {name} | {r['step_ms']:.2f} | {r['draft_ms']:.2f} | {r['tok_s']:.1f} | "
              f"{r['grammar_row_alpha']:.2f} | {'yes' if r['same'] else 'NO'} |", flush=True)
    return rows


def print_row(row: dict) -> None:
    if row["grammar"] == "json_schema" and row["drafts"] == "masked":
        print("| grammar | drafts | α | draft calls without a mask | tok/s | tokens | same |\n"
              "|---|---|---|---|---|---|---|")
    alpha = "-" if row["alpha"] is None else f"{row['alpha']:.3f}"
    unmasked = "-" if row["unmasked_calls"] is None else f"{row['unmasked_calls']:.2f}"
    print(f"| {row['grammar']} | {row['drafts']} | {alpha} | {unmasked} | {row['tok_s']:.1f} | {row['tokens']} | "
          f"{'yes' if row['same'] else 'NO'} |", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--section", choices=["prompts", "batch"], default="prompts")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="(batch section)")
    p.add_argument("--batch", type=int, default=16, help="(batch section)")
    p.add_argument("--prompt-len", type=int, default=128, help="(batch section)")
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--drafter", choices=["head", "draft"], default="head")
    p.add_argument("--tiny", action="store_true", help="the test models (seconds; for a rehearsal)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=Path("bench-results/grammar.json"))
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = run(args) if args.section == "prompts" else batch_costs(args)
    write_json(args.out, args, rows=rows)
    return 0 if all(r["same"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
