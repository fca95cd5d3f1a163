"""`specserve distill`: train a feature head (EAGLE-style drafter) for a local causal LM.

    specserve distill --model smollm2 --out heads/smollm2
    specserve distill --model /models/my-llama --out heads/my-llama --prompts my_prompts.jsonl \\
        --text docs/*.md --time-budget 7200

1. data: the target answers the prompts (greedy; `--sampled T` adds a sampled pass), including
   `--self-instruct N` prompts it writes itself, and reads the `--text` files (and `--local-text` N
   local sources and docs) as they are; one forward per sequence keeps its features and greedy
   labels (`specserve.distill.data`). Shards go to `--data-dir` (default OUT/data) as they finish;
   a rerun skips the ones present, and a head with other feature layers reuses the answers.
   `--data-only` stops here.
2. train: a head shaped like one target layer, for `--time-budget` seconds
   (`specserve.distill.train`); a checkpoint every few minutes (OUT/checkpoint.pt), resumed by a
   rerun with the same OUT.
3. save: OUT/config.json + OUT/model.safetensors (the EAGLE-3 layout; the output head is the
   target's rows of the draft vocabulary, not stored unless --store-lm-head), which a serve config
   names as `drafter: {kind: eagle, path: OUT}`.
4. report: greedy acceptance α and speed of the head against the target alone on the held-out
   benchmark prompts (specserve/prompts/prompts.jsonl, never trained on), batch 1, in OUT/report.json.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="'smollm2' (the offline demo target) or a local HF checkpoint dir")
    p.add_argument("--out", required=True, type=Path, help="output directory (the head; a config's drafter path)")
    p.add_argument("--data-dir", type=Path, default=None, help="where data shards go (default OUT/data)")
    p.add_argument("--prompts", nargs="*", default=[], type=Path,
                   help="prompt files: JSON lines {prompt, chat} or text, one chat prompt per line")
    p.add_argument("--text", nargs="*", default=[], type=Path, help="plain text files read by the target as they are")
    p.add_argument("--local-text", type=int, default=0,
                   help="also read this many local files as text: Python sources of the standard library and "
                        "installed packages, and their docs (held-out prompts' code and text left out)")
    p.add_argument("--local-text-tokens", type=int, default=768, help="tokens read from each --local-text file")
    p.add_argument("--no-default-prompts", action="store_true",
                   help="skip the built-in set (train_prompts.txt chat + stdlib code + doc summaries)")
    p.add_argument("--self-instruct", type=int, default=0,
                   help="chat prompts the target writes itself (sampled from its chat template's user turn), "
                        "then answers; those overlapping a held-out prompt are dropped")
    p.add_argument("--self-instruct-temperature", type=float, default=0.9)
    p.add_argument("--num-code", type=int, default=96, help="built-in code prompts")
    p.add_argument("--num-summary", type=int, default=96, help="built-in summarise prompts")
    p.add_argument("--self-summaries", type=int, default=0,
                   help="summarise prompts over the target's own answers in the data dir (from --self-instruct)")
    p.add_argument("--max-new", type=int, default=96, help="answer tokens per prompt")
    p.add_argument("--sampled", type=float, default=0.0, help="also a sampled pass at this temperature (0: none)")
    p.add_argument("--gen-batch", type=int, default=16)
    p.add_argument("--label-tokens", type=int, default=8192,
                   help="padded tokens per labelling forward (bounds its [rows, width, vocab] logits)")
    p.add_argument("--data-only", action="store_true", help="make the data shards and stop (no training)")
    p.add_argument("--all-shards", action="store_true",
                   help="also train on every other features shard in the data dir that fits this head "
                        "(earlier runs' prompts, seeds or passes)")
    p.add_argument("--text-chunk", type=int, default=256, help="tokens per --text sequence")
    p.add_argument("--draft-vocab", type=int, default=8192, help="K, the head's vocabulary (<= the target's)")
    p.add_argument("--eagle3-features", action="store_true",
                   help="fuse three decoder layers' outputs (EAGLE-3) instead of the final norm's")
    p.add_argument("--init-from", default=None,
                   help="start from this head's weights (a directory or a shipped head's name; same shapes, "
                        "any draft vocabulary) instead of the target's last layer")
    p.add_argument("--time-budget", type=float, default=1800.0, help="seconds of training")
    p.add_argument("--max-epochs", type=int, default=20)
    p.add_argument("--answer-repeat", type=int, default=1,
                   help="the target's answered sequences count this many times per epoch (text chunks once)")
    p.add_argument("--ttt-steps", type=int, default=2, help="training-time-test passes")
    p.add_argument("--batch-tokens", type=int, default=2048)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--store-lm-head", action="store_true", help="store the output head (else the target's rows)")
    p.add_argument("--eval-per-category", type=int, default=4, help="held-out prompts per category (0: no report)")
    p.add_argument("--eval-tokens", type=int, default=64)
    p.add_argument("--eval-gamma", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device-map", default=None,
                   help="HF device_map for the target (e.g. 'auto': shard over the visible GPUs)")
    p.add_argument("--device", default=None,
                   help="where the target runs without --device-map (default: cuda if available, else cpu)")
    p.add_argument("--train-device", default=None, help="where the head trains (default: cuda if available, else cpu)")
    p.add_argument("--seed", type=int, default=0)


def load_model(name: str, dtype: str, device_map: str | None = None, device: str | None = None):
    """(model, tokenizer): on `device_map`'s devices when given, else on `device` (default: cuda if
    available)."""
    if name == "smollm2":
        from specserve.models.smollm2 import load_smollm2_target

        model, tokenizer = load_smollm2_target(dtype=getattr(torch, dtype))
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(name, dtype=getattr(torch, dtype), local_files_only=True,
                                                     attn_implementation="sdpa", device_map=device_map).eval()
        tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=True)
    if device_map is None:
        model.to(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return model, tokenizer


def collect_data(model, tokenizer, args, feature_layers) -> list[dict]:
    from .data import (generate_shards, label_text, load_shards, local_text_files, read_prompt_file,
                       self_instruct_prompts, self_summary_prompts, without)
    from .prompts import default_sets, held_out

    data_dir = args.data_dir or args.out / "data"
    sets = {} if args.no_default_prompts else default_sets(args.seed, args.num_code, args.num_summary)
    for path in args.prompts:
        sets[f"file-{path.stem}"] = without(read_prompt_file(path), held_out())
    if args.self_instruct > 0:
        sets["self"] = self_instruct_prompts(
            model, tokenizer, args.self_instruct, seed=args.seed, batch_size=args.gen_batch,
            temperature=args.self_instruct_temperature, held_out=held_out(),
            path=data_dir / f"self-instruct-{args.seed}-{args.self_instruct_temperature}.jsonl")
        print(f"self-instruct: {len(sets['self'])} prompts")
    if args.self_summaries > 0:
        sets["self-summary"] = self_summary_prompts(tokenizer, data_dir, args.self_summaries,
                                                    random.Random(args.seed), held_out())
        print(f"self-summaries: {len(sets['self-summary'])} prompts")
    shards = []
    passes = [("greedy", 0.0)] + ([("sampled", args.sampled)] if args.sampled > 0 else [])
    for tag, records in sets.items():
        for kind, temperature in passes:
            shards += generate_shards(model, tokenizer, records, data_dir, max_new=args.max_new,
                                      temperature=temperature, batch_size=args.gen_batch, seed=args.seed,
                                      feature_layers=feature_layers, tag=f"{tag}-{kind}" if kind != "greedy" else tag,
                                      label_tokens=args.label_tokens)
    if args.text:
        shards += label_text(model, tokenizer, args.text, data_dir, args.text_chunk, args.gen_batch, feature_layers,
                             label_tokens=args.label_tokens)
    if args.local_text > 0:
        files = local_text_files(random.Random(args.seed), held_out())[: args.local_text]
        shards += label_text(model, tokenizer, files, data_dir, args.text_chunk, args.gen_batch, feature_layers,
                             max_tokens=args.local_text_tokens, label_tokens=args.label_tokens)
    if not args.all_shards:
        return load_shards(shards)
    known = set(shards)
    shards += sorted(p for p in data_dir.glob("*.pt") if not p.name.startswith("answers-") and p not in known)
    width = model.config.hidden_size * max(len(feature_layers), 1)
    rows = []
    for shard in shards:  # one at a time: a shard made for a head with other feature layers is dropped unkept
        rows += [r for r in load_shards([shard])
                 if r["features"].shape[1] == width and ("final" in r) == bool(feature_layers)]
    return rows


def run(args: argparse.Namespace) -> int:
    from specserve.engine.feature_drafter import (eagle3_feature_layers, load_feature_head, resolve_head_path,
                                                  save_feature_head)

    from .train import TrainSettings, choose_draft_vocab, describe, init_head, train_head, warm_start

    if args.threads:
        torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    began = time.time()
    model, tokenizer = load_model(args.model, args.dtype, args.device_map, args.device)
    model.requires_grad_(False)
    layers = eagle3_feature_layers(model.config.num_hidden_layers) if args.eagle3_features else ()
    rows = collect_data(model, tokenizer, args, layers)
    if args.data_only:
        print(f"data: {describe(rows)}")
        return 0
    if not rows:
        print("no training data (give --prompts / --text, or drop --no-default-prompts)", file=sys.stderr)
        return 2
    data = describe(rows)
    print(f"data: {data}")
    vocab = int(model.get_output_embeddings().weight.shape[0])
    torch.manual_seed(args.seed)
    head = init_head(model, choose_draft_vocab(rows, args.draft_vocab, vocab), layers)
    if args.init_from:
        warm_start(head, load_feature_head(resolve_head_path(args.init_from), model))
    device = args.train_device or ("cuda" if torch.cuda.is_available() else "cpu")
    head.to(device=device, dtype=torch.float32)
    settings = TrainSettings(time_budget=args.time_budget, max_epochs=args.max_epochs, batch_tokens=args.batch_tokens,
                             lr=args.lr, ttt_steps=args.ttt_steps, seed=args.seed)
    answers = [r for r in rows if r["prompt_len"] > 0]
    training = train_head(head, rows + answers * (args.answer_repeat - 1), settings, args.out / "checkpoint.pt")
    extra = {"training": training, "data": data, "target": args.model}
    save_feature_head(head.cpu(), args.out, store_lm_head=args.store_lm_head, extra=extra)
    print(f"wrote {args.out / 'config.json'} and {args.out / 'model.safetensors'}")
    report = {"data": data, "training": training, "wall_seconds": round(time.time() - began, 1)}
    if args.eval_per_category > 0:
        from .report import acceptance_report, format_report

        report["heldout"] = acceptance_report(model, tokenizer, args.out, args.eval_per_category, args.eval_tokens,
                                              args.eval_gamma)
        print(format_report(report["heldout"]))
    (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specserve distill", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
