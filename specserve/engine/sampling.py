"""Sampling parameters and the pure maths that turns logits into a distribution.

Everything here is a function of its arguments: no model, no cache, no global random state.
Temperature, min-p, top-k and top-p are applied to the target's and the draft's logits by the very
same function (`logits_to_probs`). The rejection rule in `rejection.py` is exact for any q the
draft really drew from; the same filters make q close to p, which is what acceptance needs.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .grammar import Grammar, GrammarRows
    from .processing import LogitsProcessing


GREEDY_BELOW = 1e-5  # a temperature below this decodes greedily (see SamplingParams)
MAX_PREDICTION_TOKENS = 32768  # the longest prediction a request may send (its index costs ~100 bytes a token)
MAX_LOGPROBS = 20  # the most alternatives a token's log-probabilities may list (OpenAI's top_logprobs limit)


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded.

    temperature 0 means greedy, and so does any temperature below GREEDY_BELOW (logits / T would
    overflow float32 there, and the distribution is one-hot to within rounding anyway); top_k 0 means
    off; top_p 1 means off; min_p 0 means off. A request with a seed draws
    every random number from its own generator, so its tokens do not depend on what else is in the
    batch. stop_token_ids end the request (the stop token is kept in the output ids); the model's
    EOS does too unless ignore_eos.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0  # drop tokens less likely than min_p x the likeliest (after temperature; vLLM's, HF's)
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    # processing that depends on the tokens so far (specserve.engine.processing)
    presence_penalty: float = 0.0  # OpenAI's, in [-2, 2]
    frequency_penalty: float = 0.0  # OpenAI's, in [-2, 2]
    repetition_penalty: float = 1.0  # HF's / vLLM's, > 0 (1 = off)
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)  # (token, added logit in [-100, 100])
    min_tokens: int = 0  # no stop id (EOS, stop_token_ids) before this many output tokens (vLLM's)
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be generated (vLLM's; None: any)
    # token sequences never generated: a sequence's last token is forbidden wherever the output
    # (drafts included) ends with the rest of it (vLLM's `bad_words`, as token ids)
    bad_words_ids: tuple[tuple[int, ...], ...] = field(default_factory=tuple)
    # None: no log-probabilities; k >= 0: each generated token's, and the k likeliest alternatives'
    # (the verifier's `token_logprobs`: the processed target distribution at the row's temperature)
    logprobs: int | None = None
    # structured output: the grammar every generated token must follow (specserve.engine.grammar)
    grammar: Grammar | None = None
    # predicted output (OpenAI's `prediction`): tokens the output is expected to repeat, drafted
    # where it does (specserve.engine.prediction); never changes a token
    prediction: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (self.temperature >= 0.0) or self.temperature == float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not 0.0 < self.repetition_penalty < float("inf"):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        bias = tuple(sorted((int(t), float(v)) for t, v in dict(self.logit_bias).items()))
        if any(t < 0 or not -100.0 <= v <= 100.0 for t, v in bias):
            raise ValueError("logit_bias maps token ids >= 0 to values in [-100, 100]")
        object.__setattr__(self, "logit_bias", bias)
        if self.allowed_token_ids is not None:
            allowed = tuple(sorted({int(t) for t in self.allowed_token_ids}))
            if not allowed or allowed[0] < 0:
                raise ValueError("allowed_token_ids must list at least one token id >= 0")
            if self.grammar is not None:
                raise ValueError("allowed_token_ids cannot be combined with a grammar (it decides the tokens)")
            object.__setattr__(self, "allowed_token_ids", allowed)
        bad = tuple(dict.fromkeys(tuple(int(t) for t in words) for words in self.bad_words_ids))
        if any(not words or min(words) < 0 for words in bad):
            raise ValueError("bad_words_ids must be non-empty sequences of token ids >= 0")
        if bad and self.grammar is not None:
            raise ValueError("bad_words (bad_words_ids) cannot be combined with a grammar (it decides the tokens)")
        object.__setattr__(self, "bad_words_ids", bad)
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        if self.min_tokens and self.grammar is not None:
            raise ValueError("min_tokens cannot be combined with a grammar (structured output decides where it ends)")
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.prediction is not None:
            prediction = tuple(int(t) for t in self.prediction)
            if prediction and min(prediction) < 0:
                raise ValueError("prediction token ids must be >= 0")
            if len(prediction) > MAX_PREDICTION_TOKENS:
                raise ValueError(f"a prediction holds at most {MAX_PREDICTION_TOKENS} tokens, got {len(prediction)}")
            object.__setattr__(self, "prediction", prediction or None)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processed(self) -> bool:
        """Whether penalties or a logit bias change the target's logits (LogitsProcessing)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.allowed_token_ids is not None or bool(self.bad_words_ids))


