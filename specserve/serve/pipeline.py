"""Pipelined speculation: the draft worker drafts block k+1 while the target worker verifies block k.

The sequential loop (coordinator `_step`) leaves each worker idle while the other works. Here, as
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
step verifies both kinds together (`_combine`). The draft's cache marks are those the verdict sets
anyway (`apply_verdict` keeps only accepted tokens), so a fresh propose simply rewrites what the
ahead call wrote (a positional cache: rollback = a shorter length).

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
through the coordinator's own recovery, exactly as in the sequential loop.

A step that would prepare nothing (no prepared block in hand, and γ 0 or overlap not paying) is a
sequential step: with `transport: compiled_graph` it runs as one graph execution (`host._graph_step`),
so that a pipelined replica whose policy turned drafting off costs what a sequential one does. Steps
that prepare use plain actor calls (the verify and the ahead call at once).

The coordinator keeps the truth, the deadlines, the cache-miss protocol and the records: this class
only calls `host._call`, `host._deadline`, `host._draft_lost`, `host._adopt_late_draft`,
`host._graph_ready`, `host._graph_step` and `host._record` (the `Coordinator`'s own methods).
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass

import torch

from specserve.engine import RowInput
from specserve.engine.proposers import Proposal
from specserve.engine.sampling import BatchSampling
from specserve.engine.scheduler import OverlappedPolicy
from specserve.engine.step import Sequence, StepOutput, StepPlan, apply_verdict, empty_proposal, plan_step
from specserve.engine.verifier import Verdict

GUESS_UNIFORM = 0.5  # the uniform the bonus guess is drawn with (sampled rows); see the module docstring
_UNKNOWN = -1  # placeholder for the bonus token in the optimistic rows (only counted, never sent)


@dataclass
class Ahead:
    """An ahead call in flight: block k+1 planned for the optimistic rows, and what it assumed."""

    plan: StepPlan  # over the optimistic copies of the rows (their generators are the real ones)
    future: asyncio.Future  # -> Reply with a Proposal [B, G'+1]: guess, then block k+1's drafts
    num_tokens: list[int]  # [B] each row's token count once block k is accepted whole (bonus included)
    states: dict[int, torch.Tensor]  # row -> its generator's state before block k+1's draws
    launched: float  # perf_counter() at submission
    deadline: float  # seconds it may take


@dataclass
class Prepared:
    """Block k+1, drafted during block k's verify, for the rows whose verdict matched it."""

    plan: StepPlan  # the ahead plan (rows: optimistic copies; their generators are the real ones)
    tokens: torch.Tensor  # [B, G'] block k+1's drafts
    probs: torch.Tensor | None  # [B, G', V] their q
    rows: dict[str, int]  # request id -> its row, for the rows whose verdict matched
    num_tokens: list[int]  # [B] token count each row must still have for its block to apply
    states: dict[int, torch.Tensor]  # row -> generator state before its draws (matched rows only)


