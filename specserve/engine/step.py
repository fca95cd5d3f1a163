"""One speculative step over a batch: propose, verify, append. The function to read first.

The caller (the in-process engine, or the Ray coordinator) holds the truth about each request:
its tokens, its sampling parameters and random stream, and how much of it each model's cache holds.
`plan_step` decides the drafts and random numbers, an executor runs the propose and the verify
(`engine/executor.py`: `run_step` is the whole composition), and `apply_verdict` appends the new
tokens and moves the cache marks.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .model_runner import DRAFT_ROW_TOKENS, RowInput
from .proposers import Proposal
from .grammar import GrammarRows
from .processing import LogitsProcessing
from .sampling import BatchSampling, SamplingParams, make_generator
from .policy import AcceptanceEstimate, SpeculationPolicy
from .history import MAX_MATCH, Recall
from .prediction import Prediction, forced_drafts
from .verifier import Verdict


@dataclass
class RequestMetrics:
    num_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [j]: steps whose draft j was accepted
    num_draft_steps: int = 0  # steps that drafted at least one token
    num_full_accept_steps: int = 0  # ... and accepted every draft
    # predicted outputs (engine/prediction.py): the predicted drafts the target verified, and of
    # those the ones it accepted (and the output kept)
    num_prediction_drafts: int = 0
    num_prediction_accepted: int = 0
    # the same for drafts recalled from earlier answers (engine/history.py)
    num_recalled_drafts: int = 0
    num_recalled_accepted: int = 0

    def record(self, num_draft: int, num_accepted: int) -> None:
        self.num_steps += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        self.num_draft_steps += num_draft > 0
        self.num_full_accept_steps += num_draft > 0 and num_accepted == num_draft
        if len(self.accepted_per_position) < num_draft:
            self.accepted_per_position.extend([0] * (num_draft - len(self.accepted_per_position)))
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    @property
    def num_rejections(self) -> int:
        """Steps in which a draft was rejected: the failures of the geometric acceptance model."""
        return self.num_draft_steps - self.num_full_accept_steps

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


def per_token_alpha(accepted: int, rejections: int) -> float | None:
    """α as the speedup arithmetic uses it: the chance that a draft is accepted given that every
    draft before it in its step was (the geometric model's MLE: accepted / (accepted + steps that
    rejected a draft)). Unlike accepted / drafted, it does not fall as γ grows. None: no trials."""
    return accepted / (accepted + rejections) if accepted + rejections else None


@dataclass
class Sequence:
    """A request as the coordinator holds it."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    max_model_len: int  # tokens the request may reach (prompt + output)
    max_gamma: int | None = None  # this request's own cap on drafts per step (None: the engine's)
    output: list[int] = field(default_factory=list)
    target_len: int = 0  # leading tokens whose keys the target's cache holds
    draft_len: int = 0  # the same for the draft
    finish_reason: str | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)  # ρ: a planned draft kept
    offers: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)  # κ: a planned draft drafted
    generator: torch.Generator | None = None
    drafted_for: bool = False  # a step has planned drafts for it (else the policy may probe it, `choose`)
    # params.logprobs set: per generated token (this engine's), its log-probability and alternatives
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens the target's cache took from shared blocks (prefix caching)
    preempted: bool = False  # its caches were given back (paged budget): prefilled again before it steps
    priority: int = 0  # lower goes first: admitted before, preempted after, requests of a higher value
    prediction: Prediction | None = None  # params.prediction, indexed (made here when not given)
    recall: Recall | None = None  # its drafts from earlier answers (StepLoop, where configured)

    def __post_init__(self) -> None:
        if self.generator is None:
            self.generator = make_generator(self.params.seed)
        if self.prediction is None and self.params.prediction:
            self.prediction = Prediction(self.params.prediction)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def span(self, start: int, end: int | None = None) -> list[int]:
        """tokens[start:end], without building `tokens` (a copy of the whole context: per row and
        per step, at long contexts that copy is host time the step would spend on it)."""
        cut = len(self.prompt)
        end = self.num_tokens if end is None else min(end, self.num_tokens)
        if end <= start:
            return []
        if start >= cut:
            return self.output[start - cut : end - cut]
        if end <= cut:
            return self.prompt[start:end]
        return self.prompt[start:] + self.output[: end - cut]

    @property
    def remaining(self) -> int:
        return min(self.params.max_tokens - len(self.output), self.max_model_len - self.num_tokens)

    @property
    def reproducible(self) -> bool:
        """Seeded sampling: its γ must not depend on the batch, or its tokens would."""
        return self.params.seed is not None and not self.params.greedy


