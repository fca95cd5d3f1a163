"""Drafting from earlier answers: the answers of requests this engine finished, searched for a
running request's latest tokens (retrieval drafting, as REST and suffix decoding do).

Agents, tool loops and templated jobs send the same structures again and again: a JSON object of
one schema, a function call, the same edit to another file. Where the latest tokens of a request
occurred in a finished one, what followed there is a likely continuation, and no model has to
guess it. `History` keeps finished requests' answers, each after the last `MAX_MATCH` tokens of
its prompt (what leads to it: a prompt asked again finds its answer from the first token), up to
a budget, oldest out first, indexed by their `min_match`-grams (~2 µs a token, as a request
finishes; a lookup ~1.5 µs, ~30 µs where an n-gram's 32 latest occurrences are all compared).
A step asks it for each row that may draft from it (`Recall`): the earlier occurrence whose
match with the row's latest tokens is longest (at least `min_match`, at most `MAX_MATCH`; the most
recent of equals, among the `CANDIDATES` most recent occurrences) gives what followed it, up to
the step's limit and the end of that request.

The step drafts such a run first, as it drafts a request's own prediction (engine/prediction.py),
and the drafter drafts on after it. The target verifies it like any draft, so the output is the
target's own: a wrong recall costs rejected drafts, never a different token. The run is a
deterministic proposal (its q one-hot), so sampled rows keep the exact rule. A seeded sampled
request never recalls: its drafts, and with them its tokens, would depend on what other requests
said before it, where the seed promises they depend on its own tokens only.

What other requests said can be timed through this (a request that repeats another's answer is
answered faster), as with any cache shared between requests: it is off unless configured.
"""
from __future__ import annotations

from collections import OrderedDict

MAX_MATCH = 32  # the longest suffix of a row compared with an earlier occurrence
CANDIDATES = 32  # occurrences of a row's last min_match tokens compared, the most recent first


class History:
    """Finished requests' answers (each after its prompt's last tokens), up to `max_tokens` tokens
    of them (the oldest requests dropped first), and where each `min_match`-gram of them ends."""

    def __init__(self, max_tokens: int, min_match: int = 8) -> None:
        if max_tokens < 1 or not 1 <= min_match <= MAX_MATCH:
            raise ValueError(f"need max_tokens >= 1 and 1 <= min_match <= {MAX_MATCH}, "
                             f"got {max_tokens}, {min_match}")
        self.max_tokens, self.min_match = max_tokens, min_match
        self._requests: OrderedDict[int, tuple[int, ...]] = OrderedDict()  # kept id -> its tokens, oldest first
        self._ends: dict[int, list[tuple[int, int]]] = {}  # hash of an n-gram -> (kept id, end j), oldest first
        self._next = 0  # the next kept id
        self._held = 0  # tokens of the kept requests
        self._stale = 0  # index entries of dropped requests (rebuilt away once they outnumber the rest)
        self.num_lookups = 0  # rows asked for, and how many found a run
        self.num_found = 0

    def __len__(self) -> int:
        return len(self._requests)

    @property
    def held_tokens(self) -> int:
        return self._held

    def reset_counts(self) -> None:
        """Zero the lookup counters (a stats reset); what it holds stays."""
        self.num_lookups = self.num_found = 0

    def clear(self) -> None:
        """Forget every request kept."""
        self._requests.clear()
        self._ends, self._held, self._stale = {}, 0, 0

    def add(self, tokens: list[int]) -> None:
        """A finished request's tokens (its answer after its prompt's last tokens); one longer than
        the budget keeps its end."""
        if len(tokens) <= self.min_match:
            return
        kept = tuple(tokens[-self.max_tokens:])
        key = self._next
        self._next += 1
        self._index(key, kept)
        self._requests[key] = kept
        self._held += len(kept)
        while self._held > self.max_tokens:
            _, dropped = self._requests.popitem(last=False)
            self._held -= len(dropped)
            self._stale += len(dropped) - self.min_match
        if self._stale > self._held:
            self._rebuild()

    def continuation(self, tail: list[int], limit: int) -> list[int]:
        """At most `limit` tokens that followed the best earlier occurrence of `tail`'s end (a
        row's latest tokens, at least its last MAX_MATCH); [] where none matches min_match."""
        n = self.min_match
        if limit <= 0 or len(tail) < n:
            return []
        self.num_lookups += 1
        best, best_length = None, 0
        occurrences = self._ends.get(hash(tuple(tail[-n:])), ())
        for count, (key, end) in enumerate(reversed(occurrences)):
            if count == CANDIDATES:
                break
            tokens = self._requests.get(key)
            length = 0 if tokens is None else _match_length(tokens, end, tail)
            if length >= n and length > best_length:  # (a hash collision matches less than n)
                best, best_length = (tokens, end), length
                if length == MAX_MATCH:
                    break
        if best is None:
            return []
        self.num_found += 1
        tokens, end = best
        return list(tokens[end : end + limit])

    def _index(self, key: int, tokens: tuple[int, ...]) -> None:
        """Every end j of an n-gram of tokens with a token after it (j < len)."""
        n = self.min_match
        for j in range(n, len(tokens)):
            self._ends.setdefault(hash(tokens[j - n : j]), []).append((key, j))

    def _rebuild(self) -> None:
        self._ends, self._stale = {}, 0
        for key, tokens in self._requests.items():
            self._index(key, tokens)


def _match_length(tokens: tuple[int, ...], end: int, tail: list[int]) -> int:
    """How many of tail's last tokens (at most MAX_MATCH) equal tokens[:end]'s last."""
    k = 0
    while k < MAX_MATCH and k < end and k < len(tail) and tokens[end - 1 - k] == tail[-1 - k]:
        k += 1
    return k


class Recall:
    """One request's use of the history: runs after its latest tokens, and whether the last one
    had a draft rejected (`missed`: the next run then drafts no more than the step's γ, as a
    prediction's does)."""

    def __init__(self, history: History) -> None:
        self.history = history
        self.missed = False

    def continuation(self, tail: list[int], limit: int) -> list[int]:
        return self.history.continuation(tail, limit)