@dataclass(frozen=True)
class BatchSampling:
    """Per-row sampling parameters of a batch, as tensors (one row per request)."""

    temperature: torch.Tensor  # [B] float32; 0 = greedy
    top_k: torch.Tensor  # [B] int64; 0 = off
    top_p: torch.Tensor  # [B] float32; 1 = off
    # penalties / logit bias of the target's logits (the verifier applies them; drafts never do)
    processing: LogitsProcessing | None = None
    # the most alternatives any row wants with its tokens' log-probabilities (None: no row wants any)
    logprobs: int | None = None
    # the rows' grammars and committed tokens (the verifier masks the target, a draft model its
    # proposals); None when no row has one
    grammar: GrammarRows | None = None
    min_p: torch.Tensor | None = None  # [B] float32; 0 = off (None: off in every row)
    # [B, G] int64 on the host: the token a row's draft position j must be (its prediction's,
    # engine/prediction.py), -1 where the drafter chooses; None where no row has one. Drafters only.
    forced: torch.Tensor | None = None

    @staticmethod
    def from_params(params: list[SamplingParams], device: torch.device | str = "cpu",
                    processing: LogitsProcessing | None = None,
                    grammar: GrammarRows | None = None) -> "BatchSampling":
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        min_p = any(p.min_p > 0 for p in params)
        out = BatchSampling(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            processing=processing, logprobs=max(wanted) if wanted else None, grammar=grammar,
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device) if min_p else None,
        )
        greedy = [p.greedy for p in params]
        filtering = any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params)
        return out._known(all(greedy), filtering, any(greedy))

    def _known(self, all_greedy: bool, filtering: bool, any_greedy: bool) -> "BatchSampling":
        """This sampling with its flags already known (from the params it was built from): read
        every step, they then cost no tensor op. (Not a field: the flags follow the tensors.)"""
        object.__setattr__(self, "_flags", (all_greedy, filtering, any_greedy))
        return self

    @property
    def all_greedy(self) -> bool:
        known = self.__dict__.get("_flags")
        return known[0] if known is not None else bool((self.temperature == 0).all())

    def flags(self) -> tuple[bool, bool]:
        """(some row filters with min-p, top-k or top-p, some row is greedy): read once where the tensors
        live (a step's sampling is built on the host), so that `logits_to_probs` on the device
        need not read them back."""
        known = self.__dict__.get("_flags")
        if known is not None:
            return known[1], known[2]
        filtering = bool(((self.top_k > 0) | (self.top_p < 1)).any()) or (
            self.min_p is not None and bool((self.min_p > 0).any()))
        return filtering, bool((self.temperature == 0).any())

    def min_ps(self) -> torch.Tensor:
        """[B] each row's min-p (zeros where no row has one): what a draft loop's buffer holds."""
        return self.min_p if self.min_p is not None else torch.zeros_like(self.top_p)

    def loop_flags(self) -> tuple[bool, bool] | None:
        """The flags a draft loop (one CUDA graph per variant) runs with: None where every row is
        greedy (argmax, no q), else (some row filters, True). Sampled loops always treat greedy
        rows as such, a `where` per position, so a batch's mix of greedy and sampled rows never
        needs a variant of its own: two sampled variants, the unfiltered one captured ahead
        (`engine.capture_graphs`). A row's q is the same in both (`_apply_top_k_top_p` leaves a row
        that filters nothing exactly as it was), so no row's drafts depend on its batch-mates."""
        if self.all_greedy:
            return None
        return self.flags()[0], True

    def to(self, device: torch.device | str) -> "BatchSampling":
        moved = BatchSampling(self.temperature.to(device), self.top_k.to(device), self.top_p.to(device),
                              self.processing, self.logprobs, self.grammar,
                              None if self.min_p is None else self.min_p.to(device), self.forced)
        known = self.__dict__.get("_flags")
        return moved if known is None else moved._known(*known)

    def select(self, rows: list[int]) -> "BatchSampling":
        """These rows only (caller indices), each with its processing and grammar."""
        index = torch.tensor(rows, dtype=torch.long)
        pick = lambda t: t.index_select(0, index.to(t.device))  # noqa: E731
        return BatchSampling(pick(self.temperature), pick(self.top_k), pick(self.top_p),
                             None if self.processing is None else self.processing.select(rows), self.logprobs,
                             None if self.grammar is None else self.grammar.select(rows),
                             None if self.min_p is None else pick(self.min_p),
                             None if self.forced is None else self.forced.index_select(0, index))

    def with_forced(self, forced: torch.Tensor | None) -> "BatchSampling":
        """The same rows with these forced drafts ([B, G] int64 or None), its flags kept."""
        out = dataclasses.replace(self, forced=forced)
        known = self.__dict__.get("_flags")
        return out if known is None else out._known(*known)

    def repeat_rows(self, n: int) -> "BatchSampling":
        """Each row repeated n times in place: [B] -> [B * n] (row b's copies are adjacent)."""
        return BatchSampling(
            self.temperature.repeat_interleave(n),
            self.top_k.repeat_interleave(n),
            self.top_p.repeat_interleave(n),
            min_p=None if self.min_p is None else self.min_p.repeat_interleave(n),
        )