class InvalidPrompt(ValueError):
    """The prompt is empty or holds token ids outside the vocabulary."""


class ContextLengthExceeded(ValueError):
    """prompt + max_tokens does not fit the model's context."""


def new_sequence(
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    *,
    vocab_size: int,
    max_model_len: int,
    eos_token_ids: frozenset[int],
    max_gamma: int | None = None,
    priority: int = 0,
) -> Sequence:
    """Admission: check a new request against the models and make it a Sequence."""
    prompt = [int(t) for t in prompt_token_ids]
    if not prompt:
        raise InvalidPrompt("the prompt must hold at least one token")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        raise InvalidPrompt(f"prompt token ids must lie in [0, {vocab_size})")
    if params.prediction and max(params.prediction) >= vocab_size:
        raise InvalidPrompt(f"prediction token ids must lie in [0, {vocab_size})")
    if len(prompt) + params.max_tokens > max_model_len:
        raise ContextLengthExceeded(
            f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the model's "
            f"context of {max_model_len} tokens"
        )
    stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_token_ids)
    allowed = params.allowed_token_ids
    if allowed is not None and (allowed[-1] >= vocab_size or (params.min_tokens and stops.issuperset(allowed))):
        raise InvalidPrompt(f"allowed_token_ids must lie in [0, {vocab_size}) and, with min_tokens, hold a "
                            "token that does not end the output")
    return Sequence(request_id, prompt, params, stops, max_model_len, max_gamma=max_gamma, priority=priority)


@dataclass
class StepPlan:
    seqs: list[Sequence]
    gamma: int  # G: drafts per row proposed this step
    num_draft: torch.Tensor  # [B] int64, g_b <= G drafts each row may accept
    sampling: BatchSampling
    draft_uniforms: torch.Tensor | None  # [B, G]
    accept_uniforms: torch.Tensor | None  # [B, G]
    final_uniforms: torch.Tensor | None  # [B]
    backlog: int = 0  # tokens the drafter catches up on before drafting (steps it skipped)
    verified: torch.Tensor | None = None  # [B] the drafts verified (`apply_verdict` sets it), for accounting
    # [B] how many of each row's first drafts are its prediction's or recalled (`sampling.forced`); None: no row's
    predicted: list[int] | None = None
    predicted_kept: tuple[int, int] = (0, 0)  # predicted drafts verified, and accepted and kept (`apply_verdict`)
    recalled_kept: tuple[int, int] = (0, 0)  # the same for runs recalled from earlier requests (engine/history.py)

    @property
    def num_verified(self) -> torch.Tensor:
        return self.num_draft if self.verified is None else self.verified

    def draft_rows(self) -> list[RowInput]:
        return [RowInput(s.request_id, s.draft_len, s.span(s.draft_len)) for s in self.seqs]

    def target_rows(self) -> list[RowInput]:
        return [RowInput(s.request_id, s.target_len, s.span(s.target_len)) for s in self.seqs]


# -- chunked prefill -------------------------------------------------------------------------------
# A new request's prompt goes into each model's cache a chunk per step, in forwards of its own
# beside the step, so that a long prompt costs every running stream one bounded forward per step
# instead of one long stall. The draft takes all of it but the last token; the target's last chunk
# rides in the request's first step, whose verify row carries it with the prompt's last token and
# no drafts (`folding`): one forward over it gives the first output token.
def prefill_end(seq: Sequence) -> int:
    """Positions each model caches before the request's first step: all its tokens but the
    last (the prompt, and for a continuation the tokens delivered before it moved replicas); the
    target's last chunk of them may instead go with that step (`folding`)."""
    return seq.num_tokens - 1


def decoding(seq: Sequence) -> bool:
    """Whether the request has stepped since its prompt (and output, if preempted) went in: its
    caches take no more prefill chunks."""
    return bool(seq.metrics.num_steps) and not seq.preempted


def prefilling(seq: Sequence, with_draft: bool, fold: frozenset[str] = frozenset()) -> bool:
    """Whether the request still waits for its tokens to be cached (target, and draft when
    with_draft) before it can step; the target's last chunk need not be if the request is in
    `fold` (its first step carries it). Only before its first step: a draft lagging behind a
    running request (steps without drafts) is caught up by the next propose, as before."""
    if decoding(seq):
        return False
    end = prefill_end(seq)
    return (seq.target_len < end and seq.request_id not in fold) or (with_draft and seq.draft_len < end)


