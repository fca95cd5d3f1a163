"""Pipelined speculation: the draft worker drafts block k+1 while the target worker verifies block k.

The sequential step (engine/executor.py `run_step`) leaves each worker idle while the other works. Here, as
soon as block k's drafts are known, two calls go out together: `target.verify(block k)` and
`draft.propose(ahead)`, which drafts on the optimistic assumption that the target accepts all of
block k. The next block starts after a token nobody knows yet: the bonus token the target samples
when it accepts everything. So the ahead call drafts γ' + 1 tokens per row from block k's last
draft: first the draft's own guess of the bonus (the token it would propose there; a uniform of 0.5
when sampling, which picks a token holding more than half of q whenever there is one), then block
k+1's γ' drafts after that guess. Each row's context is then exactly what the sequential loop would
draft block k+1 from, *if* the row accepts all of block k and its bonus equals the guess.

A row's prepared block is used only when that holds for it and the row is still running at the
length it assumed: then its block k+1 is verified at once in the next step. Rows without one (a
rejection, a wrong guess, a new request) are drafted afresh in one propose over just them, and the
step verifies both kinds together (`_combine_plan`, `combine_drafts`). The draft's cache marks are
those the verdict sets anyway (`apply_verdict` keeps only accepted tokens), so a fresh propose simply
rewrites what the ahead call wrote (a positional cache: rollback = a shorter length). A prepared
block thrown away instead of verified takes its rows' marks back before their last token
(`_unprepare`).

Branches (`speculation.branches`, compiled graph, every row greedy): one prepared block per row is
used only when the row accepts all of block k and the bonus guess holds, α^(γ+1) of the time. The
ahead call can also draft from the likeliest rejection points: for each of a row's first k drafts
(`branch_points`), the draft side forks the row's cache up to that position, feeds the fork the
draft's runner-up there (its likeliest correction, `Proposal.alternates`) and drafts block k+1
after it, all in the same batched forwards as the optimistic rows. The verdict picks at most one
block per row (`_match`): the row's own, or the branch whose position was the first rejected and
whose runner-up the target chose. The next execution tells the draft side which (`Block.rows`
name the held rows); what a used fork drafted is copied into the request's cache, and every fork
is freed. The policy chooses k, none where the extra rows cost more than the misses they save
(`OverlappedPolicy`), and fewer where the forks would not fit `max_cached_tokens`. Which block is
verified never changes a token: greedy rows verify whatever they are given.

Lossless, and the same tokens as the sequential loop: block k+1's random numbers are drawn from each
request's own generator when the ahead call is planned, by the same `plan_step` over the rows as
they would be after a full acceptance. Before that draw each sampled row's generator state is saved;
on a miss it is restored, so the next plan draws the very numbers the sequential loop would. On a
hit they are the numbers the sequential loop would have drawn at that point (a seeded request's γ
depends only on its own tokens). Greedy rows are token-identical by construction; sampled rows
follow the same acceptance rule with the same uniforms.

Costs (`OverlappedPolicy`): a step costs max(verify, ahead) plus, on a miss, the fresh drafts
first (when any row misses). The policy picks γ for that model, and tells the loop when preparing
is not worth it (at large batches some row nearly always misses; then a step is the sequential
one). A failing draft (dead, hung, raising) during either call degrades to target-only steps
through the executor's own recovery, exactly as in the sequential loop.

Two transports. On plain actor calls (`step`) the coordinator sends the fresh propose, then the
verify and the ahead call at once, and block k's q passes through it. On the compiled graph
(`transport: compiled_graph`, `_step_on_graph`) a step is one execution of the pair's pipelined
graph (serve/graph.py): `draft.graph_propose` assembles block k from the prepared drafts it holds
(q included, under the ahead call's id) and a propose over the fresh rows, and sends it to
`target.graph_verify`; then `draft.graph_ahead` drafts the ahead call beside the verify, and
`target.graph_join` returns the verdict with the ahead's token ids as one output. The
coordinator plans the ahead call's random numbers before the execution (`plan_step` needs no token
values; the draft side puts each row's last draft in and skips the call when block k holds a stop
token) and gets back token ids only. A step that prepares nothing (no prepared block in hand, and
γ 0 or overlap not paying) is the executor's sequential graph step, so a pipelined replica whose
policy turned drafting off costs what a sequential one does. When the graph cannot run a step, every
number the step drew goes back first: the sequential step that reruns it draws the same ones.

Pipelining is a capability of the remote executor (serve/executor.py, the `host`): it keeps the
deadlines, the cache-miss protocol (`host.calls`), the draft's availability and the records; this
class uses its public methods only.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from dataclasses import dataclass

import torch

from specserve.engine import RowInput
from specserve.engine.proposers import Proposal
from specserve.engine.policy import OverlappedPolicy
from specserve.engine.sampling import BatchSampling
from specserve.engine.step import (
    Sequence, StepOutput, StepPlan, apply_verdict, empty_proposal, observe_verified, plan_step, step_sampling,
    verified_counts,
)
from specserve.engine.verifier import Verdict

from .calls import StepRecord, WorkerTimeout
from .wire import AheadCall, Block, StepCall

GUESS_UNIFORM = 0.5  # the uniform the bonus guess is drawn with (sampled rows); see the module docstring
_UNKNOWN = -1  # placeholder for the bonus token in the optimistic rows (only counted, never sent)


@dataclass
class Ahead:
    """An ahead call: block k+1 planned for the optimistic rows, and what it assumed."""

    plan: StepPlan  # over the optimistic copies of the rows (their generators are the real ones)
    rows: list[RowInput]  # from each row's last token once block k is accepted whole
    uniforms: torch.Tensor | None  # [B, G'+1]: the guess's, then block k+1's
    num_tokens: list[int]  # [B] each row's token count once block k is accepted whole (bonus included)
    states: dict[int, torch.Tensor]  # row -> its generator's state before block k+1's draws
    launched: float  # perf_counter() at planning
    deadline: float  # seconds it may take
    expected: float  # seconds its forwards should take by the measured costs
    ahead_id: int  # names its drafts on the draft side (compiled graph)
    future: asyncio.Future | None = None  # plain calls: -> Reply with a Proposal [B, G'+1]: guess, then block k+1
    branches: int = 0  # rejection points per row that get a block too (compiled graph, all rows greedy)

    def call(self, num_draft: list[int]) -> AheadCall:
        """The AheadCall a graph execution carries (rows with g_b > 0 hold a placeholder token)."""
        return AheadCall(self.ahead_id, self.rows, num_draft, [s.stop_ids for s in self.plan.seqs],
                         self.plan.gamma + 1, self.plan.sampling, self.uniforms, self.branches)


@dataclass
class Prepared:
    """Block k+1, drafted during block k's verify, for the rows whose verdict matched it."""

    plan: StepPlan  # the ahead plan (rows: optimistic copies; their generators are the real ones)
    tokens: torch.Tensor  # [B, G'] block k+1's drafts
    probs: torch.Tensor | None  # [B, G', V] their q
    rows: dict[str, int]  # request id -> its row, for the rows whose verdict matched
    num_tokens: list[int]  # [B] token count each row must still have for its block to apply
    states: dict[int, torch.Tensor]  # row -> generator state before its draws (matched rows only)
    owners: list[Sequence]  # [B] the rows themselves (the plan's are optimistic copies)
    sources: list[int]  # [B] each row's row among the ahead call's (a branch's: past B)
    ahead_id: int | None = None  # graph: the draft side holds tokens and q under this id (probs None here)


