"""Proposers: whatever guesses the next tokens for the target to verify.

A proposer gets, per row, the tokens it has not seen yet (a `RowInput`) and returns `num_tokens`
draft tokens per row in the *target's* vocabulary, plus, when any row samples, the exact
distributions q they were drawn from. Random numbers come from the caller (one uniform per draft
token per row), so a proposer is a deterministic function and the caller owns each request's
random stream.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .model_runner import ModelRunner, RowInput
from .sampling import BatchSampling, logits_to_probs, sample_with_uniforms


@dataclass(frozen=True)
class Proposal:
    tokens: torch.Tensor  # [B, G] int64 target-vocabulary ids
    probs: torch.Tensor | None  # [B, G, V] float32 q of each draft token; None when every row is greedy
    forwards: tuple[tuple[int, float], ...] = ()  # (tokens, seconds) of each model forward it took

    @property
    def seconds(self) -> float:
        return sum(s for _, s in self.forwards)


class Proposer(Protocol):
    def propose(
        self, rows: list[RowInput], num_tokens: int, sampling: BatchSampling, uniforms: torch.Tensor | None
    ) -> Proposal: ...

    def free(self, request_id: str) -> None: ...

    def valid_length(self, request_id: str) -> int: ...


class DraftModelProposer:
    """A smaller causal LM that shares the target's tokenizer, with its own KV cache slots.

    Per call: rows with a long backlog (a new prompt, or a lag after speculation was off) are first
    prefilled up to their last token; then one forward per draft position. After the call a row's
    cache holds its tokens plus its first G-1 drafts.
    """

    def __init__(self, model: torch.nn.Module, vocab_size: int, max_positions: int | None = None) -> None:
        self.runner = ModelRunner(model, max_positions)
        self.vocab_size = vocab_size  # V, the target's

    def free(self, request_id: str) -> None:
        self.runner.free(request_id)

    def valid_length(self, request_id: str) -> int:
        return self.runner.valid_length(request_id)

    def propose(
        self, rows: list[RowInput], num_tokens: int, sampling: BatchSampling, uniforms: torch.Tensor | None
    ) -> Proposal:
        """rows: B rows; uniforms [B, G] (G = num_tokens) or None when all greedy -> Proposal."""
        self.runner.check(rows)
        self.runner.take_forward_log()
        backlog = [RowInput(r.request_id, r.start, r.tokens[:-1]) for r in rows if len(r.tokens) > 2]
        if backlog:
            self.runner.forward(backlog, logits="none")
            rows = [RowInput(r.request_id, r.start + len(r.tokens) - 1, r.tokens[-1:]) if len(r.tokens) > 2 else r
                    for r in rows]
        sampling = sampling.to(self.runner.device)
        tokens, probs = [], []
        for j in range(num_tokens):
            logits = self.runner.forward(rows, logits="last")  # [B, V']
            token, q = self._choose(logits, sampling, None if uniforms is None else uniforms[:, j])
            tokens.append(token)
            probs.append(q)
            if j + 1 < num_tokens:
                ids = token.tolist()
                rows = [RowInput(r.request_id, r.start + len(r.tokens), [t]) for r, t in zip(rows, ids)]
        draft_tokens = torch.stack(tokens, dim=1).cpu()  # [B, G]
        draft_probs = None if probs[0] is None else torch.stack(probs, dim=1)  # [B, G, V]
        return Proposal(draft_tokens, draft_probs, self.runner.take_forward_log())

    def _choose(
        self, logits: torch.Tensor, sampling: BatchSampling, uniforms: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits [B, V'] -> (target ids [B], q [B, V] or None when all rows are greedy)."""
        if sampling.all_greedy:
            if self.runner.token_map is None:
                logits = logits[:, : self.vocab_size]
            return self.runner.map_tokens(logits.argmax(-1)), None
        q = logits_to_probs(self._to_target_vocab(logits), sampling)  # [B, V]
        token = sample_with_uniforms(q, uniforms.to(q.device))
        greedy = sampling.temperature == 0
        token = torch.where(greedy, q.argmax(-1), token)
        return token, q

    def _to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, V'] in the draft's output space -> [B, V] over the target's vocabulary (-inf elsewhere)."""
        vocab = self.vocab_size
        if self.runner.token_map is not None:
            full = logits.new_full((logits.shape[0], vocab), float("-inf"))
            return full.index_copy_(1, self.runner.token_map.to(logits.device), logits)
        if logits.shape[-1] >= vocab:
            return logits[:, :vocab]
        pad = logits.new_full((logits.shape[0], vocab - logits.shape[-1]), float("-inf"))
        return torch.cat([logits, pad], dim=-1)