def logits_to_probs(
    logits: torch.Tensor, sampling: BatchSampling, flags: tuple[bool, bool] | None = None
) -> torch.Tensor:
    """logits [N, V] -> probs [N, V] float32 after temperature, min-p (vLLM's order), top-k, then top-p.

    Greedy rows (temperature 0) become one-hot at their argmax, so that the rejection rule treats
    greedy and sampled rows alike. flags: `BatchSampling.flags()` of these rows when the caller
    has them (then nothing here reads the device); None reads them from `sampling`.
    """
    filtering, any_greedy = sampling.flags() if flags is None else flags
    logits = logits.float()
    greedy = sampling.temperature == 0  # [N]
    temperature = torch.where(greedy, torch.ones_like(sampling.temperature), sampling.temperature)
    scaled = logits / temperature[:, None]  # [N, V]
    if filtering:
        if sampling.min_p is not None:
            scaled = _apply_min_p(scaled, sampling.min_p)
        scaled = _apply_top_k_top_p(scaled, sampling.top_k, sampling.top_p)
    probs = torch.softmax(scaled, dim=-1)  # [N, V]
    if any_greedy:
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def one_hot(tokens: torch.Tensor, vocab: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Token ids [...] -> one-hot probs [..., V] on the ids' device: the q of a token that was copied
    rather than drawn (a row that did not draft), which the acceptance rule then treats as certain."""
    out = torch.zeros(*tokens.shape, vocab, dtype=dtype, device=tokens.device)
    return out.scatter_(-1, tokens.to(torch.long)[..., None], 1.0)


def rows_over_one_hot(probs: torch.Tensor | None, rows, tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """q for a whole batch: probs [R, G', V] of the rows listed (R of B; None for none) at their
    first G' <= G positions, one-hot at tokens [B, G] everywhere else -> [B, G, V] on the tokens'
    device (probs itself where it covers every row and position)."""
    if probs is not None and len(rows) == tokens.shape[0] and probs.shape[1] == tokens.shape[1]:
        return probs
    full = one_hot(tokens, vocab, probs.dtype if probs is not None else torch.float32)  # [B, G, V]
    if probs is not None and len(rows):
        full[list(rows), : probs.shape[1]] = probs.to(full.device)
    return full


SENT_Q_DTYPES = (torch.bfloat16, torch.float16)  # 16-bit dtypes q may cross in (`q_to_send`)


def q_to_send(probs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A draft's q [N, V] float32 -> the q it draws from when q crosses to the target in `dtype`:
    itself for float32; for a 16-bit dtype, rounded to it (values kept in float32), so that half
    the bytes cross and the drafts are drawn from the very values the target reads back
    (`q_as_read`): the rule stays exact. A one-hot row (greedy) rounds to itself."""
    if dtype == torch.float32:
        return probs
    if dtype not in SENT_Q_DTYPES:
        raise ValueError(f"q crosses in float32, bfloat16 or float16, not {dtype}")
    return probs.to(dtype).to(probs.dtype)


def q_as_read(probs: torch.Tensor) -> torch.Tensor:
    """q [..., V] as it crossed -> the distribution the rule reads: float32 q as it is; a 16-bit q
    (`q_to_send`), in float32 normalised. Rounding leaves a row's sum within ~2^-8 of 1, and the
    draft drew in proportion to the rounded values (`sample_with_uniforms` scales by the sum),
    so the normalised values are the draft's distribution. A row of zeros (a part of a merged
    proposal that had no q) stays zeros."""
    if probs.dtype == torch.float32:
        return probs
    wide = probs.float()  # (a new tensor: divided in place)
    total = wide.sum(-1, keepdim=True)  # [..., 1]
    return wide.div_(total.masked_fill_(total <= 0, 1.0))


def _apply_min_p(scaled: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """scaled [N, V] -> -inf where a token's probability is below min_p [N] x the likeliest's, i.e.
    its scaled logit below the best one + ln(min_p) (no softmax needed). min_p 0 (ln -inf) keeps
    every token; the likeliest token always stays."""
    floor = scaled.amax(dim=-1, keepdim=True) + min_p.log()[:, None]  # [N, 1]
    return scaled.masked_fill(scaled < floor, float("-inf"))


def _apply_top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """scaled [N, V] -> the same with filtered-out entries at -inf. top_k [N] (0 = off), top_p [N]."""
    vocab = scaled.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [N, V]
    rank = torch.arange(vocab, device=scaled.device)  # [V]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))  # [N]
    sorted_logits = sorted_logits.masked_fill(rank[None, :] >= k[:, None], float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)  # [N, V]
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [N, V] mass of strictly better tokens
    # top-p 1 keeps every token: the float sum of the sorted probabilities may reach 1 before the
    # tail, and the tail must not go with it
    drop_p = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1)
    drop_p[:, 0] = False  # the best token always stays
    sorted_logits = sorted_logits.masked_fill(drop_p, float("-inf"))
    return torch.empty_like(scaled).scatter_(-1, order, sorted_logits)


def sample_with_uniforms(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling. probs [N, V] (rows need not be normalised), uniforms [N] in [0, 1) -> ids [N].

    A token of zero probability is never returned.
    """
    cdf = probs.cumsum(dim=-1)  # [N, V]
    total = cdf[:, -1:]  # [N, 1]
    idx = torch.searchsorted(cdf, uniforms[:, None].to(cdf.dtype) * total, right=True).squeeze(-1)  # [N]
    vocab = probs.shape[-1]
    last_positive = vocab - 1 - (probs > 0).flip(-1).int().argmax(-1)  # [N]
    return torch.minimum(idx, last_positive)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's own random stream: seeded when the request has a seed, else from OS entropy."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen
