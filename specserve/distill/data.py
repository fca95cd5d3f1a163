"""Training data for a feature head: the target's own answers, with its hidden states.

For every prompt the target answers (greedy, or sampled for variety, batched `generate`), then one
forward over prompt + answer records, per position t:

- `ids[t]`        the token at t (prompt tokens, then the target's answer);
- `features[t]`   the target's feature at t (the final norm's output, or the outputs of the
                  decoder layers named by `feature_layers`, concatenated): what the head reads;
- `final[t]`      with `feature_layers` only: the final norm's output at t, whose distribution
                  over the draft vocabulary is the head's soft label;
- `argmax[t]`     the target's greedy choice for position t+1 (the head's label).

Prompts come from files (JSON lines of {"chat", "prompt"} as in specserve/bench, or plain text
with one chat prompt per line), from local text (Python source with docstrings as code prompts,
documentation paragraphs as summarise prompts) and from the target itself (`self_instruct_prompts`:
the chat template up to the user's turn, sampled, so the target writes the questions its users
would ask). Answers (token ids) and features are separate shards, both written as they finish: an
interrupted run resumes where it stopped, and a head with other feature layers reuses the answers
(the expensive part for a large target).
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


def _python_sources() -> list[Path]:
    """The standard library's modules (tests left out), then installed packages' modules."""
    stdlib, purelib = Path(sysconfig.get_paths()["stdlib"]), Path(sysconfig.get_paths()["purelib"])
    own = sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts
                 and "tests" not in p.parts)
    return own + sorted(p for p in purelib.rglob("*.py") if "test" not in p.parts and "tests" not in p.parts)


def code_prompts(count: int, rng: random.Random, exclude: set[str]) -> list[PromptRecord]:
    """Raw completion prompts from local Python sources (the standard library, then installed
    packages): a top-level function's signature and docstring (the body is the target's to write)."""
    found = []
    for path in _python_sources():
        try:
            text = path.read_text(errors="ignore")
            tree = ast.parse(text)
        except (SyntaxError, ValueError, RecursionError, OSError):
            continue
        lines = text.splitlines()
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_") or node.name in exclude:
                continue
            doc = node.body[0] if node.body else None
            if not (isinstance(doc, ast.Expr) and isinstance(getattr(doc, "value", None), ast.Constant)
                    and isinstance(doc.value.value, str)):
                continue
            head = "\n".join(lines[node.lineno - 1 : doc.end_lineno])
            if 40 < len(head) < 600:
                found.append(PromptRecord(head + "\n", False))
        if len(found) >= 4 * count:  # enough to choose from without parsing every installed package
            break
    rng.shuffle(found)
    return found[:count]


def paragraphs(min_chars: int = 250, max_chars: int = 700) -> list[str]:
    """Prose paragraphs from local documentation: module docstrings of the standard library, the
    long descriptions of installed packages and their .md/.rst files."""
    docs = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            docs.append(ast.get_docstring(ast.parse(path.read_text(errors="ignore"))) or "")
        except (SyntaxError, ValueError):
            continue
    purelib = Path(sysconfig.get_paths()["purelib"])
    for path in sorted(purelib.glob("*.dist-info/METADATA")):
        docs.append(path.read_text(errors="ignore").partition("\n\n")[2])
    for path in sorted(p for ext in ("*.md", "*.rst") for p in purelib.rglob(ext)):
        docs.append(path.read_text(errors="ignore"))
    out = []
    for doc in docs:
        for para in doc.split("\n\n"):
            flat = " ".join(para.split())
            prose = flat[:1].isupper() and not any(c in flat for c in ("`", "|", ">>>", "http", "[!", "* "))
            if min_chars <= len(flat) <= max_chars and prose:
                out.append(flat)
    return list(dict.fromkeys(out))  # a package's README is often its METADATA too


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


def self_summary_prompts(tokenizer, data_dir: Path, count: int, rng: random.Random,
                         held_out: list[PromptRecord] = ()) -> list[PromptRecord]:
    """Summarise prompts over the target's own prose: its answers already in `data_dir` (the
    answers shards of earlier `--self-instruct` runs), each cut after its last whole sentence, kept
    when 250-700 characters of plain prose (no code, lists or headings) that share no run of six
    words with a held-out prompt, and wrapped in one of SUMMARY_TASKS."""
    banned = [_shingles(r.prompt) for r in held_out]
    found: dict[str, None] = {}
    for path in sorted(data_dir.glob("answers-self-*.pt")):
        if path.name.startswith("answers-self-summary"):
            continue  # not its own source: the set stays the same after a run
        for _, answer in torch.load(path):
            text = tokenizer.decode(answer, skip_special_tokens=True)
            if any(mark in text for mark in ("```", "\n-", "\n*", "\n#", "\n1.", "http")):
                continue
            end = max(text.rfind(". "), text.rfind("! "), text.rfind("? "), *(
                len(text) - 1 for mark in ".!?" if text.endswith(mark)))
            flat = " ".join(text[: end + 1].split())
            if 250 <= len(flat) <= 700 and flat[:1].isupper() and not _overlaps(flat, banned):
                found[flat] = None
    paras = list(found)
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
def answer_batch(model, tokenizer, prompts: list[list[int]], max_new: int, temperature: float,
                 eos_ids: set[int] | None = None) -> list[list[int]]:
    """The target's answers (token ids, up to and including the first of `eos_ids`, by default the
    model's EOS) to a batch of prompts."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    width = max(map(len, prompts))
    device = model.get_input_embeddings().weight.device
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)  # [B, P] left-padded
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    if eos_ids is None:
        eos = model.generation_config.eos_token_id
        eos_ids = {eos} if isinstance(eos, int) else set(eos or ())
    sample = temperature > 0
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=sample,
        temperature=temperature if sample else None, top_p=0.95 if sample else None, top_k=None,
        pad_token_id=pad, eos_token_id=sorted(eos_ids),
    )[:, width:].tolist()
    answers = []
    for row in out:
        cut = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        answers.append(row[:cut])
    return answers