class Pipeline:
    def __init__(self, host) -> None:
        self.host = host  # the Coordinator
        self.policy: OverlappedPolicy = host.policy
        self._prepared: Prepared | None = None
        self._ahead_ids = itertools.count(1)
        for key in ("pipelined_steps", "pipelined_prepared", "pipelined_hits", "pipelined_branch_hits"):
            host.totals.setdefault(key, 0)

    # -- the step -------------------------------------------------------------------------------
    async def step(self, seqs: list[Sequence], policy) -> list[StepOutput] | None:
        """One pipelined step, or None when this step must be the executor's sequential one (the
        draft is out, or a target-only retry): then whatever was prepared is thrown away."""
        host = self.host
        if policy is not host.policy or not host.draft_ok or host.graph_solo():
            self.discard()  # (the target's graph alone runs target-only steps; drafting ones go on plain calls)
            return None
        if host.graph_ready():
            return await self._step_on_graph(seqs, policy)
        if self._prepared is not None and self._prepared.ahead_id is not None:
            self.discard()  # prepared on the graph: its q is on the draft side
        began = time.perf_counter()
        prepared, used = self._take(seqs)  # used[i]: seqs[i]'s row in the prepared block, or None
        fresh_rows = [i for i, row in enumerate(used) if row is None]
        fresh_seqs = [seqs[i] for i in fresh_rows]
        fresh, fresh_seconds = (), 0.0
        fresh_plan = plan_step(fresh_seqs, policy) if fresh_seqs else None
        fresh_proposal = empty_proposal(len(fresh_seqs))
        if fresh_plan is not None and fresh_plan.gamma > 0:
            try:
                reply = await host.calls.call("draft", host.draft.propose, fresh_seqs, "draft_len", lambda: (
                    fresh_plan.draft_rows(), fresh_plan.gamma, fresh_plan.sampling,
                    fresh_plan.draft_uniforms), retry=False)
            except Exception as err:
                if prepared is not None:
                    _unprepare(prepared)
                host.draft_failed(fresh_seqs, err)
                return None  # the executor re-plans this step target-only
            fresh_proposal, fresh, fresh_seconds = reply.result, reply.result.forwards, reply.seconds
        plan, widths = _combine_plan(seqs, used, prepared, fresh_plan)
        proposal = fresh_proposal
        if prepared is not None:
            host.totals["pipelined_hits"] += len(seqs) - len(fresh_rows)
            tokens, probs = combine_drafts(used, plan.gamma, (prepared.tokens, prepared.probs),
                                           (fresh_proposal.tokens, fresh_proposal.probs))
            proposal = Proposal(tokens, probs, num_draft=_combined_counts(used, plan, fresh_proposal))
        ahead = self._launch(plan, proposal, widths)
        verified = verified_counts(plan.num_draft, proposal)  # (what `apply_verdict` counts too)
        try:
            reply = await host.calls.call("target", host.target.verify, seqs, "target_len", lambda: (
                plan.target_rows(), proposal.tokens, proposal.probs, verified, plan.sampling,
                plan.accept_uniforms, plan.final_uniforms))
        except BaseException:
            self._abandon(ahead)
            raise
        verdict: Verdict = reply.result
        outputs = self._apply(plan, proposal, verdict, widths)
        ahead_forwards, ahead_seconds = await self._settle(ahead, plan, verdict)
        self._account(began, plan, verdict, fresh, ahead_forwards, fresh_seconds + max(reply.seconds, ahead_seconds))
        return outputs

    async def _step_on_graph(self, seqs: list[Sequence], policy) -> list[StepOutput] | None:
        """The pipelined step as one compiled-graph execution: the draft side assembles block k
        (the prepared rows' drafts, held there with their q, and a propose over the fresh rows),
        sends it to the target, then drafts the ahead call while the target verifies. A step that
        prepares nothing is the executor's sequential graph step. None when the graph could not
        run the step: every draw it made is given back first, so the sequential step that follows
        draws the very same numbers."""
        host = self.host
        if self._prepared is not None and self._prepared.ahead_id is None:
            self.discard()  # prepared on plain calls: its q is here, not on the draft side
        began = time.perf_counter()
        prepared, used = self._take(seqs)
        saved = {b: s.generator.get_state() for b, s in enumerate(seqs) if not s.params.greedy}
        fresh_seqs = [s for s, row in zip(seqs, used) if row is None]
        fresh_plan = plan_step(fresh_seqs, policy) if fresh_seqs else None
        if prepared is None and not self._prepares(fresh_plan):
            outputs = await host.graph_step(fresh_plan, policy, began)  # a sequential step
            if outputs is None:
                _restore(seqs, saved)
            return outputs
        plan, widths = _combine_plan(seqs, used, prepared, fresh_plan)
        block = None if prepared is None else Block(prepared.ahead_id, _held_rows(prepared, used), plan.gamma)
        ahead = self._plan_ahead(plan, widths)
        draft = fresh_plan  # the rows the draft side proposes for (None: every row was prepared)

        def make_call() -> StepCall:
            return StepCall(
                draft.draft_rows() if draft else [], draft.gamma if draft else 0, plan.sampling,
                draft.draft_uniforms if draft else None, plan.target_rows(), plan.num_draft, plan.accept_uniforms,
                plan.final_uniforms, block, draft.sampling if block is not None and draft else None,
                None if ahead is None else ahead.call(plan.num_draft.tolist()))

        reply = await host.graph_execute(seqs, make_call, plan.gamma, ahead.deadline if ahead else 0.0,
                                          ahead.expected if ahead else 0.0)
        if reply is None:
            _restore(seqs, saved)  # this step's fresh and ahead draws
            if prepared is not None:
                _unprepare(prepared)  # block k's draws, made when it was prepared, and its draft marks
            return None
        if prepared is not None:
            host.totals["pipelined_hits"] += len(seqs) - len(fresh_seqs)
        host.totals["graph_steps"] += 1
        outputs = self._apply(plan, reply.proposal, reply.verdict, widths)
        ahead_forwards, ahead_seconds = self._settle_reply(ahead, plan, reply.verdict, reply.ahead, held_here=False)
        self._account(began, plan, reply.verdict, reply.proposal.forwards, ahead_forwards,
                      reply.draft_seconds + max(reply.target_seconds, ahead_seconds))
        return outputs

    def _apply(self, plan: StepPlan, proposal: Proposal, verdict: Verdict, widths: list[int]) -> list[StepOutput]:
        """Apply the verdict; each row's draft mark covers only what its own propose cached."""
        seqs = plan.seqs
        before = [(s.num_tokens, s.draft_len) for s in seqs]
        outputs = apply_verdict(plan, proposal, verdict)
        for s, (n, held), width in zip(seqs, before, widths):  # what each row's own propose left cached
            s.draft_len = held if width == 0 else min(s.draft_len, n + width - 1)
        observe_verified(self.policy, plan, verdict)
        return outputs

    def _account(self, began: float, plan: StepPlan, verdict: Verdict, fresh, ahead_forwards,
                 in_workers: float) -> None:
        """The policy's costs and the replica's step record. fresh / ahead_forwards: the
        draft's forwards before the verify and beside it."""
        host = self.host
        wall = time.perf_counter() - began
        self.policy.observe_overlapped_step(wall, fresh, ahead_forwards, verdict.forwards)
        host.totals["pipelined_steps"] += 1
        forward = sum(f.seconds for f in fresh) + max(verdict.seconds, sum(f.seconds for f in ahead_forwards))
        host.record(StepRecord(wall, forward, in_workers, len(plan.seqs), plan.gamma), plan, verdict)

    def discard(self) -> None:
        """Throw the prepared block away (see `_unprepare`)."""
        prepared, self._prepared = self._prepared, None
        if prepared is not None:
            _unprepare(prepared)

    # -- preparing the next block -----------------------------------------------------------------
    def _prepares(self, plan: StepPlan | None) -> bool:
        """Whether a step of this plan would prepare the next block (`_plan_ahead`'s cost test): a
        step that would not (γ 0, or overlap does not pay) is simply a sequential step."""
        if plan is None:
            return False
        alphas = [self.policy.alpha(s.acceptance) for s in plan.seqs]
        return plan.gamma > 0 and self.policy.overlap_pays(alphas, plan.gamma)

    def _plan_ahead(self, plan: StepPlan, widths: list[int], drafts: list[list[int]] | None = None) -> Ahead | None:
        """Plan block k+1 for the rows as they would be after a full acceptance of block k; None
        when nothing is worth preparing. widths: drafts each row's own propose made (its cache
        holds its tokens plus width - 1 of them). drafts: block k's [B][G] when known here (plain
        calls); on the graph the draft side puts each row's last draft in and checks stop tokens."""
        seqs = plan.seqs
        if not self._prepares(plan) or any(s.params.grammar is not None for s in seqs):
            return None  # (a grammar row's next drafts are masked from the state its verdict sets)
        if any(w == 0 and s.draft_len < s.num_tokens - 1 for s, w in zip(seqs, widths)):
            return None  # a row the draft lags on: the ahead call could not start from its last token
        num_draft = plan.num_draft.tolist()
        optimistic, rows = [], []
        for b, (s, g) in enumerate(zip(seqs, num_draft)):
            gained = drafts[b][:g] if drafts is not None else [_UNKNOWN] * g
            if any(t in s.stop_ids for t in gained) or s.remaining <= g + 1:
                return None  # a row finishes with this block: its next block will never be verified
            n = s.num_tokens + g + 1
            optimistic.append(dataclasses.replace(s, output=s.output + gained + [_UNKNOWN], draft_len=n - 1,
                                                  target_len=n - 1, metrics=s.metrics, acceptance=s.acceptance))
            last = gained[-1] if g else s.span(s.num_tokens - 1)[0]  # the row's last token if all of block k is accepted
            rows.append(RowInput(s.request_id, s.num_tokens + g - 1, [last]))
        states = {b: s.generator.get_state() for b, s in enumerate(seqs) if not s.params.greedy}
        ahead_plan = plan_step(optimistic, self.policy, predict=False)  # (drafted by the drafter alone)
        if ahead_plan.gamma == 0:
            _restore(seqs, states)
            return None
        uniforms = None
        if ahead_plan.draft_uniforms is not None:
            guess = torch.full((len(seqs), 1), GUESS_UNIFORM)
            uniforms = torch.cat([guess, ahead_plan.draft_uniforms], dim=1)  # [B, G'+1]
        self.host.totals["pipelined_prepared"] += 1
        branches = 0
        if drafts is None and ahead_plan.sampling.all_greedy:  # branches: on the graph, greedy rows
            branches = self.policy.branches_for([self.policy.alpha(s.acceptance) for s in seqs], plan.gamma)
            while branches and not self.host.admission.fits_extra_slots(len(branch_points(num_draft, branches))):
                branches -= 1  # their forks would take the draft's cache past max_cached_tokens
        forks = [RowInput(seqs[b].request_id, 0, [0]) for b, _ in branch_points(num_draft, branches)]  # one token each
        expected = self.host.predicted("draft", rows + forks, ahead_plan.gamma + 1)
        return Ahead(ahead_plan, rows, uniforms, [s.num_tokens for s in optimistic], states, time.perf_counter(),
                     self.host.calls.allowed("draft", expected), expected, next(self._ahead_ids), branches=branches)

    def _launch(self, plan: StepPlan, proposal: Proposal, widths: list[int]) -> Ahead | None:
        """Plan block k+1 and send the ahead call on a plain actor call."""
        ahead = self._plan_ahead(plan, widths, proposal.tokens.tolist())  # [B][G] host ints (from the wire)
        if ahead is not None:
            ref = self.host.draft.propose.remote(ahead.rows, ahead.plan.gamma + 1, ahead.plan.sampling,
                                                 ahead.uniforms, pull_features=False)
            ahead.future = asyncio.ensure_future(ref)
        return ahead

    async def _settle(self, ahead: Ahead | None, plan: StepPlan, verdict: Verdict):
        """Wait for a plain-call ahead call, then `_settle_reply`. -> (its forwards, its seconds in the worker)."""
        if ahead is None:
            return (), 0.0
        left = ahead.deadline - (time.perf_counter() - ahead.launched)
        try:
            reply = await asyncio.wait_for(ahead.future, timeout=max(left, 0.0))
        except Exception as err:  # timed out, died, raised
            _restore(plan.seqs, ahead.states)
            if isinstance(err, asyncio.TimeoutError):
                err = WorkerTimeout(f"draft worker missed its {ahead.deadline:.1f} s deadline (ahead call)")
            self.host.draft_lost(err)
            return (), 0.0
        return self._settle_reply(ahead, plan, verdict, reply, held_here=True)

    def _settle_reply(self, ahead: Ahead | None, plan: StepPlan, verdict: Verdict, reply, held_here: bool):
        """Keep the ahead call's block when every row accepted all of block k and the bonus equals
        the guess. reply: its Reply (None, or one without result or misses: no ahead was drafted).
        held_here: its q came back here (plain calls), else the draft side holds it under the
        ahead's id. -> (its forwards, its seconds in the worker)."""
        if ahead is None:
            return (), 0.0
        seqs = plan.seqs
        if reply is None or (reply.result is None and not reply.misses):
            _restore(seqs, ahead.states)
            return (), 0.0 if reply is None else reply.seconds
        if reply.misses:  # a restarted draft: its marks move back, the next propose rebuilds
            by_id = {s.request_id: s for s in seqs}
            for rid, valid in reply.misses.items():
                by_id[rid].draft_len = min(by_id[rid].draft_len, valid)
            _restore(seqs, ahead.states)
            return (), reply.seconds
        tokens = reply.result.tokens  # [B + F, G'+1]: the guess (a branch: its correction), then block k+1
        num_draft = plan.num_draft.tolist()
        sources, num_tokens = self._match(ahead, verdict, num_draft, tokens[:, 0].tolist())
        matched = [src is not None and s.finish_reason is None and s.num_tokens == n
                   for src, s, n in zip(sources, seqs, num_tokens)]
        _restore(seqs, {b: state for b, state in ahead.states.items() if not matched[b]})
        if any(matched):
            width = ahead.plan.gamma
            for s, m in zip(seqs, matched):  # the draft holds the row plus block k+1's first G'-1 drafts
                if m:
                    s.draft_len = s.num_tokens + width - 1
            self.host.totals["pipelined_branch_hits"] += sum(
                m and src >= len(seqs) for m, src in zip(matched, sources))
            rows = [src if m else b for b, (src, m) in enumerate(zip(sources, matched))]  # [B]
            probs = reply.result.probs
            self._prepared = Prepared(
                ahead.plan, tokens[rows, 1:], None if probs is None else probs[rows, 1:],
                {s.request_id: b for b, (s, m) in enumerate(zip(seqs, matched)) if m}, num_tokens,
                {b: state for b, state in ahead.states.items() if matched[b]}, list(seqs), rows,
                None if held_here else ahead.ahead_id)
        return reply.result.forwards, reply.seconds

    def _match(self, ahead: Ahead, verdict: Verdict, num_draft: list[int], heads: list[int]):
        """Which of the ahead call's rows holds each row's next block, if any: its own (every draft
        accepted, bonus = guess) or a branch's (rejected at the branch's position, and the target's
        token there = its correction). heads: [B + F] the token before each ahead row's block.
        Teaches the policy both rates. -> (per row: its ahead row or None, per row: the token count
        that ahead row assumed)."""
        batch = len(num_draft)
        full = [a == g for a, g in zip(verdict.num_accepted, num_draft)]
        sources = [b if f and nxt == heads[b] else None
                   for b, (f, nxt) in enumerate(zip(full, verdict.next_token))]
        self.policy.observe_guesses(sum(s is not None for s in sources), sum(full))
        num_tokens = list(ahead.num_tokens)
        points = branch_points(num_draft, ahead.branches) if len(heads) > batch else []
        tried = right = 0
        for r, (b, i) in enumerate(points, start=batch):
            if verdict.num_accepted[b] != i - 1:
                continue
            tried += 1
            if verdict.next_token[b] == heads[r]:
                right += 1
                sources[b] = r
                num_tokens[b] = ahead.num_tokens[b] - (num_draft[b] + 1 - i)  # its tokens, d_1..d_{i-1}, the correction
        self.policy.observe_alternates(right, tried)
        return sources, num_tokens

    def _take(self, seqs: list[Sequence]) -> tuple[Prepared | None, list[int | None]]:
        """The prepared block and, per row of this step, its row there (None: draft it afresh).
        Prepared rows not in this step (finished, aborted) give their random numbers back."""
        prepared, self._prepared = self._prepared, None
        if prepared is None:
            return None, [None] * len(seqs)
        used = [prepared.rows.get(s.request_id) for s in seqs]
        used = [b if b is not None and s.num_tokens == prepared.num_tokens[b] else None for b, s in zip(used, seqs)]
        taken = set(u for u in used if u is not None)
        _unprepare(prepared, [b for b in prepared.rows.values() if b not in taken])
        return (prepared if taken else None), used

    def _abandon(self, ahead: Ahead | None) -> None:
        """The step failed after the ahead call went out: forget it (the draft finishes it unread)."""
        if ahead is not None:
            _restore(ahead.plan.seqs, ahead.states)
            ahead.future.add_done_callback(lambda f: f.cancelled() or f.exception())  # no unread error logs


