"""Logit processing that depends on the tokens before each position: penalties, bias, bans, min_tokens.

OpenAI's `presence_penalty` and `frequency_penalty`, the `repetition_penalty` extension (as in HF
and vLLM), `logit_bias`, and vLLM's `allowed_token_ids`, `bad_words` and `min_tokens` (no stop
token before that many output tokens) change the target's distribution at every position as a
function of the tokens already there. Inside a verified block the tokens before position j are the
row's output so far *plus drafts 0..j-1*, so the counts must advance through the drafts, and with
them fall back to the committed tokens once the verdict rejects some: computed per position here
from the committed tokens (host lists, sent with the step) and the block's drafts (device), nothing
kept between steps, so a rejected draft leaves no trace. The rejection rule then needs only p exact
(`TargetVerifier._accept` applies this before argmax / softmax); the draft proposes from its own
unprocessed q, which the rule corrects for (it only costs acceptance).

Per row and position j, in this order, on float32 logits [V]:
  + logit_bias[v]                                            (OpenAI: added to the logits)
  -inf at every token outside allowed_token_ids, when the row lists them
  repetition r != 1, seen = prompt + output + drafts before j:  l > 0: l / r, else l * r   (HF's rule)
  - frequency * count_j[v] - presence * (count_j[v] > 0), count over output + drafts before j (OpenAI)
  -inf at the row's stop ids (EOS unless ignore_eos, stop_token_ids) while len(output) + j < min_tokens
  -inf at a bad word's last token where output + drafts before j end with the rest of it (its
    first token alone, for a one-token word, everywhere). Matching needs the drafts on the host:
    one more device-to-host copy, in steps with such a row only (as a grammar row's masks)

A step without any such row carries `processing = None` and pays nothing (a min_tokens row stops
asking once its output holds min_tokens tokens). A row with processing
sends its output (or prompt + output, for the repetition penalty) with every step and has its
counts rebuilt on the device each time: O(output length) per step, fine for chat-length answers;
counts kept per request on the target worker (rebuilt on a cache miss) would make long
penalised generations cheaper.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LogitsProcessing:
    """The per-row processing of one step's B rows, as host lists (pickled with the step)."""

    presence: list[float]  # [B]
    frequency: list[float]  # [B]
    repetition: list[float]  # [B]; 1 = off
    bias: list[tuple[tuple[int, float], ...]]  # [B] (token, added logit) pairs
    generated: list[list[int]]  # [B] each row's output tokens so far
    context: list[list[int]] | None  # [B] prompt + output, when some row has a repetition penalty
    min_left: list[int] | None = None  # [B] output tokens before a stop id may come (None: 0 in every row)
    stops: list[tuple[int, ...]] | None = None  # [B] the stop ids held back (with min_left)
    allowed: list[tuple[int, ...] | None] | None = None  # [B] the only ids a row may generate (None: any)
    bad_words: list[tuple[tuple[int, ...], ...]] | None = None  # [B] token sequences never generated
    recent: list[list[int]] | None = None  # [B] each row's last output tokens, as many as its longest bad word - 1

    @staticmethod
    def of(seqs: Sequence) -> "LogitsProcessing | None":
        """For these sequences (anything with `.params`, `.output`, `.prompt`, `.stop_ids`); None
        when no row asks for any processing."""
        params = [s.params for s in seqs]
        held = [max(p.min_tokens - len(s.output), 0) for s, p in zip(seqs, params)]
        if not any(p.processed for p in params) and not any(held):
            return None
        repeat = any(p.repetition_penalty != 1.0 for p in params)
        return LogitsProcessing(
            [p.presence_penalty for p in params], [p.frequency_penalty for p in params],
            [p.repetition_penalty for p in params], [p.logit_bias for p in params],
            [list(s.output) if p.presence_penalty or p.frequency_penalty else [] for s, p in zip(seqs, params)],
            [list(s.prompt) + list(s.output) if p.repetition_penalty != 1.0 else [] for s, p in zip(seqs, params)]
            if repeat else None,
            held if any(held) else None,
            [tuple(sorted(s.stop_ids)) if h else () for s, h in zip(seqs, held)] if any(held) else None,
            [p.allowed_token_ids for p in params] if any(p.allowed_token_ids is not None for p in params) else None,
            *_bad_words(seqs))

    def select(self, rows: list[int]) -> "LogitsProcessing":
        """These rows only (caller indices)."""
        pick = lambda values: None if values is None else [values[b] for b in rows]  # noqa: E731
        return LogitsProcessing(pick(self.presence), pick(self.frequency), pick(self.repetition), pick(self.bias),
                                pick(self.generated), pick(self.context), pick(self.min_left), pick(self.stops),
                                pick(self.allowed), pick(self.bad_words), pick(self.recent))

    def apply(self, logits: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """logits [B, W, V] (position j follows drafts 0..j-1), drafts [B, >= W-1] -> processed
        float32 logits [B, W, V]."""
        batch, width, vocab = logits.shape
        device = logits.device
        logits = logits.float()
        bias = self._bias(batch, vocab, device)
        if bias is not None:
            logits = logits + bias[:, None]
        if self.allowed is not None:
            logits = logits.masked_fill(~self._allowed(batch, vocab, device)[:, None], float("-inf"))
        before = _drafts_before(drafts[:, : width - 1], width, vocab, device)  # [B, W, V]
        if self.context is not None:
            seen = (_counts(self.context, vocab, device)[:, None] + before) > 0  # [B, W, V]
            r = torch.tensor(self.repetition, device=device)[:, None, None]  # [B, 1, 1]
            logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
        if any(self.presence) or any(self.frequency):
            counts = _counts(self.generated, vocab, device)[:, None] + before  # [B, W, V]
            frequency = torch.tensor(self.frequency, device=device)[:, None, None]
            presence = torch.tensor(self.presence, device=device)[:, None, None]
            logits = logits - frequency * counts - presence * (counts > 0).float()
        if self.min_left is not None:
            logits = logits.masked_fill(self._held_back(batch, width, vocab, device), float("-inf"))
        if self.bad_words is not None:
            logits = logits.masked_fill(self._bad(drafts[:, : width - 1].tolist(), width, vocab, device), float("-inf"))
        return logits

    def _bad(self, drafts: list[list[int]], width: int, vocab: int, device) -> torch.Tensor:
        """[B, W, V] bool: at position j, the last token of each bad word whose other tokens end
        the row's output followed by drafts 0..j-1 (drafts [B, W-1] on the host)."""
        banned = []  # (row, position, token)
        for b, words in enumerate(self.bad_words):
            for j in range(width):
                before = self.recent[b] + drafts[b][:j]
                for word in words:
                    head = word[:-1]
                    if word[-1] < vocab and (not head or before[len(before) - len(head):] == list(head)):
                        banned.append((b, j, word[-1]))
        return _mask((len(self.bad_words), width, vocab), banned, device)

    def _allowed(self, batch: int, vocab: int, device) -> torch.Tensor:
        """[B, V] bool: the tokens each row may generate (every one in a row without a list)."""
        listed = [(b, t) for b, ids in enumerate(self.allowed) if ids is not None for t in ids if t < vocab]
        allowed = _mask((batch, vocab), listed, device)
        free = [b for b, ids in enumerate(self.allowed) if ids is None]
        allowed[torch.tensor(free, dtype=torch.long, device=device)] = True
        return allowed

    def _held_back(self, batch: int, width: int, vocab: int, device) -> torch.Tensor:
        """[B, W, V] bool: a row's stop ids at the positions before its min_tokens-th output token."""
        held = [(b, j, t) for b, (left, ids) in enumerate(zip(self.min_left, self.stops))
                for j in range(min(left, width)) for t in ids if t < vocab]
        return _mask((batch, width, vocab), held, device)

    def _bias(self, batch: int, vocab: int, device) -> torch.Tensor | None:
        """[B, V] the rows' logit biases (None when no row has any)."""
        entries = [(b, token, value) for b, pairs in enumerate(self.bias) for token, value in pairs]
        if not entries:
            return None
        rows, tokens, values = zip(*entries)
        bias = torch.zeros(batch, vocab, device=device)
        bias[torch.tensor(rows, device=device), torch.tensor(tokens, device=device)] = torch.tensor(
            values, device=device)
        return bias


def _mask(shape: tuple[int, ...], entries: list[tuple[int, ...]], device) -> torch.Tensor:
    """A bool tensor of `shape` on the device, True at each entry (an index per dimension): only
    the indices cross, not a [B, W, V] mask built on the host."""
    out = torch.zeros(shape, dtype=torch.bool, device=device)
    if entries:
        out[tuple(torch.tensor(entries, dtype=torch.long).T.to(device))] = True
    return out


def _bad_words(seqs: Sequence) -> tuple[list | None, list | None]:
    """(each row's bad words, each row's output tail as long as its longest word - 1), or (None,
    None) when no row has any."""
    if not any(s.params.bad_words_ids for s in seqs):
        return None, None
    tails = []
    for s in seqs:
        longest = max((len(w) for w in s.params.bad_words_ids), default=1)
        tails.append(list(s.output[len(s.output) - (longest - 1):]) if longest > 1 else [])
    return [s.params.bad_words_ids for s in seqs], tails


def _counts(token_lists: list[list[int]], vocab: int, device) -> torch.Tensor:
    """[B] lists of token ids -> [B, V] float32 occurrence counts."""
    width = max((len(t) for t in token_lists), default=0)
    padded = torch.full((len(token_lists), width + 1), vocab, dtype=torch.long)  # vocab: a spare column
    for b, tokens in enumerate(token_lists):
        padded[b, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    counts.scatter_add_(1, padded.to(device), torch.ones(padded.shape, device=device))
    return counts[:, :vocab]


def _drafts_before(drafts: torch.Tensor, width: int, vocab: int, device) -> torch.Tensor:
    """drafts [B, W-1] -> [B, W, V] float32: at position j, the count of each token among drafts 0..j-1."""
    batch = drafts.shape[0]
    step = torch.zeros(batch, width, vocab, device=device)
    if width > 1:
        step[:, 1:].scatter_(2, drafts.to(device).long().clamp(0, vocab - 1)[..., None], 1.0)  # (junk past g_b)
    return step.cumsum(dim=1)
