"""Training data for a feature head: the target's own answers, with its hidden states.

For every prompt the target answers (greedy, or sampled for variety, batched `generate`), then one
forward over prompt + answer records, per position t:

- `ids[t]`        the token at t (prompt tokens, then the target's answer);
- `features[t]`   the target's feature at t (the final norm's output, or the outputs of the
                  decoder layers named by `feature_layers`, concatenated): what the head reads;
- `argmax[t]`     the target's greedy choice for position t+1 (the head's label).

Prompts come from files (JSON lines of {"chat", "prompt"} as in specserve/bench, or plain text
with one chat prompt per line) and from local text (Python source with docstrings as code
prompts, documentation paragraphs as summarise prompts). Shards are written as they finish, so an
interrupted run resumes where it stopped.
"""
from __future__ import annotations

import ast
import hashlib
import json
import random
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm


@dataclass(frozen=True)
class PromptRecord:
    prompt: str
    chat: bool  # wrap in the chat template (else raw completion, e.g. code)


# -- prompts ------------------------------------------------------------------------------------
def read_prompt_file(path: Path) -> list[PromptRecord]:
    """JSON lines ({"prompt", "chat"}) or plain text: one chat prompt per line ('\\n' = newline),
    '#' lines and '## heldout' sections skipped."""
    path = Path(path)
    text = path.read_text()
    if path.suffix == ".jsonl":
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        return [PromptRecord(r["prompt"], bool(r.get("chat", True))) for r in rows]
    out, section = [], None
    for line in text.splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        elif line.strip() and not line.startswith("#") and section != "heldout":
            out.append(PromptRecord(line.strip().replace("\\n", "\n"), True))
    return out


def code_prompts(count: int, rng: random.Random, exclude: set[str]) -> list[PromptRecord]:
    """Raw completion prompts from the Python standard library: a function's signature and
    docstring (the body is the target's to write)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for path in sorted(root.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(errors="ignore"))
            lines = path.read_text(errors="ignore").splitlines()
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_") or node.name in exclude:
                continue
            doc = node.body[0] if node.body else None
            if not (isinstance(doc, ast.Expr) and isinstance(getattr(doc, "value", None), ast.Constant)
                    and isinstance(doc.value.value, str)) or node.col_offset:
                continue
            head = "\n".join(lines[node.lineno - 1 : doc.end_lineno])
            if 40 < len(head) < 600:
                found.append(PromptRecord(head + "\n", False))
    rng.shuffle(found)
    return found[:count]


def paragraphs(min_chars: int = 250, max_chars: int = 700) -> list[str]:
    """Prose paragraphs from local documentation: module docstrings of the standard library and
    the long descriptions of installed packages."""
    docs = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            docs.append(ast.get_docstring(ast.parse(path.read_text(errors="ignore"))) or "")
        except (SyntaxError, ValueError):
            continue
    for path in sorted(Path(sysconfig.get_paths()["purelib"]).glob("*.dist-info/METADATA")):
        docs.append(path.read_text(errors="ignore").partition("\n\n")[2])
    out = []
    for doc in docs:
        for para in doc.split("\n\n"):
            flat = " ".join(para.split())
            prose = flat[:1].isupper() and not any(c in flat for c in ("`", "|", ">>>", "http", "[!", "* "))
            if min_chars <= len(flat) <= max_chars and prose:
                out.append(flat)
    return out


SUMMARY_TASKS = (
    "Summarise this paragraph in one sentence:\n\n{}",
    "Summarize the following text in two sentences:\n\n{}",
    "Explain this passage in simple words:\n\n{}",
    "What is the main point of this text?\n\n{}",
)


def summary_prompts(count: int, rng: random.Random) -> list[PromptRecord]:
    paras = paragraphs()
    rng.shuffle(paras)
    return [PromptRecord(rng.choice(SUMMARY_TASKS).format(p), True) for p in paras[:count]]


def without(records: list[PromptRecord], held_out: list[PromptRecord]) -> list[PromptRecord]:
    """Drop every record whose prompt is one of the held-out prompts (whitespace/case-insensitive)."""
    def key(text: str) -> str:
        return " ".join(text.lower().split())
    banned = {key(r.prompt) for r in held_out}
    return [r for r in records if key(r.prompt) not in banned]


def local_text_files(rng: random.Random, held_out: list[PromptRecord]) -> list[Path]:
    """Local files to read as plain text, code and prose alternating in a shuffled order: Python
    sources of the standard library and of installed packages, and the packages' documentation
    (.md, .rst, METADATA). Files that define a function or class named in a held-out code prompt,
    or that contain a held-out prompt's text, are left out."""
    stdlib, purelib = Path(sysconfig.get_paths()["stdlib"]), Path(sysconfig.get_paths()["purelib"])
    code = [p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts]
    code += list(purelib.rglob("*.py"))
    prose = [p for ext in ("*.md", "*.rst", "METADATA") for p in purelib.rglob(ext)]
    names = {m for r in held_out if not r.chat for m in re.findall(r"(?:def|class)\s+(\w+)", r.prompt)}
    names.discard("__init__")
    defines = re.compile(r"(?:def|class)\s+(?:%s)\b" % "|".join(map(re.escape, sorted(names)))) if names else None
    quotes = [" ".join(r.prompt.split())[:80] for r in held_out]

    def allowed(path: Path) -> bool:
        try:
            text = path.read_text(errors="ignore")
        except OSError:
            return False
        flat = " ".join(text.split())
        return len(flat) > 200 and not (defines and defines.search(text)) and not any(q in flat for q in quotes)

    out = []
    for group in (code, prose):
        group = sorted(set(group))
        rng.shuffle(group)
        out.append([p for p in group if allowed(p)])
    return [p for pair in zip(*out) for p in pair] + out[0][len(out[1]):] + out[1][len(out[0]):]


# -- target answers and features ---------------------------------------------------------------
class FeatureCapture:
    """Forward hooks that keep the target's features of the last forward: [B, Q, F]."""

    def __init__(self, model: torch.nn.Module, feature_layers: tuple[int, ...] = ()) -> None:
        from specserve.engine.feature_drafter import feature_modules

        self._outputs: list[torch.Tensor | None] = []
        self._handles = []
        for i, module in enumerate(feature_modules(model, feature_layers)):
            self._outputs.append(None)
            self._handles.append(module.register_forward_hook(self._hook(i)))

    def _hook(self, i: int):
        def hook(module, args, output):
            self._outputs[i] = output[0] if isinstance(output, tuple) else output
        return hook

    def take(self) -> torch.Tensor:
        device = self._outputs[0].device  # a sharded target keeps its layers on several devices
        out = torch.cat([o.to(device) for o in self._outputs], dim=-1)  # [B, Q, F]
        self._outputs = [None] * len(self._outputs)
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def encode(tokenizer, record: PromptRecord) -> list[int]:
    if record.chat:
        messages = [{"role": "user", "content": record.prompt}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(record.prompt, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def answer_batch(model, tokenizer, prompts: list[list[int]], max_new: int, temperature: float) -> list[list[int]]:
    """The target's answers (token ids, up to and including EOS) to a batch of prompts."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    width = max(map(len, prompts))
    device = model.get_input_embeddings().weight.device
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)  # [B, P] left-padded
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    sample = temperature > 0
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=sample,
        temperature=temperature if sample else None, top_p=0.95 if sample else None, top_k=None,
        pad_token_id=pad, eos_token_id=model.generation_config.eos_token_id,
    )[:, width:].tolist()
    eos = model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or ())
    answers = []
    for row in out:
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        answers.append(row[:cut])
    return answers


@torch.no_grad()
def label_batch(model, capture: FeatureCapture, seqs: list[list[int]]) -> list[dict]:
    """One forward over whole sequences -> per sequence ids [L], features [L, F] fp16, argmax [L]."""
    width = max(map(len, seqs))
    device = model.get_input_embeddings().weight.device
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs], device=device)  # [B, L] right-padded
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs], device=device)
    logits = model(input_ids=ids, attention_mask=mask).logits  # [B, L, V]
    feats = capture.take()  # [B, L, F]
    argmax = logits.argmax(-1)  # [B, L]
    return [
        {"ids": ids[b, :n].to(torch.int32).cpu(), "features": feats[b, :n].to(torch.float16).cpu().clone(),
         "argmax": argmax[b, :n].to(torch.int32).cpu()}
        for b, n in enumerate(map(len, seqs))
    ]


def generate_shards(model, tokenizer, records: list[PromptRecord], out_dir: Path, *, max_new: int,
                    temperature: float, batch_size: int, seed: int, feature_layers: tuple[int, ...] = (),
                    tag: str = "data") -> list[Path]:
    """Answer and label `records` in batches, one shard file per batch (skipped when present)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    capture = FeatureCapture(model, feature_layers)
    order = sorted(range(len(records)), key=lambda i: len(records[i].prompt))  # similar lengths per batch
    shards = []
    try:
        for first in tqdm(range(0, len(order), batch_size), desc=f"generate {tag}", unit="batch"):
            batch = [records[i] for i in order[first : first + batch_size]]
            key = hashlib.sha1(json.dumps([[r.prompt, r.chat] for r in batch] + [max_new, temperature, seed,
                                          list(feature_layers)]).encode()).hexdigest()[:16]
            path = out_dir / f"{tag}-{key}.pt"
            shards.append(path)
            if path.is_file():
                continue
            torch.manual_seed(seed + first)
            prompts = [encode(tokenizer, r) for r in batch]
            answers = answer_batch(model, tokenizer, prompts, max_new, temperature)
            rows = label_batch(model, capture, [p + a for p, a in zip(prompts, answers)])
            for row, p in zip(rows, prompts):
                row["prompt_len"] = len(p)
            _save_shard(rows, path)
    finally:
        capture.remove()
    return shards


def _save_shard(rows: list[dict], path: Path) -> None:
    """Write a shard whole or not at all (a run stopped mid-write leaves no half shard to resume from)."""
    tmp = path.with_suffix(".tmp")
    torch.save(rows, tmp)
    tmp.rename(path)


def load_shards(paths: list[Path]) -> list[dict]:
    rows = []
    for path in paths:
        if Path(path).is_file():
            rows += torch.load(path)
    return rows


def label_text(model, tokenizer, files: list[Path], out_dir: Path, chunk: int, batch_size: int,
               feature_layers: tuple[int, ...] = (), max_tokens: int | None = None) -> list[Path]:
    """Plain text read by the target as it is (no generation): chunks of `chunk` tokens (of the
    first `max_tokens` of each file when given), labelled with the target's features and greedy
    choices; one shard per file."""
    out_dir.mkdir(parents=True, exist_ok=True)
    capture = FeatureCapture(model, feature_layers)
    shards = []
    try:
        for path in tqdm(files, desc="label text", unit="file"):
            text = Path(path).read_text(errors="ignore")
            key = hashlib.sha1(json.dumps([text, chunk, list(feature_layers)] + ([max_tokens] if max_tokens else []))
                               .encode()).hexdigest()[:16]
            shard = out_dir / f"text-{key}.pt"
            shards.append(shard)
            if shard.is_file():
                continue
            ids = tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens]
            pieces = [ids[i : i + chunk] for i in range(0, len(ids), chunk) if len(ids[i : i + chunk]) > 8]
            rows = []
            for first in range(0, len(pieces), batch_size):
                rows += label_batch(model, capture, pieces[first : first + batch_size])
            for row in rows:
                row["prompt_len"] = 0
            _save_shard(rows, shard)
    finally:
        capture.remove()
    return shards
