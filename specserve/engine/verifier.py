"""The target side of a step: one forward over [last token + drafts] for every row, then the rule."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .grammar import GrammarBook, GrammarRows
from .model_runner import VERIFY_ROW_TOKENS, ForwardLog, ForwardTiming, ModelRunner, RowInput, catch_up
from .rejection import AcceptResult, greedy_accept, rejection_sample, rejection_sample_deterministic
from .sampling import BatchSampling, logits_to_probs, q_as_read, sample_with_uniforms


@dataclass(frozen=True)
class Verdict:
    num_accepted: list[int]  # per row, accepted draft tokens
    next_token: list[int]  # per row, the recovered or bonus token
    forwards: Sequence[ForwardTiming] = ()  # each model forward, prefill included
    draft_tokens: list[list[int]] | None = None  # [B][G] the drafts verified, copied back with the verdict
    # when some row asked (BatchSampling.logprobs): per row, the log-probability of each token the
    # row may emit this step (drafts 0..a-1, then the next token: [B][a + 1 <= G + 1]), and the k
    # likeliest alternatives at each ([B][a + 1][k] (token, logprob))
    logprobs: list[list[float]] | None = None
    top_logprobs: list[list[list[tuple[int, float]]]] | None = None
    # rows whose prompt's last chunk this verify computed (`first_tokens`), under prefix caching:
    # request id -> prompt tokens its cache has taken from shared blocks so far
    cached_tokens: dict[str, int] | None = None

    @property
    def seconds(self) -> float:
        return sum(f.seconds for f in self.forwards)


class TargetVerifier:
    def __init__(
        self, model: torch.nn.Module, max_model_len: int | None = None, execution: str = "auto",
        attention: str = "auto",
    ) -> None:
        """execution, attention: see ModelRunner."""
        self.runner = ModelRunner(model, max_model_len, execution, attention)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.grammar: GrammarBook | None = None  # the matchers of grammar rows (structured output), if served

    def free(self, request_id: str) -> None:
        self.runner.free(request_id)
        if self.grammar is not None:
            self.grammar.free(request_id)

    def valid_length(self, request_id: str) -> int:
        return self.runner.valid_length(request_id)

    @torch.no_grad()
    def prefill(self, rows: list[RowInput]) -> ForwardLog:
        """Cache rows' tokens (prompt chunks), computing no logits -> the forward's timing (a
        shared prefix is taken, not computed, with prefix caching: `runner.cached_tokens`)."""
        return self.runner.prefill(rows)

    @torch.no_grad()
    def verify(
        self,
        rows: list[RowInput],
        draft_tokens: torch.Tensor,
        draft_probs: torch.Tensor | None,
        num_draft: torch.Tensor,
        sampling: BatchSampling,
        accept_uniforms: torch.Tensor | None,
        final_uniforms: torch.Tensor | None,
    ) -> Verdict:
        """rows: each row's unseen tokens (ending with its last accepted token); draft_tokens [B, G]
        (G may be 0); draft_probs [B, G, V] (float32, or 16-bit as drawn: read normalised,
        `sampling.q_as_read`), or None when all rows are greedy or the drafts are
        deterministic (a one-hot q at each draft: `Proposal.deterministic`); num_draft [B] (g_b <= G);
        accept_uniforms [B, G], final_uniforms [B] (None when all rows greedy)."""
        self.runner.check(rows)
        width = int(num_draft.max()) if num_draft.numel() else 0  # num_draft lives on the host
        if width < draft_tokens.shape[1]:  # no row verifies the last positions: a narrower forward
            draft_tokens = draft_tokens[:, :width]
            draft_probs = None if draft_probs is None else draft_probs[:, :width]
            accept_uniforms = None if accept_uniforms is None else accept_uniforms[:, :width]
        self.runner.take_forward_log()
        drafts = draft_tokens.to(self.runner.device)  # [B, G]
        first = first_tokens(rows, num_draft)
        logits = self._logits(rows, drafts, first)[..., : self.vocab_size]  # [B, G+1, V]
        if sampling.processing is not None:  # penalties / bias, per position through the drafts
            logits = sampling.processing.apply(logits, drafts)
        if sampling.grammar is not None:  # each grammar row's mask, per position through the drafts
            logits = self._mask(logits, drafts, num_draft, sampling.grammar)
        result = self._accept(logits, drafts, draft_probs, num_draft, sampling, accept_uniforms, final_uniforms)
        # The step's one device-to-host copy: [B, 2 + G] = accepted count, next token, drafts.
        packed = torch.cat([result.num_accepted[:, None], result.next_token[:, None], drafts], dim=1).cpu()
        cached = {rows[b].request_id: self.runner.cached_tokens[rows[b].request_id] for b in first
                  if rows[b].request_id in self.runner.cached_tokens}
        verdict = Verdict(packed[:, 0].tolist(), packed[:, 1].tolist(), self.runner.take_forward_log(),
                          packed[:, 2:].tolist(), cached_tokens=cached or None)
        if sampling.logprobs is None:
            return verdict
        return token_logprobs(verdict, logits, drafts, result, sampling)

    def _logits(self, rows: list[RowInput], drafts: torch.Tensor, first: list[int]) -> torch.Tensor:
        """The target's logits at each row's last token and drafts, [B, G+1, V'] (a `first` row's:
        its prompt's last forward's at every position; it verifies no draft). Rows holding more
        than their last token (a lagging cache, resent rows) first catch up in a forward of their own."""
        folded = set(first)
        rest = [b for b in range(len(rows)) if b not in folded]
        width = 1 + drafts.shape[1]
        logits = None
        if rest:
            picked = rows if not first else [rows[b] for b in rest]
            backlog = [RowInput(r.request_id, r.start, r.tokens[:-1]) for r in picked
                       if catch_up(r.tokens, VERIFY_ROW_TOKENS)]
            if backlog:
                self.runner.forward(backlog, logits="none")
            step_rows = [RowInput(r.request_id, r.start + len(r.tokens) - 1, r.tokens[-1:]) for r in picked]
            tail = drafts if not first else drafts[torch.tensor(rest, device=drafts.device)]
            logits = self.runner.forward(step_rows, logits="all", tail=tail if width > 1 else None)  # [B', G+1, V']
            if not first:
                return logits
        prompt_last = self.runner.prefill_last([rows[b] for b in first])[:, None, :].expand(-1, width, -1)
        if logits is None:
            return prompt_last  # [B, G+1, V']
        out = logits.new_empty(len(rows), width, logits.shape[-1])
        out[torch.tensor(rest, device=out.device)] = logits
        out[torch.tensor(first, device=out.device)] = prompt_last
        return out

    def _mask(self, logits: torch.Tensor, drafts: torch.Tensor, num_draft: torch.Tensor,
              rows: GrammarRows) -> torch.Tensor:
        """logits [B, W, V] -> float32, -inf where a grammar row's grammar forbids the token after
        its committed output and drafts 0..j-1 (engine/grammar.py). Reads the drafts on the host:
        one more copy, in steps with a grammar row only."""
        if self.grammar is None:
            raise RuntimeError("a grammar row reached a verifier without a grammar book (no tokenizer given)")
        allowed = self.grammar.verify_masks(rows, drafts.tolist(), num_draft.tolist(), logits.shape[1],
                                            logits.device)  # [B, W, V]
        return logits.float().masked_fill(~allowed, float("-inf"))

    def _accept(self, logits, draft_tokens, draft_probs, num_draft, sampling, accept_uniforms, final_uniforms):
        device = logits.device
        draft_tokens, num_draft = draft_tokens.to(device), num_draft.to(device)
        if sampling.all_greedy:
            return greedy_accept(logits.argmax(-1), draft_tokens, num_draft)
        batch, width, vocab = logits.shape
        flags = sampling.flags()  # read on the host, where a step's sampling lives
        rows = sampling.to(device).repeat_rows(width)
        probs = logits_to_probs(logits.reshape(batch * width, vocab), rows, flags)
        probs = probs.view(batch, width, vocab)  # [B, G+1, V]
        final_uniforms = final_uniforms.to(device)
        if width == 1:
            token = sample_with_uniforms(probs[:, 0], final_uniforms)
            return AcceptResult(torch.zeros_like(token), token)
        if draft_probs is None:  # deterministic drafts: q is one-hot, never materialised
            return rejection_sample_deterministic(
                probs, draft_tokens, num_draft, accept_uniforms.to(device), final_uniforms)
        return rejection_sample(  # (a 16-bit q normalised: the distribution the draft drew from)
            probs, draft_tokens, q_as_read(draft_probs.to(device)), num_draft, accept_uniforms.to(device),
            final_uniforms)


def first_tokens(rows: list[RowInput], num_draft: torch.Tensor) -> list[int]:
    """The rows that carry a prompt's last chunk and verify no draft: a request's first step after
    chunked prefill (or with the prompt whole). One forward over the chunk, its last token
    included, gives their logits (`ModelRunner.prefill_last`), instead of a prefill forward and
    then a forward of the last token alone. num_draft [B] on the host."""
    counts = num_draft.tolist()
    return [b for b, (r, g) in enumerate(zip(rows, counts)) if g == 0 and len(r.tokens) > VERIFY_ROW_TOKENS]


def token_logprobs(verdict: Verdict, logits: torch.Tensor, drafts: torch.Tensor, result: AcceptResult,
                   sampling: BatchSampling) -> Verdict:
    """The verdict with the log-probabilities of each row's emitted tokens (drafts 0..a-1 and the
    next token) and their k likeliest alternatives (k = sampling.logprobs), from the processed
    logits [B, W, V] at each row's temperature (1 for greedy rows), before top-k / top-p: the
    distribution the rule samples from. One more device-to-host copy, only when a row asked."""
    batch, width, _ = logits.shape
    temperature = sampling.temperature.to(logits.device)
    scale = torch.where(temperature == 0, torch.ones_like(temperature), temperature)  # [B]
    logp = torch.log_softmax(logits.float() / scale[:, None, None], dim=-1)  # [B, W, V]
    emitted = torch.cat([drafts[:, : width - 1], drafts.new_zeros(batch, 1)], dim=1)  # [B, W]
    emitted = emitted.scatter(1, result.num_accepted[:, None], result.next_token[:, None])
    chosen = logp.gather(-1, emitted[..., None])  # [B, W, 1]
    k = sampling.logprobs
    top = logp.topk(k, dim=-1) if k else None
    parts = [chosen.double()] + ([top.values.double(), top.indices.double()] if top is not None else [])
    host = torch.cat(parts, dim=-1).cpu()  # [B, W, 1 + 2k]: float64 holds every token id exactly
    ends = [a + 1 for a in verdict.num_accepted]
    logprobs = [host[b, : ends[b], 0].tolist() for b in range(batch)]
    tops = [[list(zip(map(int, host[b, j, 1 + k:].tolist()), host[b, j, 1 : 1 + k].tolist()))
             for j in range(ends[b])] for b in range(batch)]
    return dataclasses.replace(verdict, logprobs=logprobs, top_logprobs=tops)


PROMPT_LOGPROBS_CHUNK = 256  # positions projected onto the vocabulary at a time (never [L, V] at once)


@torch.no_grad()
def prompt_logprobs(model: torch.nn.Module, tokens: list[int], k: int, vocab_size: int | None = None,
                    chunk: int = PROMPT_LOGPROBS_CHUNK) -> list[tuple[float, list[tuple[int, float]]] | None]:
    """Each prompt token's log-probability under the raw model given the tokens before it, and the
    k likeliest alternatives there; None for the first token (nothing precedes it). One forward of
    the decoder (no KV cache touched), then the output head over `chunk` positions at a time."""
    device = model.get_output_embeddings().weight.device
    hidden = model.base_model(input_ids=torch.tensor([tokens], device=device)).last_hidden_state[0]  # [L, H]
    head = model.get_output_embeddings()
    ids = torch.tensor(tokens[1:], device=hidden.device)  # [L-1] each position's next token
    out: list = [None]
    for begin in range(0, len(tokens) - 1, chunk):
        logits = head(hidden[begin : begin + chunk]).float()  # [c, V']
        logp = torch.log_softmax(logits[:, :vocab_size] if vocab_size else logits, dim=-1)  # [c, V]
        chosen = logp.gather(1, ids[begin : begin + chunk, None])[:, 0].tolist()
        top = logp.topk(k, dim=-1) if k else None
        alternatives = ([list(zip(i, v)) for i, v in zip(top.indices.tolist(), top.values.tolist())]
                        if top is not None else [[] for _ in chosen])
        out += [(value, alts) for value, alts in zip(chosen, alternatives)]
    return out