class Pipeline:
    def __init__(self, host) -> None:
        self.host = host  # the Coordinator
        self.policy: OverlappedPolicy = host.policy
        self._prepared: Prepared | None = None
        for key in ("pipelined_steps", "pipelined_prepared", "pipelined_hits"):
            host._totals.setdefault(key, 0)

    # -- the step -------------------------------------------------------------------------------
    async def step(self, seqs: list[Sequence], policy) -> list[StepOutput] | None:
        """One pipelined step, or None when this step must be the coordinator's sequential one (the
        draft is out, or a target-only retry): then whatever was prepared is thrown away."""
        host = self.host
        if policy is not host.policy or not host._draft_ok:
            self.discard()
            return None
        began = time.perf_counter()
        prepared, used = self._take(seqs)  # used[i]: seqs[i]'s row in the prepared block, or None
        fresh_rows = [i for i, row in enumerate(used) if row is None]
        fresh_seqs = [seqs[i] for i in fresh_rows]
        fresh, fresh_seconds = (), 0.0
        fresh_plan = plan_step(fresh_seqs, policy) if fresh_seqs else None
        if prepared is None and fresh_plan is not None and host._graph_ready() and not self._prepares(fresh_plan):
            outputs = await host._graph_step(fresh_plan, policy, began)  # a sequential step: on the graph
            if outputs is not None or not host._draft_ok:
                return outputs  # None: the draft was late there; the coordinator re-plans target-only
        fresh_proposal = empty_proposal(len(fresh_seqs))
        if fresh_plan is not None and fresh_plan.num_positions > 0:
            try:
                reply = await host._call("draft", host.draft.propose, fresh_seqs, "draft_len", lambda: (
                    fresh_plan.draft_rows(), fresh_plan.num_positions, fresh_plan.sampling,
                    fresh_plan.draft_uniforms), retry=False)
            except Exception as err:
                if prepared is not None:
                    _restore(prepared.plan.seqs, prepared.states)
                self._draft_failed(fresh_seqs, err)
                return None  # the coordinator re-plans this step target-only
            fresh_proposal, fresh, fresh_seconds = reply.result, reply.result.forwards, reply.seconds
        if prepared is None:
            plan, proposal, widths = fresh_plan, fresh_proposal, [fresh_plan.num_positions] * len(seqs)
        else:
            host._totals["pipelined_hits"] += len(seqs) - len(fresh_rows)
            plan, proposal, widths = _combine(seqs, used, prepared, fresh_plan, fresh_proposal)
        ahead = self._launch(plan, proposal, widths)
        try:
            reply = await host._call("target", host.target.verify, seqs, "target_len", lambda: (
                plan.target_rows(), proposal.tokens, proposal.probs, plan.num_draft, plan.sampling,
                plan.accept_uniforms, plan.final_uniforms))
        except BaseException:
            self._abandon(ahead)
            raise
        verdict: Verdict = reply.result
        before = [(s.num_tokens, s.draft_len) for s in seqs]
        outputs = apply_verdict(plan, proposal, verdict)
        for s, (n, held), width in zip(seqs, before, widths):  # what each row's own propose left cached
            s.draft_len = held if width == 0 else min(s.draft_len, n + width - 1)
        for s, g, a in zip(seqs, plan.num_draft.tolist(), verdict.num_accepted):
            policy.observe_acceptance(s.acceptance, a, g)
        ahead_forwards, ahead_seconds = await self._settle(ahead, plan, proposal, verdict)
        wall = time.perf_counter() - began
        policy.observe_overlapped_step(wall, fresh, ahead_forwards, verdict.forwards)
        host._totals["pipelined_steps"] += 1
        forward = sum(f.seconds for f in fresh) + max(verdict.seconds, sum(f.seconds for f in ahead_forwards))
        from .coordinator import StepRecord

        host._record(StepRecord(wall, forward, fresh_seconds + max(reply.seconds, ahead_seconds), len(seqs),
                                plan.num_positions), plan, verdict)
        return outputs

    def discard(self) -> None:
        """Throw the prepared block away (its rows' generators go back to before its draws)."""
        prepared, self._prepared = self._prepared, None
        if prepared is not None:
            _restore(prepared.plan.seqs, prepared.states)

    # -- preparing the next block -----------------------------------------------------------------
    def _prepares(self, plan: StepPlan) -> bool:
        """Whether a step of this plan would prepare the next block (`_launch`'s cost test): a step
        that would not (γ 0, or overlap does not pay) is simply a sequential step."""
        alphas = [self.policy.alpha(s.acceptance) for s in plan.seqs]
        return plan.num_positions > 0 and self.policy.overlap_pays(alphas, plan.num_positions)

    def _launch(self, plan: StepPlan, proposal: Proposal, widths: list[int]) -> Ahead | None:
        """Plan block k+1 for the rows as they would be after a full acceptance of block k and send
        the ahead call; None when nothing is worth preparing. widths: drafts each row's own propose
        made (its cache holds its tokens plus width - 1 of them)."""
        seqs, width = plan.seqs, plan.num_positions
        if not self._prepares(plan):
            return None
        if any(w == 0 and s.draft_len < s.num_tokens - 1 for s, w in zip(seqs, widths)):
            return None  # a row the draft lags on: the ahead call could not start from its last token
        num_draft = plan.num_draft.tolist()
        drafts = proposal.tokens.tolist()  # [B][G] host ints (the reply came over the wire)
        optimistic = []
        for s, g, row in zip(seqs, num_draft, drafts):
            gained = row[:g]
            if any(t in s.stop_ids for t in gained) or s.remaining <= g + 1:
                return None  # a row finishes with this block: its next block will never be verified
            n = s.num_tokens + g + 1
            optimistic.append(dataclasses.replace(s, output=s.output + gained + [_UNKNOWN], draft_len=n - 1,
                                                  metrics=s.metrics, acceptance=s.acceptance))
        states = {b: s.generator.get_state() for b, s in enumerate(seqs) if not s.params.greedy}
        ahead_plan = plan_step(optimistic, self.policy)
        if ahead_plan.num_positions == 0:
            _restore(seqs, states)
            return None
        rows = []
        for s, g, row in zip(seqs, num_draft, drafts):
            start = s.num_tokens + g - 1  # the row's last token if all of block k is accepted
            rows.append(RowInput(s.request_id, start, (s.tokens + row[:g])[start:]))
        uniforms = None
        if ahead_plan.draft_uniforms is not None:
            guess = torch.full((len(seqs), 1), GUESS_UNIFORM)
            uniforms = torch.cat([guess, ahead_plan.draft_uniforms], dim=1)  # [B, G'+1]
        host = self.host
        num_tokens = ahead_plan.num_positions + 1
        ref = host.draft.propose.remote(rows, num_tokens, ahead_plan.sampling, uniforms)
        self.host._totals["pipelined_prepared"] += 1
        return Ahead(ahead_plan, asyncio.ensure_future(ref), [s.num_tokens for s in optimistic], states,
                     time.perf_counter(), host._deadline("draft", rows, num_tokens))

    async def _settle(self, ahead: Ahead | None, plan: StepPlan, proposal: Proposal, verdict: Verdict):
        """Wait for the ahead call; keep its block when every row accepted all of block k and the
        bonus equals the guess. -> (its forwards, its seconds in the worker)."""
        if ahead is None:
            return (), 0.0
        host, seqs = self.host, plan.seqs
        left = ahead.deadline - (time.perf_counter() - ahead.launched)
        try:
            reply = await asyncio.wait_for(ahead.future, timeout=max(left, 0.0))
        except Exception as err:  # timed out, died, raised
            _restore(seqs, ahead.states)
            if isinstance(err, asyncio.TimeoutError):
                from .coordinator import WorkerTimeout

                err = WorkerTimeout(f"draft worker missed its {ahead.deadline:.1f} s deadline (ahead call)")
            host._draft_lost(err)
            return (), 0.0
        if reply.misses:  # a restarted draft: its marks move back, the next propose rebuilds
            by_id = {s.request_id: s for s in seqs}
            for rid, valid in reply.misses.items():
                by_id[rid].draft_len = min(by_id[rid].draft_len, valid)
            _restore(seqs, ahead.states)
            return (), reply.seconds
        tokens = reply.result.tokens  # [B, G'+1] guess, then block k+1
        guesses = tokens[:, 0].tolist()
        full = [a == g for a, g in zip(verdict.num_accepted, plan.num_draft.tolist())]
        right = [f and nxt == guess for f, nxt, guess in zip(full, verdict.next_token, guesses)]
        self.policy.observe_guesses(sum(right), sum(full))
        matched = [r and s.finish_reason is None and s.num_tokens == n
                   for r, s, n in zip(right, seqs, ahead.num_tokens)]
        _restore(seqs, {b: state for b, state in ahead.states.items() if not matched[b]})
        if any(matched):
            width = ahead.plan.num_positions
            for s, m in zip(seqs, matched):  # the draft holds the row plus block k+1's first G'-1 drafts
                if m:
                    s.draft_len = s.num_tokens + width - 1
            probs = reply.result.probs
            self._prepared = Prepared(
                ahead.plan, tokens[:, 1:], None if probs is None else probs[:, 1:],
                {s.request_id: b for b, (s, m) in enumerate(zip(seqs, matched)) if m}, list(ahead.num_tokens),
                {b: state for b, state in ahead.states.items() if matched[b]})
        return reply.result.forwards, reply.seconds

    def _take(self, seqs: list[Sequence]) -> tuple[Prepared | None, list[int | None]]:
        """The prepared block and, per row of this step, its row there (None: draft it afresh).
        Prepared rows not in this step (finished, aborted) give their random numbers back."""
        prepared, self._prepared = self._prepared, None
        if prepared is None:
            return None, [None] * len(seqs)
        used = [prepared.rows.get(s.request_id) for s in seqs]
        used = [b if b is not None and s.num_tokens == prepared.num_tokens[b] else None for b, s in zip(used, seqs)]
        taken = set(u for u in used if u is not None)
        _restore(prepared.plan.seqs, {b: st for b, st in prepared.states.items() if b not in taken})
        return (prepared if taken else None), used

    def _abandon(self, ahead: Ahead | None) -> None:
        """The step failed after the ahead call went out: forget it (the draft finishes it unread)."""
        if ahead is not None:
            _restore(ahead.plan.seqs, ahead.states)
            ahead.future.add_done_callback(lambda f: f.cancelled() or f.exception())  # no unread error logs

    def _draft_failed(self, seqs: list[Sequence], err: Exception) -> None:
        from .coordinator import WorkerTimeout

        if isinstance(err, WorkerTimeout) and err.late is not None:
            asyncio.get_running_loop().create_task(
                self.host._adopt_late_draft(err.late, {s.request_id: s.num_tokens for s in seqs}))
        self.host._draft_lost(err)


