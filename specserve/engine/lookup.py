"""Prompt lookup: a request's tokens, and where the earlier occurrences of their suffix are.

A drafter that looks up (`PromptLookupProposer`, a feature head's lookup rows) drafts what followed
the best earlier occurrence of a row's suffix: the longest match of at least min_n and at most max_n
tokens, the most recent among equals. It looks every step, for every row, so the search must not
grow with the context: a pass over the whole token list costs ~0.44 ms a row at 8k tokens, 14 ms a
step for a batch of 32 on a GPU whose step takes about that.

`SuffixIndex` keeps, per request, where each min_n-gram of its tokens ends, as a chain from the
latest occurrence back: a step appends its accepted tokens and cuts back its rolled-back drafts
(a few entries each), and a lookup walks the suffix's chain from the most recent occurrence,
extending each match backwards up to max_n. It stops at the first occurrence matching max_n
tokens (none later can beat it) or after `CANDIDATES` occurrences: a longer match further back than
that is not found (a frequent n-gram's chain is long; the most recent ones are the likeliest
continuation anyway). Otherwise the result is the full search's (a test compares them).
"""
from __future__ import annotations

from collections.abc import Iterator

from .model_runner import CacheMiss, RowInput

CANDIDATES = 64  # earlier occurrences of a suffix's min_n-gram a lookup extends, most recent first


def continue_match(seq: list[int], start: int, num_tokens: int) -> list[int]:
    """num_tokens tokens from seq[start] on, continued periodically past the end of seq (a
    repeating pattern keeps repeating); start < len(seq)."""
    out: list[int] = []
    for k in range(num_tokens):  # position start+k of seq + out; start < len(seq), so out[.] exists
        i = start + k
        out.append(seq[i] if i < len(seq) else out[i - len(seq)])
    return out


class SuffixIndex:
    """Where each n-gram of one token list ends, kept as the list grows and is cut back. An end j
    is that of the window tokens[j - n : j]; the ends indexed are those before the list's last
    token (j <= L - 1), so the suffix itself (ending at L) is never its own occurrence."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.tokens: list[int] = []  # what is indexed (a copy: the caller's list changes under it)
        self._latest: dict[tuple[int, ...], int] = {}  # n-gram -> its latest end indexed
        self._prev: list[int] = []  # [j] -> the previous end of the n-gram ending at j (-1: none)

    def sync(self, tokens: list[int], same: int) -> None:
        """Index `tokens`, whose first `same` entries are ones indexed before (the rest changed)."""
        self._cut(min(same, len(self.tokens)))
        for token in tokens[len(self.tokens):]:
            self._push(token)

    def occurrences(self) -> Iterator[int]:
        """Ends j of the earlier occurrences of the last n tokens, most recent first."""
        if len(self.tokens) <= self.n:
            return
        j = self._latest.get(tuple(self.tokens[-self.n:]), -1)
        while j >= 0:
            yield j
            j = self._prev[j]

    def _push(self, token: int) -> None:
        j = len(self.tokens)  # the end that becomes indexable once `token` follows it
        prev = -1
        if j >= self.n:
            key = tuple(self.tokens[j - self.n : j])
            prev = self._latest.get(key, -1)
            self._latest[key] = j
        self.tokens.append(token)
        self._prev.append(prev)

    def _cut(self, length: int) -> None:
        """Back to the first `length` tokens: the ends past them leave, latest first."""
        for j in range(len(self.tokens) - 1, max(length, self.n) - 1, -1):
            key = tuple(self.tokens[j - self.n : j])
            if self._prev[j] < 0:
                del self._latest[key]
            else:
                self._latest[key] = self._prev[j]
        del self.tokens[length:]
        del self._prev[length:]


class TokenStore:
    """Per request, the tokens a drafter holds (prompt, output so far, and its last drafts, which
    the next call rolls back), and, for lookups of min_n..max_n tokens, their `SuffixIndex`."""

    def __init__(self, min_n: int | None = None, max_n: int | None = None) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._tokens: dict[str, list[int]] = {}
        self._index: dict[str, SuffixIndex] = {}
        self._same: dict[str, int] = {}  # request -> its leading tokens unchanged since its index last synced

    def __len__(self) -> int:
        return len(self._tokens)

    def __getitem__(self, request_id: str) -> list[int]:
        return self._tokens[request_id]

    def length(self, request_id: str) -> int:
        return len(self._tokens.get(request_id, ()))

    def rewrite(self, request_id: str, start: int, tokens: list[int]) -> list[int]:
        """The request's tokens from `start` on become `tokens` -> its whole list (read only)."""
        seq = self._tokens.setdefault(request_id, [])
        del seq[start:]
        seq.extend(tokens)
        self._same[request_id] = min(self._same.get(request_id, start), start)
        return seq

    def check(self, rows: list[RowInput]) -> None:
        """Raise CacheMiss for the first row that starts past the tokens its request holds (every
        row is checked before a call changes any)."""
        for row in rows:
            if row.start > self.length(row.request_id):
                raise CacheMiss(row.request_id, self.length(row.request_id), row.start)

    def hold(self, rows: list[RowInput]) -> None:
        """A prefill: every row checked first (`check`: nothing changes on a miss), then each
        request's tokens kept from the row's start on, and indexed (~0.3 µs a token, with the
        prefill rather than in the first decode step)."""
        self.check(rows)
        for row in rows:
            self.rewrite(row.request_id, row.start, row.tokens)
            if self.min_n is not None:
                self._synced(row.request_id)

    def free(self, request_id: str) -> None:
        for held in (self._tokens, self._index, self._same):
            held.pop(request_id, None)

    def find(self, request_id: str) -> int | None:
        """Where the continuation of the best earlier match of the request's suffix starts (an
        index below its length), or None: the longest match of min_n..max_n tokens among the
        CANDIDATES most recent occurrences of its last min_n, the most recent of equals."""
        seq = self._tokens.get(request_id, [])
        cap = min(self.max_n, len(seq) - 1)
        if cap < self.min_n:
            return None
        index = self._synced(request_id)
        best, found, last = 0, None, len(seq) - 1
        for count, j in enumerate(index.occurrences()):
            if count == CANDIDATES:
                break
            k = self.min_n
            while k < cap and j - 1 - k >= 0 and seq[j - 1 - k] == seq[last - k]:
                k += 1
            if k > best:
                best, found = k, j
                if k == cap:
                    break
        return found

    def _synced(self, request_id: str) -> SuffixIndex:
        """The request's index, brought up to its tokens."""
        index = self._index.setdefault(request_id, SuffixIndex(self.min_n))
        seq = self._tokens[request_id]
        index.sync(seq, self._same.get(request_id, 0))
        self._same[request_id] = len(seq)
        return index
