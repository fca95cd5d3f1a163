"""The default training prompt set of `specserve distill`, kept apart from the benchmarks' held-out prompts."""
from __future__ import annotations

import random
import re

from specserve.prompts import EXTRACTION, GENERAL, TRAIN
from .data import PromptRecord, code_prompts, read_prompt_file, summary_prompts, without

TRAIN_PROMPTS = TRAIN


def held_out() -> list[PromptRecord]:
    """The benchmark prompts: never trained on (the acceptance report and the benches use them)."""
    out = []
    for path in (GENERAL, EXTRACTION):
        out += read_prompt_file(path)
    return out


def default_sets(seed: int, num_code: int, num_summary: int) -> dict[str, list[PromptRecord]]:
    """{'chat': train_prompts.txt's train section, 'code': stdlib signatures + docstrings,
    'summary': stdlib documentation paragraphs}, each without the held-out prompts (and, for code,
    without functions that share a name with a held-out code prompt)."""
    rng = random.Random(seed)
    banned = held_out()
    names = {m for r in banned if not r.chat for m in re.findall(r"(?:def|class)\s+(\w+)", r.prompt)}
    return {
        "chat": without(read_prompt_file(TRAIN_PROMPTS), banned),
        "summary": without(summary_prompts(num_summary, rng), banned),
        "code": without(code_prompts(num_code, rng, names), banned),
    }