def folding(seqs: list[Sequence], budget: int) -> frozenset[str]:
    """The requests whose target chunk this step (`prefill_rows`) is their prompt's last: it goes
    with their first step instead, in the verify row (one forward for the chunk and the first
    token, not a prefill forward and then a forward of the last token). The same rows as the
    prefill would take, so a step's forwards stay within the chunk budget. A request that
    `replays` its random stream is left out."""
    by_id = {s.request_id: s for s in seqs}
    return frozenset(r.request_id for r in prefill_rows(seqs, "target_len", budget)
                     if r.start + len(r.tokens) == prefill_end(by_id[r.request_id])
                     and not replays(by_id[r.request_id]))


def can_draft(seq: Sequence) -> bool:
    """Whether a step may plan drafts for the request: its target has cached its prompt, or it
    replays (a row whose prompt's last chunk goes with the step drafts nothing: `plan_step`)."""
    return seq.target_len >= prefill_end(seq) or replays(seq)


def replays(seq: Sequence) -> bool:
    """A seeded sampled request resumed with output (preempted, or continued from another
    replica): its first step here drafts as its next step would have where it began, drawing the
    same random numbers, so that its tokens stay those of an uninterrupted run. So it does not
    fold (`folding`), and drafts even with a prompt backlog."""
    return seq.reproducible and bool(seq.output)


def prefill_rows(seqs: list[Sequence], mark: str, budget: int, fold: frozenset[str] = frozenset()) -> list[RowInput]:
    """This step's prefill chunks for one model ("target_len" or "draft_len" names its cache
    mark), FIFO over seqs (their admission order): the first request short of its prefill end gets
    w = min(what it lacks, budget) tokens; later ones join the same forward with at most w tokens
    each while (rows x w), the padded size of that forward, stays within budget. fold: requests
    whose chunk goes with their first step instead (`folding`): left out of the forward, where
    they still count against the budget."""
    rows: list[RowInput] = []
    width = 0
    for s in seqs:
        if decoding(s):  # (most rows, most steps)
            continue
        start, end = getattr(s, mark), prefill_end(s)
        if start >= end:
            continue
        if not rows:
            width = min(end - start, budget)
        elif (len(rows) + 1) * width > budget:
            break
        rows.append(RowInput(s.request_id, start, s.span(start, min(end, start + width))))
    return [r for r in rows if r.request_id not in fold]


def advance_marks(seqs: list[Sequence], mark: str, rows: list[RowInput]) -> None:
    """After a prefill call over rows: each row's request now caches up to the end of its chunk."""
    by_id = {s.request_id: s for s in seqs}
    for row in rows:
        setattr(by_id[row.request_id], mark, row.start + len(row.tokens))


@dataclass(frozen=True)
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None
    logprobs: list[float] | None = None  # per new token, when the request asked (SamplingParams.logprobs)
    top_logprobs: list[list[tuple[int, float]]] | None = None


def plan_step(seqs: list[Sequence], policy: SpeculationPolicy, predict: bool = True) -> StepPlan:
    """Pick γ for the batch (and per row), and draw every random number the step needs.
    predict: rows with a prediction, or a recall of earlier answers, draft its run first
    (`predicted_runs`); False for a block planned ahead of the verdict it follows
    (serve/pipeline.py drafts it from the drafter alone)."""
    alphas = [policy.alpha(s.acceptance) for s in seqs]
    # what the drafter catches up on first (the policy's estimate: tokens past a drafting row's own)
    backlog = sum(max(s.num_tokens - s.draft_len - DRAFT_ROW_TOKENS, 0) for s in seqs)
    able = [can_draft(s) for s in seqs]
    # A step whose every row is still prefilling drafts nothing whatever γ says: no choice is made
    # for it (a probe chosen there was spent on nothing, and put off the next by its spacing). A
    # newcomer is a row no step has drafted for that can draft in this one.
    batch_gamma = 0 if not any(able) else policy.choose(
        alphas, backlog, sum(a and not s.drafted_for for a, s in zip(able, seqs)),
        [policy.offer(s.offers) for s in seqs])
    # A seeded sampled request always asks for max_gamma, so that its random stream, and with it
    # its tokens, depend on nothing but its seed and its own tokens (and float rounding, which the
    # batch's shapes set: docs/engine.md, "Seeds and batch shapes").
    # (A drafter of predictions alone gives such a row max_gamma only where it has a prediction.)
    own = [policy.max_gamma if s.reproducible and (policy.own_drafts or s.prediction is not None) else batch_gamma
           for s in seqs]
    runs = predicted_runs(seqs, own, policy.max_gamma) if predict else [[] for _ in seqs]
    own = [max(g, len(run)) for g, run in zip(own, runs)]  # a predicted run is drafted whole
    own = [g if s.max_gamma is None else min(g, s.max_gamma) for g, s in zip(own, seqs)]
    # g_b <= remaining - 1 keeps every real position of a row below its limit minus one; drafts a
    # row will not use (when another row asks for more) go to clamped junk positions. A row whose
    # target has not cached its prompt yet drafts nothing: its verify row is the prompt's last
    # chunk, whose one forward gives its first token (`folding`).
    num_draft = [max(0, min(g, s.remaining - 1)) if a else 0 for g, s, a in zip(own, seqs, able)]
    positions = max(num_draft)
    for s, g in zip(seqs, num_draft):
        s.drafted_for = s.drafted_for or g > 0
    sampling = step_sampling(seqs)
    runs = [run[:g] for run, g in zip(runs, num_draft)]
    forced = forced_drafts(runs, positions)  # [B, G] or None
    if forced is not None:
        sampling = sampling.with_forced(forced)
    draft_u = accept_u = final_u = None
    if not all(s.params.greedy for s in seqs):  # (from the params: no tensor read on the host)
        draft_u = torch.full((len(seqs), positions), 0.5)
        accept_u = torch.zeros(len(seqs), positions)
        final_u = torch.zeros(len(seqs))
        for b, (s, g) in enumerate(zip(seqs, num_draft)):
            if s.params.greedy:
                continue
            draws = torch.rand(2 * g + 1, generator=s.generator)  # this row's stream only
            draft_u[b, :g], accept_u[b, :g], final_u[b] = draws[:g], draws[g : 2 * g], draws[2 * g]
    return StepPlan(seqs, positions, torch.tensor(num_draft, dtype=torch.long), sampling, draft_u, accept_u, final_u,
                    backlog=backlog, predicted=None if forced is None else [len(run) for run in runs])


