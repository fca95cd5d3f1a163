"""Prompt sets for benchmarks and tuning (JSON lines of {"category", "chat", "prompt"}), and what
every benchmark row reports of a run."""
from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
GENERAL = HERE / "prompts.jsonl"  # chat, code, summarise
EXTRACTION = HERE / "prompts_extraction.jsonl"  # answers that copy from the prompt


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


def per_token_alpha(accepted: int, rejections: int) -> float | None:
    """α as the speedup arithmetic uses it: the chance that a draft is accepted given that every
    draft before it in its step was (the geometric model's MLE: accepted / (accepted + steps that
    rejected a draft)). Unlike accepted / drafted, it does not fall as γ grows. None: no trials."""
    return accepted / (accepted + rejections) if accepted + rejections else None


class SpeedAndAcceptance:
    """For benchmark rows that count tokens, seconds, accepted drafts and rejections."""

    tokens: int
    seconds: float
    steps: int
    drafted: int
    accepted: int
    rejections: int

    def add_metrics(self, metrics) -> None:
        """Add one request's engine metrics (RequestMetrics) to this row's counts."""
        self.steps += metrics.num_steps
        self.drafted += metrics.num_draft_tokens
        self.accepted += metrics.num_accepted_tokens
        self.rejections += metrics.num_rejections

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def alpha(self) -> float:
        """Per-token acceptance probability under the geometric model (MLE); 0 with no trials."""
        return per_token_alpha(self.accepted, self.rejections) or 0.0