def _combine_plan(seqs: list[Sequence], used: list[int | None], prepared: Prepared | None,
                  fresh_plan: StepPlan | None) -> tuple[StepPlan, list[int]]:
    """One step's plan for rows from the prepared block (used[i] = its row in its ahead plan) and
    freshly drafted rows (the others, in order): width G = the wider of the two, each row's
    uniforms in its own first columns (the rule ignores positions past a row's g_b). Without a
    prepared block, the fresh plan itself. -> (plan, each row's own width)."""
    if prepared is None:
        return fresh_plan, [fresh_plan.gamma] * len(seqs)
    ahead = prepared.plan
    sampling = step_sampling(seqs)  # (penalties count the tokens of the step the block was drafted ahead of)
    if fresh_plan is None and used == list(range(len(ahead.seqs))):  # every row, in the prepared order
        return (StepPlan(list(seqs), ahead.gamma, ahead.num_draft, sampling, None,
                         ahead.accept_uniforms, ahead.final_uniforms), [ahead.gamma] * len(seqs))
    parts = [ahead] + ([fresh_plan] if fresh_plan is not None else [])
    width = max(p.gamma for p in parts)
    batch = len(seqs)
    num_draft = torch.zeros(batch, dtype=torch.long)  # [B]
    accept = None if sampling.all_greedy else torch.zeros(batch, width)  # [B, G]
    final = None if sampling.all_greedy else torch.zeros(batch)  # [B]
    widths, predicted = [], []  # (a prepared row's block is the drafter's own: never a predicted run)
    for b, (part, row) in enumerate(_sources(used)):
        plan = parts[part]
        g = plan.gamma
        widths.append(g)
        num_draft[b] = plan.num_draft[row]
        predicted.append(plan.predicted[row] if part == 1 and plan.predicted is not None else 0)
        if accept is not None and plan.accept_uniforms is not None:
            accept[b, :g], final[b] = plan.accept_uniforms[row], plan.final_uniforms[row]
    return (StepPlan(list(seqs), width, num_draft, sampling, None, accept, final,
                     predicted=predicted if any(predicted) else None), widths)