def predicted_runs(seqs: list[Sequence], own: list[int], limit: int) -> list[list[int]]:
    """Per row, the predicted tokens that follow its output ([] for a row with no prediction, or
    whose output is not found in it: `Prediction.continuation`), else, for a row that recalls,
    what followed its latest tokens in an earlier request (`History.continuation`): up to `limit`
    (the most drafts a step takes), or, after a run of its had a draft rejected, up to the row's
    own γ (at least one: a step that plans no drafts of its own still tries the prediction's next
    token, and goes back to whole runs once one is accepted)."""
    if limit <= 0:
        return [[] for _ in seqs]
    runs = []
    for s, g in zip(seqs, own):
        guess = s.prediction if s.prediction is not None else s.recall
        count = limit if guess is None or not guess.missed else max(g, 1)
        if s.prediction is not None:
            runs.append(s.prediction.continuation(s.output, count))
        elif s.recall is not None:  # (its latest tokens only: no copy of the whole context)
            runs.append(s.recall.continuation(s.span(max(s.num_tokens - MAX_MATCH, 0)), count))
        else:
            runs.append([])
    return runs


def step_sampling(seqs: list[Sequence]) -> BatchSampling:
    """The rows' sampling parameters, with the penalties / logit bias of the target's logits and
    the grammars, as of the tokens they hold now (each None when no row has any)."""
    return BatchSampling.from_params([s.params for s in seqs], processing=LogitsProcessing.of(seqs),
                                     grammar=GrammarRows.of(seqs))


def verified_counts(num_draft: torch.Tensor, proposal: Proposal) -> torch.Tensor:
    """[B] drafts to verify per row: the planned g_b, or fewer where the drafter stopped early
    (`Proposal.num_draft`). The acceptance rule is unchanged: a row simply has fewer drafts, and
    whether it drafts a position depends only on the tokens before it."""
    return num_draft if proposal.num_draft is None else torch.minimum(num_draft, proposal.num_draft)


def empty_proposal(batch: int) -> Proposal:
    return Proposal(torch.zeros(batch, 0, dtype=torch.long), None)