def _combine(seqs: list[Sequence], used: list[int | None], prepared: Prepared, fresh_plan: StepPlan | None,
             fresh: Proposal) -> tuple[StepPlan, Proposal, list[int]]:
    """One step's plan and drafts for rows from the prepared block (used[i] = its row there) and
    freshly drafted rows (the others, in order): width G = the wider of the two, each row's drafts
    and uniforms in its own first columns (the rule ignores positions past a row's g_b).
    -> (plan, proposal, each row's own width)."""
    ahead = prepared.plan
    parts = [(ahead, prepared.tokens, prepared.probs)]
    if fresh_plan is not None:
        parts.append((fresh_plan, fresh.tokens, fresh.probs))
    width = max(p.num_positions for p, _, _ in parts)
    where, count = [], 0  # per row: (part, its row in that part)
    for row in used:
        where.append((0, row) if row is not None else (1, count))
        count += row is None
    sampling = BatchSampling.from_params([s.params for s in seqs])
    batch = len(seqs)
    tokens = torch.zeros(batch, width, dtype=torch.long)  # [B, G]
    num_draft = torch.zeros(batch, dtype=torch.long)  # [B]
    vocab = next((q.shape[-1] for _, _, q in parts if q is not None), 0)
    probs = None if sampling.all_greedy else torch.zeros(batch, width, vocab)  # [B, G, V]
    accept = None if sampling.all_greedy else torch.zeros(batch, width)  # [B, G]
    final = None if sampling.all_greedy else torch.zeros(batch)  # [B]
    widths = []
    for b, (part, row) in enumerate(where):
        plan, drafts, q = parts[part]
        g = plan.num_positions
        widths.append(g)
        tokens[b, :g] = drafts[row, :g]
        num_draft[b] = plan.num_draft[row]
        if probs is not None and plan.accept_uniforms is not None:
            accept[b, :g], final[b] = plan.accept_uniforms[row], plan.final_uniforms[row]
            if q is not None:
                probs[b, :g] = q[row, :g]
    step = StepPlan(list(seqs), width, num_draft, sampling, None, accept, final)
    return step, Proposal(tokens, probs), widths


def _restore(seqs: list[Sequence], states: dict[int, torch.Tensor]) -> None:
    """Put sampled rows' generators back to before the draws of a block that will not be used."""
    for b, state in states.items():
        seqs[b].generator.set_state(state)
