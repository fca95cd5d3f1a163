"""Predicted outputs: a request's own guess of its output, drafted where the output follows it.

A client that knows most of the answer (an edited file, a rewritten paragraph) sends it with the
request (OpenAI's `prediction`). Each step, `Prediction.continuation` finds where the output so far
ends in the predicted tokens and returns what follows there; the step then drafts those tokens
first, whatever the drafter would have proposed (`forced`, below), and the drafter drafts on after
them. The target verifies them like any drafts, so the output is the one it would be without a
prediction: a wrong prediction costs rejected drafts, never a different token.

Where the output is in the prediction: at the start, the prediction's start. Later, the end of the
longest match of the output's last tokens (at most `MAX_MATCH`) in the prediction, measured from
the last strong alignment (a match of two tokens or more: `at`). A match of one token counts only
shortly after it: the output has gone at most `NEAR` tokens past it, and the match lies at most
that far plus `NEAR` past `at` (the output resumes the prediction after an edit of a few tokens);
anywhere else it takes two (a common token alone says nothing). Among equal matches, the first at
or after `at` (the output moves forward through the prediction), else the closest before it; first
of all, `at` plus the tokens since, when the output's last `MAX_MATCH` match there. The choice
depends only on the output so far, so a forced draft is a deterministic proposal: its q is one-hot
and the rejection rule stays exact for sampled rows (docs/drafters.md, "Predicted outputs").
"""
from __future__ import annotations

import bisect

import torch

MAX_MATCH = 8  # the longest suffix of the output compared with the prediction
NEAR = 8  # how far past the last alignment a one-token match still counts
CANDIDATES = 64  # occurrences of the output's last two tokens compared, the closest to the last alignment first


class Prediction:
    """One request's predicted tokens, indexed by their bigrams, and where its output was last
    found in them (`at`, by a strong match). One per request: `at` moves with its output."""

    def __init__(self, tokens: tuple[int, ...]) -> None:
        self.tokens = tokens
        self.at = 0  # the prediction position the output's end was last aligned to
        # the last predicted run had a draft rejected: the next one drafts no more than the
        # batch's γ (a long run is worth its verify cost only while the output keeps following)
        self.missed = False
        self._length = 0  # the output's length then
        self._pairs: dict[tuple[int, int], list[int]] = {}  # bigram -> its ends j (tokens[j-2:j]), ascending
        self._singles: dict[int, list[int]] = {}  # token -> its ends j (tokens[j-1] == token), ascending
        for j in range(1, len(tokens) + 1):
            self._singles.setdefault(tokens[j - 1], []).append(j)
            if j >= 2:
                self._pairs.setdefault((tokens[j - 2], tokens[j - 1]), []).append(j)

    def continuation(self, output: list[int], limit: int) -> list[int]:
        """At most `limit` predicted tokens that would follow `output` (the request's output so
        far); [] where the output is not found in the prediction or has reached its end."""
        if limit <= 0 or not self.tokens:
            return []
        found = self._align(output)
        if found is None:
            return []
        end, strong = found
        if strong:
            self.at, self._length = end, len(output)
        return list(self.tokens[end : end + limit])

    def _align(self, output: list[int]) -> tuple[int, bool] | None:
        """(the prediction position output's end is at: `tokens[:end]` ends like output, whether the
        match is a strong one: two tokens or more), or None."""
        if not output:
            return 0, True
        ahead = self.at + len(output) - self._length  # where it is if it went on with the prediction
        if ahead <= len(self.tokens) and self._match_length(output, ahead) >= min(MAX_MATCH, len(output)):
            return ahead, True
        since = len(output) - self._length  # tokens since the last strong alignment
        best, best_key = None, None
        for end in self._candidates(output):
            length = self._match_length(output, end)
            if length < 2 and not (since <= NEAR and self.at <= end <= self.at + since + NEAR):
                continue
            # longer first; then forward of `at` before behind it, the closest first
            key = (-length, end < self.at, abs(end - self.at))
            if best_key is None or key < best_key:
                best, best_key = end, key
        return None if best is None else (best, -best_key[0] >= 2)

    def _candidates(self, output: list[int]) -> list[int]:
        """Ends where the output's last token (within NEAR of `at`) or last two tokens occur."""
        singles = self._singles.get(output[-1], [])
        lo = bisect.bisect_left(singles, self.at)
        near = singles[lo : bisect.bisect_right(singles, self.at + len(output) - self._length + NEAR)]
        if len(output) < 2:
            return near
        pairs = self._pairs.get((output[-2], output[-1]), [])
        i = bisect.bisect_left(pairs, self.at)  # the CANDIDATES closest to `at`, from both sides
        return near + pairs[max(0, i - CANDIDATES // 2) : i + CANDIDATES // 2]

    def _match_length(self, output: list[int], end: int) -> int:
        """How many of output's last tokens (at most MAX_MATCH) equal the prediction's before
        `end`; a match reaching back to both starts counts as the longest (the output began as
        the prediction does)."""
        n = 0
        while n < MAX_MATCH and n < len(output) and n < end and output[-1 - n] == self.tokens[end - 1 - n]:
            n += 1
        return MAX_MATCH if n == len(output) == end else n


def forced_drafts(runs: list[list[int]], width: int) -> torch.Tensor | None:
    """Each row's predicted run (at most `width` tokens; [] for none) -> [B, width] int64 on the
    host: run tokens first, -1 (the drafter's own choice) after them; None where no row has one."""
    if not any(runs):
        return None
    forced = torch.full((len(runs), width), -1, dtype=torch.long)
    for b, run in enumerate(runs):
        if run:
            forced[b, : len(run)] = torch.tensor(run[:width], dtype=torch.long)
    return forced


def apply_forced(token: torch.Tensor, q: torch.Tensor | None, forced: torch.Tensor | None):
    """Draft position j's choice: token [B'] (and q [B', V] or None) -> the same with each row
    that has a forced token there (forced [B'] int64, -1: none) taking it, its q one-hot at it.
    Device ops only (a captured loop runs them at fixed shapes)."""
    if forced is None:
        return token, q
    on = forced >= 0  # [B']
    token = torch.where(on, forced, token)
    if q is not None:
        hot = torch.zeros_like(q).scatter_(-1, token[:, None], 1.0)  # [B', V]
        q = torch.where(on[:, None], hot, q)
    return token, q


def forced_runs(forced: torch.Tensor | None) -> dict[int, list[int]]:
    """forced [B, G] (host, as `forced_drafts` makes it) -> row -> its run of forced tokens, for the
    rows that have one (drafters that draft on the host: prompt lookup, a feature head's lookup rows)."""
    if forced is None:
        return {}
    runs = {}
    for b, row in enumerate(forced.tolist()):
        run = row[: row.index(-1)] if -1 in row else row
        if run:
            runs[b] = run
    return runs


def pad_run(run: list[int], num_tokens: int) -> list[int]:
    """A forced run as a row's num_tokens drafts: its last token repeated past its end (drafts that
    the row's count keeps from being verified)."""
    return (run + run[-1:] * num_tokens)[:num_tokens]