def apply_verdict(plan: StepPlan, proposal: Proposal, verdict: Verdict) -> list[StepOutput]:
    """Append accepted + next tokens (cut at a stop token or the length limit); move cache marks."""
    outputs = []
    drafts = verdict.draft_tokens if verdict.draft_tokens is not None else proposal.tokens.tolist()
    plan.verified = verified_counts(plan.num_draft, proposal)
    verified = plan.verified.tolist()
    over = [b for b, (a, g) in enumerate(zip(verdict.num_accepted, verified)) if a > g]
    if over:  # (before any row changes: a step retried after this must find every row as it was)
        raise ValueError(f"rows {over} accepted more drafts than were verified ({verdict.num_accepted} > {verified}): "
                         "the target verified other counts than the proposal's")
    if verdict.cached_tokens:  # the prompt's last chunk went with this step (prefix caching's share)
        for s in plan.seqs:
            s.cached_tokens = verdict.cached_tokens.get(s.request_id, s.cached_tokens)
    for b, s in enumerate(plan.seqs):
        accepted, g = verdict.num_accepted[b], verified[b]
        s.metrics.record(g, accepted)
        n = s.num_tokens
        s.target_len = n + accepted
        if plan.gamma > 0 and proposal.draft_cached:
            s.draft_len = n + min(accepted, plan.gamma - 1)
        new = _cut(s, drafts[b][:accepted] + [verdict.next_token[b]])
        s.output.extend(new)
        if plan.predicted is not None and plan.predicted[b]:
            counts = _count_prediction(s, min(plan.predicted[b], g), min(accepted, len(new)))
            if s.prediction is not None:
                plan.predicted_kept = tuple(map(sum, zip(plan.predicted_kept, counts)))
            else:
                plan.recalled_kept = tuple(map(sum, zip(plan.recalled_kept, counts)))
        outputs.append(StepOutput(s.request_id, new, s.finish_reason, *_logprobs(s, verdict, b, len(new))))
    return outputs


def _count_prediction(seq: Sequence, verified: int, kept: int) -> tuple[int, int]:
    """A row's predicted (or recalled) drafts: `verified` of them were verified, the first `kept`
    drafts accepted and kept (a stop or the length limit may cut the accepted ones). -> (verified,
    kept) counted."""
    kept = min(kept, verified)
    if seq.prediction is None:
        seq.metrics.num_recalled_drafts += verified
        seq.metrics.num_recalled_accepted += kept
        seq.recall.missed = kept < verified
        return verified, kept
    seq.metrics.num_prediction_drafts += verified
    seq.metrics.num_prediction_accepted += kept
    seq.prediction.missed = kept < verified
    return verified, kept


def _logprobs(seq: Sequence, verdict: Verdict, row: int, count: int) -> tuple[list | None, list | None]:
    """The log-probabilities (and alternatives) of a row's `count` new tokens, if it asked."""
    k = seq.params.logprobs
    if k is None or verdict.logprobs is None:
        return None, None
    values = verdict.logprobs[row][:count]
    tops = [alternatives[:k] for alternatives in verdict.top_logprobs[row][:count]]
    seq.logprobs.extend(values)
    seq.top_logprobs.extend(tops)
    return values, tops


def observe_verified(policy: SpeculationPolicy, plan: StepPlan, verdict: Verdict) -> None:
    """Teach the policy, per row (after `apply_verdict`), how many of its planned drafts were kept
    and how many the drafter drafted. A position the drafter declined (a confidence floor) yields
    nothing, as a rejected one; it is also cheap (the verify narrows, a host-checked loop stops),
    which the offer rate prices (`SpeculationPolicy.offer`). A row's forced run (its prediction's
    or recalled, drafted first) is not the drafter's: only the positions after it count, and none
    where a draft of the run was rejected (the drafter's were never reached)."""
    forced = plan.predicted or [0] * len(plan.seqs)
    for s, planned, drafted, a, run in zip(plan.seqs, plan.num_draft.tolist(), plan.num_verified.tolist(),
                                           verdict.num_accepted, forced):
        if run and (a < run or planned <= run):
            continue
        policy.observe_acceptance(s.acceptance, a - run, planned - run)
        policy.observe_offers(s.offers, max(drafted - run, 0), planned - run)


def _cut(seq: Sequence, new: list[int]) -> list[int]:
    """Keep tokens up to and including a stop token, and no more than the request may still take."""
    limit = seq.remaining
    for i, token in enumerate(new[:limit]):
        if token in seq.stop_ids:
            seq.finish_reason = "stop"
            return new[: i + 1]
    if len(new) >= limit:
        seq.finish_reason = "length"
    return new[:limit]


def finish_step(
    plan: StepPlan, proposal: Proposal, verdict: Verdict, policy: SpeculationPolicy, began: float
) -> list[StepOutput]:
    """Apply the verdict, then teach the policy what the step cost and how much was accepted.

    began: `time.perf_counter()` when the step was planned (the wall time includes the calls).
    """
    outputs = apply_verdict(plan, proposal, verdict)
    observe_verified(policy, plan, verdict)
    policy.observe_step(time.perf_counter() - began, proposal.forwards, verdict.forwards, len(plan.seqs),
                        plan.gamma, plan.backlog)
    return outputs
