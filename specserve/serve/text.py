"""Token ids -> text, incrementally: never emits half a multi-byte character, cuts at stop strings."""
from __future__ import annotations

from dataclasses import dataclass

_CONTEXT = 4  # prompt tokens decoded in front of the output, so leading-space rules match a full decode
# Tokens held back while the text ends in U+FFFD (or adds nothing: skipped special tokens). A UTF-8
# character has at most 4 bytes and a text token adds at least one, so a replacement character that
# outlives this many tokens is real (the model produced invalid bytes): emit it, so the window,
# decoded on every push, stays a few tokens long whatever the model generates.
_MAX_PENDING = 8
# ... and then emitted only up to a cut with at least this many text-bearing tokens after it (skipped
# special tokens do not count): a UTF-8 character has at most 4 bytes, so the bytes before the cut
# cannot combine with tokens still to come (whatever chunks the tokens arrive in, the text is the same).
_HOLD = 3


@dataclass(frozen=True)
class TextRules:
    """How one generation's tokens become its text (the request's options)."""

    stops: tuple[str, ...] = ()  # stop strings: the text ends before the first (`include_stop`: after it)
    min_tokens: int = 0  # no stop string ends in the first min_tokens - 1 tokens' text
    include_stop: bool = False  # the stop string, or the text of the stop token that ended it, stays in
    skip_special: bool = True  # special tokens have no text


class IncrementalDetokenizer:
    """Decodes a window [prefix, end) and emits what it adds beyond [prefix, read); a window whose
    text ends in U+FFFD (an unfinished UTF-8 sequence) waits for the next tokens."""

    def __init__(self, tokenizer, prompt_ids: list[int], skip_special: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self.ids = list(prompt_ids[-_CONTEXT:])
        self.prefix = 0
        self.read = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        seen = self._decode(self.ids[self.prefix : self.read])
        text = self._decode(self.ids[self.prefix :])
        waiting = len(text) <= len(seen) or text.endswith("\ufffd")
        if not waiting:
            self.prefix, self.read = self.read, len(self.ids)
            return text[len(seen) :]
        if len(self.ids) - self.read < _MAX_PENDING:
            return ""
        return self._emit_settled(seen, text)

    def _emit_settled(self, seen: str, text: str) -> str:
        """Many tokens pending while the text still ends in U+FFFD (the model produced invalid
        bytes): emit up to the last cut, _HOLD text-bearing tokens or more before the end, whose text
        the whole window's text starts with (so later tokens cannot change it); with none, wait,
        and past 4 x _MAX_PENDING tokens emit all of it (the window stays bounded)."""
        for cut in range(self._latest_cut(), self.read, -1):
            head = self._decode(self.ids[self.prefix : cut])
            if text.startswith(head) and head.startswith(seen):
                self.prefix, self.read = self.read, cut
                return head[len(seen) :]
        if len(self.ids) - self.read < 4 * _MAX_PENDING:  # (mostly skipped special tokens so far)
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(seen) :]

    def _latest_cut(self) -> int:
        held, cut = 0, len(self.ids)
        while cut > self.read and held < _HOLD:
            cut -= 1
            held += self._decode(self.ids[cut : cut + 1]) != ""
        return cut

    def flush(self) -> str:
        """Whatever is left at the end of the request (an unfinished character included)."""
        seen = self._decode(self.ids[self.prefix : self.read])
        text = self._decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return text[len(seen) :]


class StopStrings:
    """Holds back the last (longest stop - 1) characters until they cannot start a stop string.
    Text given to `shield` (min_tokens' first tokens) goes out as usual, but no stop string that
    ends inside it counts (vLLM's rule: stop strings are checked from the min_tokens-th token on)."""

    def __init__(self, stops: list[str] | tuple[str, ...], include: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.include = include  # a hit emits the stop string too
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.buffer = ""
        self.start = 0  # characters emitted before buffer[0]
        self.floor = 0  # characters, from the start of the output, in which no stop string may end
        self.hit: str | None = None  # the stop string that ended the text

    def shield(self, text: str) -> None:
        """Text in which no stop string may end (it is emitted by the next `feed`)."""
        self.buffer += text
        self.floor = self.start + len(self.buffer)

    def feed(self, text: str, final: bool) -> tuple[str, bool]:
        """-> (text to emit, whether a stop string was hit; the stop string itself is not emitted)."""
        self.buffer += text
        hits = [(i, -len(s)) for i, s in ((self.buffer.find(s, max(self.floor - self.start - len(s) + 1, 0)), s)
                                          for s in self.stops) if i >= 0]
        if hits:
            at, minus_length = min(hits)  # the earliest, the longest of those
            self.hit = self.buffer[at: at - minus_length]
            out, self.buffer = self.buffer[: at - minus_length if self.include else at], ""
            return out, True
        keep = 0 if final else self.hold
        cut = max(len(self.buffer) - keep, 0)
        out, self.buffer = self.buffer[:cut], self.buffer[cut:]
        self.start += cut
        return out, False


def shown_ids(token_ids: list[int], finish_reason: str | None) -> list[int]:
    """A delta's tokens whose text the output shows: all but the stop token that ends it (an
    engine's "stop" is always a stop id: EOS, stop_token_ids, a grammar's EOS)."""
    return token_ids[:-1] if finish_reason == "stop" and token_ids else token_ids


def tag_prefix(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag` (held back from a
    stream until the next text decides)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
