"""Token ids -> text, incrementally: never emits half a multi-byte character, cuts at stop strings."""
from __future__ import annotations

_CONTEXT = 4  # prompt tokens decoded in front of the output, so leading-space rules match a full decode
# Tokens held back while the text ends in U+FFFD (or adds nothing: skipped special tokens). A UTF-8
# character has at most 4 bytes and a text token adds at least one, so a replacement character that
# outlives this many tokens is real (the model produced invalid bytes): emit it, so the window,
# decoded on every push, stays a few tokens long whatever the model generates.
_MAX_PENDING = 8


class IncrementalDetokenizer:
    """Decodes a window [prefix, end) and emits what it adds beyond [prefix, read); a window whose
    text ends in U+FFFD (an unfinished UTF-8 sequence) waits for the next tokens."""

    def __init__(self, tokenizer, prompt_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-_CONTEXT:])
        self.prefix = 0
        self.read = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        seen = self._decode(self.ids[self.prefix : self.read])
        text = self._decode(self.ids[self.prefix :])
        waiting = len(text) <= len(seen) or text.endswith("\ufffd")
        if waiting and len(self.ids) - self.read < _MAX_PENDING:
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(seen) :]

    def flush(self) -> str:
        """Whatever is left at the end of the request (an unfinished character included)."""
        seen = self._decode(self.ids[self.prefix : self.read])
        text = self._decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return text[len(seen) :]


class StopStrings:
    """Holds back the last (longest stop - 1) characters until they cannot start a stop string."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.buffer = ""

    def feed(self, text: str, final: bool) -> tuple[str, bool]:
        """-> (text to emit, whether a stop string was hit; the stop string itself is not emitted)."""
        self.buffer += text
        hits = [i for i in (self.buffer.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.buffer = self.buffer[: min(hits)], ""
            return out, True
        keep = 0 if final else self.hold
        cut = max(len(self.buffer) - keep, 0)
        out, self.buffer = self.buffer[:cut], self.buffer[cut:]
        return out, False