def combine_drafts(used: list[int | None], width: int, prepared: tuple, fresh: tuple):
    """Block k's drafts for rows from a prepared block (used[i] = its row there) and freshly drafted
    rows (the others, in order), each row's in its own first columns; prepared / fresh: (tokens
    [B', G'], q [B', G', V] or None; tokens may be None for a part no row takes). Run where the
    drafts are: the coordinator on plain calls, the draft worker on the compiled graph.
    -> (tokens [B, G], q [B, G, V] or None when no part has q)."""
    parts = [prepared, fresh]
    some_q = next((q for _, q in parts if q is not None), None)  # (its dtype is kept: `sampling.q_to_send`)
    batch = len(used)
    tokens = torch.zeros(batch, width, dtype=torch.long)  # [B, G]
    probs = None if some_q is None else torch.zeros(batch, width, some_q.shape[-1], dtype=some_q.dtype)  # [B, G, V]
    for b, (part, row) in enumerate(_sources(used)):
        drafts, q = parts[part]
        g = drafts.shape[1]
        tokens[b, :g] = drafts[row, :g]
        if probs is not None and q is not None:
            probs[b, :g] = q[row, :g]
    return tokens, probs


def branch_points(num_draft: list[int], branches: int) -> list[tuple[int, int]]:
    """The ahead call's branch rows, in the order the draft side appends them after the B rows:
    (row b, rejection position i, 1-based) for i up to min(g_b, branches). A branch drafts
    block k+1 from the row's tokens, its first i-1 drafts and the draft's runner-up at position i."""
    return [(b, i) for b, g in enumerate(num_draft) for i in range(1, min(g, branches) + 1)]


