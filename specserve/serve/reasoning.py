"""A reasoning model's chat answer, split: the thinking between its tags goes to the `reasoning`
field (config `reasoning.fields`), the rest to `content`, whole or as it streams.

    the rendered prompt          the output                         reasoning      content
    leaves `start` open          "...</think>\\n\\nAnswer"           "..."          "Answer"
    (DeepSeek-R1's template)     "... (cut by max_tokens)"          "..."          null
    does not                     "<think>...</think>Answer"         "..."          "Answer"
    (Qwen3's hybrid models)      "Answer"                           null           "Answer"

Whitespace right after a tag is dropped from the part it opens; a tag never shows in either
part. Whatever chunks the text arrives in, the parts are the same (a possible tag at the end of
a chunk is held back until the next one decides it). The tags must be text the detokenizer shows
(`check_tags`): tokens that decoding hides as special would leave nothing to split at.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Awaitable, Callable

from specserve.engine.grammar import Reasoning

from .text import tag_prefix

BEFORE, THINKING, ANSWERING = "before", "thinking", "answering"


@dataclass(frozen=True)
class ReasoningSpec:
    """What one chat request does with reasoning: the tags, whether its prompt opened them, which
    fields carry the text, and whether the client wants it (`include_reasoning`)."""

    start: str
    end: str
    opened: bool
    fields: tuple[str, ...] = ("reasoning",)
    include: bool = True

    @staticmethod
    def of(config, prompt: str, include: bool = True) -> "ReasoningSpec | None":
        """A chat's spec under the app's `reasoning` config (None: not a reasoning model), given
        its rendered prompt."""
        if config is None:
            return None
        return ReasoningSpec(config.start, config.end, opens_reasoning(prompt, config.start, config.end),
                             config.fields, include)

    def grammar_reasoning(self) -> Reasoning:
        """The free reasoning a grammar lets the output begin with (engine/grammar.py)."""
        return Reasoning(self.start, self.end, self.opened)

    def split(self) -> "ReasoningSplit":
        return ReasoningSplit(self.start, self.end, self.opened)


def opens_reasoning(prompt: str, start: str, end: str) -> bool:
    """Whether the rendered prompt leaves reasoning open: its last `start` comes after its last `end`."""
    at = prompt.rfind(start)
    return at >= 0 and at > prompt.rfind(end)


def check_tags(tokenizer, start: str, end: str) -> None:
    """Refuse tags the detokenizer would hide (special tokens skipped at decoding)."""
    for name, tag in (("start", start), ("end", end)):
        ids = tokenizer(tag, add_special_tokens=False).input_ids
        if tag not in tokenizer.decode(ids, skip_special_tokens=True):
            raise ValueError(f"reasoning.{name} {tag!r} is a special token that decoding hides from the text: "
                             "the answer could not be split at it")


class ReasoningSplit:
    """One choice's text -> (reasoning, content) pieces, fed as it streams. `thinking` while in
    the reasoning, `answering` from the content's start on; `reasoned`: some reasoning began."""

    def __init__(self, start: str, end: str, opened: bool) -> None:
        self.start, self.end = start, end
        self.state = THINKING if opened else BEFORE
        self.reasoned = opened
        self.held = ""
        self.trim = opened  # whitespace at the start of the current part is still dropped

    @property
    def answering(self) -> bool:
        return self.state == ANSWERING

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        """Text that came (final: the last of it) -> (reasoning, content) that can go out now."""
        self.held += text
        if self.state == BEFORE and not self._decide(final):
            return "", ""
        reasoning = ""
        if self.state == THINKING:
            at = self.held.find(self.end)
            if at < 0:
                keep = 0 if final else tag_prefix(self.held, self.end)
                return self._part(len(self.held) - keep, len(self.held) - keep), ""
            reasoning = self._part(at, at + len(self.end))
            self.state, self.trim = ANSWERING, True
        return reasoning, self._part(len(self.held), len(self.held))

    def _decide(self, final: bool) -> bool:
        """Before anything went out: does the output open reasoning? False while it cannot tell."""
        lead = self.held.lstrip()
        if lead.startswith(self.start):
            self.state, self.reasoned, self.trim = THINKING, True, True
            self.held = lead[len(self.start):]
            return True
        if self.start.startswith(lead) and not final:  # (blank so far, or a prefix of the tag)
            return False
        self.state = ANSWERING  # no reasoning: the text goes out as it came
        return True

    def _part(self, upto: int, drop: int) -> str:
        """held[:upto] out as the current part (its leading whitespace trimmed while `trim`), and
        held[:drop] gone."""
        out, self.held = self.held[:upto], self.held[drop:]
        if self.trim:
            out = out.lstrip()
            self.trim = not out
        return out


def reasoning_tokens(tokenizer, token_ids: list[int], spec: ReasoningSpec) -> int:
    """How many of the output's tokens are its reasoning: through the end tag (all of them when
    the reasoning never ended, none when the output did not reason). Decodes O(log n) prefixes."""
    split = spec.split()
    split.feed(tokenizer.decode(token_ids, skip_special_tokens=False), True)
    if not split.reasoned:
        return 0
    if not split.answering:
        return len(token_ids)
    single = tokenizer(spec.end, add_special_tokens=False).input_ids
    if len(single) == 1 and single[0] in token_ids:
        return token_ids.index(single[0]) + 1
    low, high = 1, len(token_ids)  # the shortest prefix whose text holds the end tag (after a start)
    while low < high:
        mid = (low + high) // 2
        probe = spec.split()
        probe.feed(tokenizer.decode(token_ids[:mid], skip_special_tokens=False), True)
        if probe.answering and probe.reasoned:
            high = mid
        else:
            low = mid + 1
    return low


class ThoughtCount:
    """One output's reasoning tokens (`reasoning_tokens`, run through `offload`), remembered once
    the answer has begun: asked again with more tokens, as for the usage after a stream split its
    logprobs at the text's start, it costs nothing, since what follows the end tag is no reasoning."""

    def __init__(self, tokenizer, spec: ReasoningSpec, offload: Callable[..., Awaitable]) -> None:
        self.tokenizer, self.spec, self.offload = tokenizer, spec, offload
        self.settled: int | None = None

    async def __call__(self, token_ids: list[int]) -> int:
        if self.settled is None:
            count = await self.offload(reasoning_tokens, self.tokenizer, token_ids, self.spec)
            if 0 < count < len(token_ids):  # (0 is one decode, no search: asked again, it looks again)
                self.settled = count
            return count
        return self.settled