@torch.no_grad()
def label_batch(model, capture: FeatureCapture, seqs: list[list[int]], max_tokens: int = 8192,
                final: FeatureCapture | None = None) -> list[dict]:
    """Forwards over whole sequences -> per sequence ids [L], features [L, F] fp16, argmax [L]
    (and final [L, H] fp16 when `final` captures the final norm). Sequences go in groups of at
    most `max_tokens` padded tokens, which bounds the logits ([rows, width, V] fp32) a forward holds."""
    out = []
    first = 0
    while first < len(seqs):
        last, width = first + 1, len(seqs[first])
        while last < len(seqs) and (last + 1 - first) * max(width, len(seqs[last])) <= max_tokens:
            width = max(width, len(seqs[last]))
            last += 1
        out += in_halves(lambda part: _label_group(model, capture, part, final), seqs[first:last])
        first = last
    return out


def in_halves(work, items: list) -> list:
    """`work(items)`, or, when the GPU runs out of memory, `work` on each half in turn (down to
    single items): one batch too large for the memory left (long prompts, another process on the
    GPU) slows a data run instead of ending it. `work` returns one result per item, in order."""
    try:
        return work(items)
    except torch.cuda.OutOfMemoryError:
        if len(items) == 1:
            raise
    torch.cuda.empty_cache()
    half = len(items) // 2
    return in_halves(work, items[:half]) + in_halves(work, items[half:])


def _label_group(model, capture: FeatureCapture, seqs: list[list[int]], final: FeatureCapture | None) -> list[dict]:
    width = max(map(len, seqs))
    device = model.get_input_embeddings().weight.device
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs], device=device)  # [B, L] right-padded
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs], device=device)
    argmax = model(input_ids=ids, attention_mask=mask).logits.argmax(-1)  # [B, L]
    feats = capture.take()  # [B, L, F]
    last = final.take() if final is not None else None  # [B, L, H]
    rows = []
    for b, n in enumerate(map(len, seqs)):
        row = {"ids": ids[b, :n].to(torch.int32).cpu(), "features": feats[b, :n].to(torch.float16).cpu().clone(),
               "argmax": argmax[b, :n].to(torch.int32).cpu()}
        if last is not None:
            row["final"] = last[b, :n].to(torch.float16).cpu().clone()
        rows.append(row)
    return rows


def _captures(model, feature_layers: tuple[int, ...]) -> tuple[FeatureCapture, FeatureCapture | None]:
    """The features' capture, and the final norm's when the features are other layers."""
    return FeatureCapture(model, feature_layers), (FeatureCapture(model, ()) if feature_layers else None)


def _remove(*captures: FeatureCapture | None) -> None:
    for c in captures:
        if c is not None:
            c.remove()


SHARD_FORMAT = 2  # in a features shard's key: a shard written in an older layout is made anew


def _key(*parts) -> str:
    return hashlib.sha1(json.dumps(parts).encode()).hexdigest()[:16]


