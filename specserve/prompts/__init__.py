"""The prompt sets that benchmarks, distillation and tuning share: held-out evaluation prompts
(JSON lines of {"category", "chat", "prompt"}) and the chat prompts the shipped drafters were
distilled on (`TRAIN`, never evaluated on)."""
from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
GENERAL = HERE / "prompts.jsonl"  # chat, code, summarise
EXTRACTION = HERE / "prompts_extraction.jsonl"  # answers that copy from the prompt
TRAIN = HERE / "train_prompts.txt"  # distillation's chat prompts (a train and a held-out section)


def load_records(*paths: Path) -> list[dict]:
    records = []
    for path in paths:
        records += [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return records


def by_category(records: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for r in records:
        groups.setdefault(r["category"], []).append(r)
    return groups


def interleaved(records: list[dict], limit: int | None = None) -> list[dict]:
    """One of each category in turn (chat, code, summarise, ...), so a short prefix mixes them."""
    groups = list(by_category(records).values())
    out = [g[i] for i in range(max(map(len, groups), default=0)) for g in groups if i < len(g)]
    return out[:limit] if limit else out


def encode(tokenizer, record: dict) -> list[int]:
    """Token ids of a record: through the chat template when it is a chat prompt, else as raw text."""
    if record["chat"]:
        messages = [{"role": "user", "content": record["prompt"]}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(record["prompt"], add_special_tokens=False)["input_ids"]