def _held_rows(prepared: Prepared, used: list[int | None]) -> list[int | None]:
    """Block.rows: per row of the step, its row among the ahead call's rows the draft side holds."""
    return [None if u is None else prepared.sources[u] for u in used]


def _combined_counts(used: list[int | None], plan: StepPlan, fresh: Proposal) -> torch.Tensor | None:
    """[B] drafts worth verifying per row of a combined block: a fresh row's as its drafter said
    (a confidence floor may have stopped it early), a prepared row's as planned (None: all as
    planned)."""
    if fresh.num_draft is None:
        return None
    counts = plan.num_draft.clone()
    for b, (part, row) in enumerate(_sources(used)):
        if part == 1:
            counts[b] = fresh.num_draft[row]
    return counts


def _sources(used: list[int | None]) -> list[tuple[int, int]]:
    """Per row: (0, its row in the prepared block) or (1, its row among the fresh ones)."""
    where, count = [], 0
    for row in used:
        where.append((0, row) if row is not None else (1, count))
        count += row is None
    return where


def _unprepare(prepared: Prepared, rows: list[int] | None = None) -> None:
    """Rows (default: all) of a prepared block that will not be verified: their generators go back
    to before its draws, and their draft marks back to before their last token (the draft's cache
    holds the block's first drafts past it, which only the block's own verify may keep; a propose
    starts from at least one token)."""
    rows = list(prepared.rows.values()) if rows is None else rows
    _restore(prepared.plan.seqs, {b: prepared.states[b] for b in rows if b in prepared.states})
    for b in rows:
        s = prepared.owners[b]
        if s.num_tokens == prepared.num_tokens[b]:
            s.draft_len = min(s.draft_len, s.num_tokens - 1)