def generate_shards(model, tokenizer, records: list[PromptRecord], out_dir: Path, *, max_new: int,
                    temperature: float, batch_size: int, seed: int, feature_layers: tuple[int, ...] = (),
                    tag: str = "data", label_tokens: int = 8192) -> list[Path]:
    """Answer and label `records` in batches: per batch an answers shard (token ids; reused by
    any feature layers) and a features shard (skipped when present)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    capture, final = _captures(model, feature_layers)
    order = sorted(range(len(records)), key=lambda i: len(records[i].prompt))  # similar lengths per batch
    shards = []
    try:
        for first in tqdm(range(0, len(order), batch_size), desc=f"generate {tag}", unit="batch"):
            batch = [records[i] for i in order[first : first + batch_size]]
            key = _key([[r.prompt, r.chat] for r in batch], max_new, temperature, seed)
            path = out_dir / f"{tag}-{_key(key, list(feature_layers), SHARD_FORMAT)}.pt"
            shards.append(path)
            if path.is_file():
                continue
            pairs = _answers(model, tokenizer, batch, out_dir / f"answers-{tag}-{key}.pt", max_new, temperature,
                             seed + first)
            rows = label_batch(model, capture, [p + a for p, a in pairs], label_tokens, final)
            for row, (p, _) in zip(rows, pairs):
                row["prompt_len"] = len(p)
            _save_shard(rows, path)
    finally:
        _remove(capture, final)
    return shards


def _answers(model, tokenizer, batch: list[PromptRecord], path: Path, max_new: int, temperature: float,
             seed: int) -> list[tuple[list[int], list[int]]]:
    """[(prompt ids, answer ids)] for a batch, from its answers shard or generated (and saved)."""
    if path.is_file():
        return [tuple(pair) for pair in torch.load(path)]
    torch.manual_seed(seed)
    prompts = [encode(tokenizer, r) for r in batch]
    answers = in_halves(lambda part: answer_batch(model, tokenizer, part, max_new, temperature), prompts)
    pairs = list(zip(prompts, answers))
    _save_shard(pairs, path)
    return pairs


# Openings for half of the self-written prompts: what users ask for, so every kind is represented.
OPENERS = ("How", "What", "Why", "Can you", "Explain", "Write", "Give me", "List", "Describe", "Summarize",
           "Compare", "I need", "Help me", "Create", "Tell me", "Is it", "Which", "Suggest", "Translate", "Fix")


def self_instruct_prompts(model, tokenizer, count: int, *, seed: int, batch_size: int, temperature: float = 0.9,
                          max_tokens: int = 64, held_out: list[PromptRecord] = (), path: Path | None = None
                          ) -> list[PromptRecord]:
    """`count` chat prompts written by the target: the chat template up to the user's message,
    then sampled until the end of the user's turn (half of them from one of OPENERS). Prompts cut
    off by `max_tokens`, too short, repeated, or overlapping a held-out prompt are dropped, so
    fewer than `count` may come back. Saved to / resumed from `path` (JSON lines)."""
    if path is not None and path.is_file():
        return read_prompt_file(path)[:count]
    marker = "\x00PROMPT\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                         add_generation_prompt=True)
    before, after = text.split(marker)
    stop = set(tokenizer(after, add_special_tokens=False)["input_ids"][:1])  # the end of the user's turn
    if tokenizer.eos_token_id is not None:
        stop.add(tokenizer.eos_token_id)
    rng = random.Random(seed)
    found: dict[str, PromptRecord] = {}
    banned = [_shingles(r.prompt) for r in held_out]
    bar = tqdm(total=count, desc="self-instruct", unit="prompt")
    rounds = 0
    while len(found) < count and rounds < 4 * (count // batch_size + 1):
        openers = [rng.choice(OPENERS) if i % 2 else "" for i in range(batch_size)]
        prompts = [tokenizer(before + o, add_special_tokens=False)["input_ids"] for o in openers]
        torch.manual_seed(seed + rounds)
        rounds += 1
        written_all = in_halves(lambda part: answer_batch(model, tokenizer, part, max_tokens, temperature, stop),
                                prompts)
        for opener, written in zip(openers, written_all):
            if not written or written[-1] not in stop:
                continue  # cut off: not a whole prompt
            prompt = (opener + tokenizer.decode(written[:-1])).strip()
            key = " ".join(prompt.lower().split())
            if 12 <= len(prompt) <= 600 and key not in found and not _overlaps(prompt, banned):
                found[key] = PromptRecord(prompt, True)
                bar.update(1)
    bar.close()
    records = list(found.values())[:count]
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps({"prompt": r.prompt, "chat": True}) + "\n" for r in records))
        tmp.rename(path)
    return records


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def _grams(words: list[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def _shingles(text: str, n: int = 6) -> tuple[int, set[tuple[str, ...]]]:
    """(n', the runs of n' words of `text`), n' = n or the whole of a shorter text."""
    words = _words(text)
    size = max(1, min(n, len(words)))
    return size, _grams(words, size)


def _overlaps(prompt: str, banned: list[tuple[int, set[tuple[str, ...]]]]) -> bool:
    """Shares a run of six words (or the whole of a shorter prompt) with a held-out prompt."""
    words = _words(prompt)
    return any(_grams(words, n) & grams for n, grams in banned)


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
               feature_layers: tuple[int, ...] = (), max_tokens: int | None = None,
               label_tokens: int = 8192) -> list[Path]:
    """Plain text read by the target as it is (no generation): chunks of `chunk` tokens (of the
    first `max_tokens` of each file when given), labelled with the target's features and greedy
    choices; one shard per file."""
    out_dir.mkdir(parents=True, exist_ok=True)
    capture, final = _captures(model, feature_layers)
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
                rows += label_batch(model, capture, pieces[first : first + batch_size], label_tokens, final)
            for row in rows:
                row["prompt_len"] = 0
            _save_shard(rows, shard)
    finally:
        _remove(capture, final)
    return shards