def _restore(seqs: list[Sequence], states: dict[int, torch.Tensor]) -> None:
    """Put sampled rows' generators back to before the draws of a block that will not be used."""
    for b, state in states.items():
        seqs[b].generator.set_state(state)


def branch_sampling(ahead: AheadCall, forks: list) -> BatchSampling:
    """The ahead call's sampling over its B rows, then each branch row as its own row's."""
    if not forks:
        return ahead.sampling
    owners = torch.tensor([b for b, _ in branch_points(ahead.num_draft, ahead.branches)])  # [F]
    s = ahead.sampling
    grown = lambda t: torch.cat([t, t[owners]])  # noqa: E731
    return BatchSampling(grown(s.temperature), grown(s.top_k), grown(s.top_p),
                         min_p=None if s.min_p is None else grown(s.min_p))


def with_corrections(drafted: Proposal, batch: int, corrections: list[int]) -> Proposal:
    """An ahead call's proposal over B rows and F branch rows -> every row as [token before block
    k+1, block k+1]: a row's own is its bonus guess already; a branch's is its correction (what it
    was fed), so its drafts shift right by one (its last draft, one more than needed, is dropped)."""
    if not corrections:
        return drafted
    tokens, ups = drafted.tokens, drafted.alternates  # [B + F, G'+1]
    head = torch.tensor(corrections, dtype=tokens.dtype, device=tokens.device)[:, None]  # [F, 1]
    tokens = torch.cat([tokens[:batch], torch.cat([head, tokens[batch:, :-1]], dim=1)])
    if ups is not None:
        ups = torch.cat([ups[:batch], torch.cat([head, ups[batch:, :-1]], dim=1)])
    return Proposal(tokens, drafted.probs, drafted.forwards, drafted.deterministic, drafted.num_draft, ups)
