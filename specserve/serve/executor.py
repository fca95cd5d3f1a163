"""The remote executor: how a replica's step runs on its worker actors (engine/executor.py's interface).

A plan's propose and verify run on one of three transports, tried in this order:

    compiled graph (`speculation.transport: compiled_graph`, serve/graph.py): one execution;
    fused call: a drafter inside the target worker drafts and verifies in one plain call;
    two plain calls: draft.propose, then target.verify (serve/calls.py: deadlines, cache misses).

A transport that cannot run a step hands it to the next with the same plan (the same random
numbers): a broken graph reruns the step on plain calls, a failed fused call as two calls. A
draft side that fails in any way (dies, hangs, raises, is late in the graph) does not stall
anyone: `execute` answers None, the step loop plans the step again without drafts, and steps run
target-only (the target's own tokens) until a background probe sees the draft answer again. A
request with a prediction (OpenAI's Predicted Outputs) keeps drafting it meanwhile: those steps
plan with `outage` (no drafts of the policy's own), their predicted runs are drafted here
(`PredictionProposer`: it needs no model and holds nothing) and the target verifies them.

Pipelining (`speculation.pipelined`, serve/pipeline.py) is a capability of this executor: it
takes over whole steps (it plans fresh rows itself and verifies prepared ones) and hands back
to the sequential step whenever it prepares nothing.

The compiled graph is kept here too: rebuilt in the background once both workers answer after it
broke, and reshaped to the target's graph alone while the policy keeps drafting off.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque

import ray

from specserve.engine import RowInput
from specserve.engine.admission import Admission
from specserve.engine.executor import Ran, finish, note_cached, run_step
from specserve.engine.policy import SpeculationPolicy
from specserve.engine.proposers import PredictionProposer, Proposal
from specserve.engine.step import (
    Sequence, StepOutput, StepPlan, advance_marks, empty_proposal, prefill_rows, verified_counts,
)

from .calls import CALL_ATTEMPTS, ProposerSide, StepRecord, WorkerCalls, WorkerTimeout, answers
from .graph import DraftLate, StepCall, StepGraph, StepReply
from .pipeline import Pipeline
from .placed_q import QGone
from .wire import Reply

logger = logging.getLogger("specserve.coordinator")
_GRAPH_KEEPER_PERIOD_S = 0.5  # how often a broken step graph is checked for a rebuild
_GRAPH_REBUILD_BUSY_S = 30.0  # under traffic, plain calls at least this long before a rebuild
_BUSY_PROBE_S = 0.2  # a draft worker that does not answer within this is still inside a method
# A pair's graph becomes the target's alone (StepGraph.reshape) once at most _SOLO_SHARE of the
# last _SOLO_WINDOW steps drafted (the policy's probes), and goes back once _PAIR_SHARE of the last
# _PAIR_WINDOW did; at most one change per _RESHAPE_EVERY_S (each costs a 1-2 s stall). Steps run
# while the draft is out are not counted: they say nothing of what drafting pays once it is back
_SOLO_WINDOW, _SOLO_SHARE = 64, 0.05
_PAIR_WINDOW, _PAIR_SHARE = 32, 0.25
_RESHAPE_EVERY_S = 30.0


class RemoteExecutor:
    """One replica's worker pair as the step loop's executor.

    target: the TargetWorker actor; draft_worker: the DraftWorker actor or None; draft: the
    remote methods of the draft side (a DraftWorker's, or a colocated drafter's in the target
    worker), None when nothing drafts. totals, records, metrics: the replica's counters, step
    records and Prometheus metrics, which steps update."""

    def __init__(self, config, target, draft_worker, draft: ProposerSide | None, policy: SpeculationPolicy,
                 admission: Admission, totals: dict, records: deque, metrics) -> None:
        self.config, self.deadlines = config, config.deadlines
        self.target, self.draft_worker, self.draft = target, draft_worker, draft
        self.policy, self.admission = policy, admission
        self.totals, self.records, self.metrics = totals, records, metrics
        self.calls = WorkerCalls(target, config.deadlines, policy, totals, on_restart=self._worker_restarts)
        # a drafter inside the target worker drafts and verifies in one call (`_fused`)
        self.fused = draft is not None and draft_worker is None
        # draft failure: target-only steps while the draft restarts
        self.draft_ok = draft is not None
        self.target_only = SpeculationPolicy(0, adaptive=False)
        # while the draft is out: no drafts but the requests' predictions, drafted here (`_predictions`)
        self.outage = SpeculationPolicy(policy.max_gamma, adaptive=False, own_drafts=False)
        self._predicted = PredictionProposer()
        self._draft_watch: asyncio.Task | None = None
        self.probe_delay_s = 0.2  # the draft's first probes after a failure are this far apart (then doubling to 5 s)
        metrics.set(metrics.draft_available, float(self.draft_ok))
        # draft block k+1 while the target verifies block k (speculation.pipelined; needs a DraftWorker)
        self.pipeline = Pipeline(self) if config.speculation.pipelined and draft_worker is not None else None
        self.graph = None  # the step's worker calls as one compiled-graph execution (serve/graph.py)
        self.growing: list = []  # workers whose dense caches grow under their graphs (`reserve`; set at start)
        self._graph_task: asyncio.Task | None = None
        self._drafted: deque[bool] = deque(maxlen=_SOLO_WINDOW)  # recent steps with the draft up: whether each drafted
        self._reshaped_at = -_RESHAPE_EVERY_S  # time.monotonic() of the graph's last reshape
        # q placed for the target to read in place (serve/placed_q.py): the handshake is due before the next step
        self._q_handshake_due = False
        self._handshake_again()
        self.q_placed = False  # the last handshake's outcome
        if config.speculation.transport == "compiled_graph":
            self.graph = StepGraph(target, draft_worker, ahead=self.pipeline is not None)
            self._build_graph_at_start()

    # -- the executor interface (engine/executor.py) ----------------------------------------------
    @property
    def with_draft(self) -> bool:
        return self.draft is not None and self.draft_ok

    def policy_for(self, policy: SpeculationPolicy, drafting: bool = True) -> SpeculationPolicy:
        """`policy` while the draft side is up; else `outage` (predictions alone) where a drafter
        is configured, else, and for a step isolated after a failure (`target_only` asked), γ 0."""
        if drafting and self.draft_ok:
            return policy
        return self.outage if self.draft is not None and policy is not self.target_only else self.target_only

    async def step(self, seqs: list[Sequence], policy: SpeculationPolicy) -> list[StepOutput]:
        if self._q_handshake_due:
            await self._place_q()
        if self.pipeline is not None:
            outputs = await self.pipeline.step(seqs, policy)  # None: this step runs sequentially
            if outputs is not None:
                return outputs
        return await run_step(seqs, policy, self)

    async def execute(self, plan: StepPlan) -> Ran | None:
        """The plan on the graph, else on a fused call, else on two calls (see the module docstring);
        while the draft is out, its predicted runs verified on a plain call."""
        if not self.draft_ok and plan.gamma > 0:
            return await self._predictions(plan)
        if self.graph_ready(drafting=plan.gamma > 0):
            ran = await self._on_graph(plan)
            if ran is not None or not self.draft_ok:  # (the draft was late in the graph: re-plan)
                return ran
        elif self.fused and plan.gamma > 0:
            ran = await self._fused(plan)
            if ran is not None:
                return ran
        return await self._two_calls(plan)

    def stepped(self, plan: StepPlan, ran: Ran, policy: SpeculationPolicy, began: float) -> None:
        if (policy is self.target_only or policy is self.outage) and self.draft is not None:
            self.totals["target_only_steps"] += 1
            self.metrics.inc(self.metrics.target_only_steps, 1)
        if ran.via in ("graph", "fused"):
            self.totals[f"{ran.via}_steps"] += 1
        forward = ran.proposal.seconds + ran.verdict.seconds
        self.record(StepRecord(time.perf_counter() - began, forward, ran.in_workers, len(plan.seqs),
                               plan.gamma), plan, ran.verdict)

    def free(self, request_ids: list[str]) -> None:
        """(After the step that used them: actor calls from this process run in submission order.)"""
        self.target.free.remote(request_ids)
        if self.draft is not None:
            self.draft.free.remote(request_ids)

    def reserve(self, num_requests: int, longest: int, budget: int | None) -> None:
        """Sent to the workers whose graphs sit on a dense cache that grows (`growing`, set at
        start), before the step: on plain calls it is run first (submission order); beside a
        compiled graph's execution it may be run after that step, whose forward then grows the
        cache as it needs, as it would without it."""
        for worker in self.growing:
            worker.reserve.remote(num_requests, longest, budget)

    async def prefill(self, seqs: list[Sequence], budget: int, fold: frozenset[str] = frozenset()) -> None:
        """Send each worker its chunks of at most `budget` prompt tokens (FIFO, `prefill_rows`; the
        target's less `fold`'s, which go with the step), the two workers at once. A draft failure
        only turns the draft off (as in a step); a target failure is raised once both calls are
        over, so that no mark moves after the caller moved on."""
        calls = [self._prefill_side("target", self.target.prefill, seqs, "target_len", budget, fold=fold)]
        if self.with_draft:
            calls.append(self._prefill_side("draft", self.draft.prefill, seqs, "draft_len", budget, retry=False))
        results = await asyncio.gather(*calls, return_exceptions=True)
        if len(results) > 1 and isinstance(results[1], Exception):
            self.draft_lost(results[1])
        if isinstance(results[0], BaseException):
            raise results[0]

    async def _prefill_side(self, side: str, method, seqs: list[Sequence], mark: str, budget: int,
                            retry: bool = True, fold: frozenset[str] = frozenset()) -> None:
        """One worker's prefill call: rows planned from the marks (again after cache misses, which
        move marks back), then the marks moved to the ends of the chunks the worker cached."""
        sent: list[RowInput] = []

        def make_args():
            sent[:] = prefill_rows(seqs, mark, budget, fold)
            return (list(sent),)

        if not prefill_rows(seqs, mark, budget, fold):
            return
        reply = await self.calls.call(side, method, seqs, mark, make_args, retry=retry)
        advance_marks(seqs, mark, sent)
        if side == "target":
            self.totals["prefill_tokens"] += sum(len(r.tokens) for r in sent)
            if isinstance(reply.result, dict):  # prompt tokens taken from shared blocks
                note_cached(seqs, reply.result)

    # -- transports ---------------------------------------------------------------------------------
    async def _two_calls(self, plan: StepPlan) -> Ran | None:
        """draft.propose, then target.verify. None: the draft failed (it is out now)."""
        seqs, proposal, in_workers = plan.seqs, empty_proposal(len(plan.seqs)), 0.0
        if plan.gamma > 0:
            try:
                reply = await self.calls.call("draft", self.draft.propose, seqs, "draft_len", lambda: (
                    plan.draft_rows(), plan.gamma, plan.sampling, plan.draft_uniforms, True, plan.num_draft),
                    retry=False)
            except Exception as err:
                # Any draft failure (dead, restarting, hung, out of memory, a bug): the step is planned
                # again without it. Greedy rows are unaffected; seeded sampled rows draw fresh numbers
                # (same distribution, another sample).
                self.draft_failed(seqs, err)
                return None
            proposal, in_workers = reply.result, reply.seconds
        return await self._verify(plan, proposal, in_workers)

    async def _verify(self, plan: StepPlan, proposal: Proposal, in_workers: float = 0.0) -> Ran | None:
        """target.verify of a proposal; None: the draft worker died holding its q."""
        try:  # q, when there is one, goes from the draft's object store to the target (wire.SharedProbs)
            reply = await self.calls.call("target", self.target.verify, plan.seqs, "target_len", lambda: (
                plan.target_rows(), proposal.tokens, proposal.probs, verified_counts(plan.num_draft, proposal),
                plan.sampling, plan.accept_uniforms, plan.final_uniforms))
        except (ray.exceptions.ObjectLostError, QGone) as err:  # plan again without it
            self.draft_failed(plan.seqs, err)
            return None
        return Ran(proposal, reply.result, in_workers + reply.seconds, "calls")

    async def _predictions(self, plan: StepPlan) -> Ran | None:
        """A step planned while the draft is out (`outage`): its rows' predicted runs, drafted here
        with no draft cache (their draft marks stay: the draft catches up once back), verified."""
        drafted = self._predicted.propose(plan.target_rows(), plan.gamma, plan.sampling, plan.draft_uniforms)
        return await self._verify(plan, dataclasses.replace(drafted, draft_cached=False))

    async def _fused(self, plan: StepPlan) -> Ran | None:
        """A colocated drafter's step as one plain call to the target worker (propose, then
        verify); None when that call failed or was late: the caller then reruns this very step as
        two calls (same plan, same random numbers), whose recovery takes over."""
        call = lambda: (step_call(plan),)
        deadline = lambda c: (self.calls.deadline("draft", c.draft_rows, c.gamma)
                              + self.calls.deadline("target", c.target_rows, c.gamma))
        try:
            reply = await self.calls.call("target", self.target.fused_step, plan.seqs, "target_len", call,
                                          retry=False, deadline=deadline)
        except Exception as err:  # a late reply is dropped: the resent rows overwrite what it cached
            logger.warning("fused step failed (%s): rerunning it as two calls", type(err).__name__)
            return None
        return Ran(reply.result.proposal, reply.result.verdict, reply.seconds, "fused")

    async def _on_graph(self, plan: StepPlan) -> Ran | None:
        """The plan as compiled-graph executions; None when the graph cannot run it (`graph_execute`)."""
        reply = await self.graph_execute(plan.seqs, lambda: step_call(plan), plan.gamma)
        if reply is None:
            return None
        return Ran(reply.proposal, reply.verdict, reply.draft_seconds + reply.target_seconds, "graph")

    async def graph_step(self, plan: StepPlan, policy: SpeculationPolicy, began: float) -> list[StepOutput] | None:
        """A step already planned, on the graph alone (the pipelined loop's step that prepares
        nothing); None when the graph cannot run it."""
        ran = await self._on_graph(plan)
        return None if ran is None else finish(plan, ran, policy, began, self)

    # -- records ------------------------------------------------------------------------------------
    def record(self, record: StepRecord, plan: StepPlan, verdict) -> None:
        self.records.append(record)
        if self.draft_worker is None or self.draft_ok:
            self._drafted.append(plan.gamma > 0)
        self.totals["steps"] += 1
        # prompt chunks the verify took (a first step's, `folding`), as the prefill calls count theirs
        self.totals["prefill_tokens"] += sum(f.tokens for f in verdict.forwards if f.prefill)
        num_draft = plan.num_verified.tolist()
        drafted, accepted = sum(num_draft), sum(verdict.num_accepted)
        self.totals["spec_decode_num_draft_tokens"] += drafted
        self.totals["spec_decode_num_accepted_tokens"] += accepted
        m = self.metrics
        m.inc(m.num_drafts, sum(1 for g in num_draft if g > 0))
        m.inc(m.num_draft_tokens, drafted)
        m.inc(m.num_accepted_tokens, accepted)
        per_pos = [0] * max(num_draft, default=0)
        for a in verdict.num_accepted:
            for j in range(a):
                per_pos[j] += 1
        for j, count in enumerate(per_pos):
            m.inc(m.accepted_per_pos, count, position=str(j))
        predicted, kept = plan.predicted_kept  # (predicted outputs: the requests' own predictions)
        self.totals["spec_decode_num_prediction_tokens"] += predicted
        self.totals["spec_decode_num_accepted_prediction_tokens"] += kept
        m.inc(m.num_prediction_tokens, predicted)
        m.inc(m.num_accepted_prediction_tokens, kept)
        recalled, kept = plan.recalled_kept  # (drafts recalled from earlier answers, `speculation.history`)
        self.totals["spec_decode_num_recalled_tokens"] += recalled
        self.totals["spec_decode_num_accepted_recalled_tokens"] += kept
        m.inc(m.num_recalled_tokens, recalled)
        m.inc(m.num_accepted_recalled_tokens, kept)
        if drafted:
            total = self.totals["spec_decode_num_draft_tokens"]
            m.set(m.acceptance_rate, self.totals["spec_decode_num_accepted_tokens"] / total)

    # -- the draft side going out and coming back ---------------------------------------------------
    def draft_failed(self, seqs: list[Sequence], err: Exception) -> None:
        """A propose failed: adopt what a late reply cached, and go target-only."""
        if isinstance(err, WorkerTimeout) and err.late is not None:
            asyncio.get_running_loop().create_task(
                self._adopt_late_draft(err.late, {s.request_id: s.num_tokens for s in seqs}))
        self.draft_lost(err)

    async def _adopt_late_draft(self, late, num_tokens: dict[str, int]) -> None:
        """A propose reply that missed its deadline but arrives: the draft did cache those rows'
        tokens, so move their marks up and the next propose does not prefill them again."""
        try:
            reply: Reply = await late
        except Exception:
            return
        if reply.misses:
            return
        for rid, n in num_tokens.items():
            seq = self.admission.running.get(rid)
            if seq is not None and seq.draft_len < n:
                seq.draft_len = n

    def draft_lost(self, err: Exception) -> None:
        """Go target-only until the draft answers again (a background probe), then speculate again."""
        if self.draft_ok:
            logger.warning("draft worker failed (%s: %s): target-only steps until it answers again",
                           type(err).__name__, err)
        self.draft_ok = False
        if self.draft_worker is not None:  # it may be dead: rebuild the graph once it answers again
            self.discard_graph("draft failure")
        self.metrics.set(self.metrics.draft_available, 0.0)
        if self._draft_watch is None or self._draft_watch.done():
            self._draft_watch = asyncio.get_running_loop().create_task(self._watch_draft())

    async def _watch_draft(self) -> None:
        """Probe the draft until it answers; a separate draft worker that stays silent for
        health_misses probes is hung and is killed for Ray to restart it (once per outage)."""
        delay, misses, killed = self.probe_delay_s, 0, False
        while True:
            if await answers(self.draft, self.deadlines.health_probe_s):
                break
            misses += 1
            if misses >= self.deadlines.health_misses and not killed and self.draft_worker is not None:
                logger.error("draft worker unanswered for %d probes: killing it for a restart", misses)
                self.totals["worker_restarts"] += 1
                ray.kill(self.draft_worker, no_restart=False)
                killed = True
            await asyncio.sleep(delay)
            delay = min(2 * delay, 5.0)
        logger.warning("draft worker back: speculation resumes")
        self._handshake_again()  # a restarted draft worker starts without placement
        self.draft_ok = True
        self.metrics.set(self.metrics.draft_available, 1.0)

    def _worker_restarts(self, why: str) -> None:
        self.discard_graph(why)
        self._handshake_again()

    def _handshake_again(self) -> None:
        """Make the placement handshake due, where there is a separate draft worker to place q."""
        if self.config.speculation.place_q and self.draft_worker is not None:
            self._q_handshake_due = True

    async def _place_q(self) -> None:
        """The placement handshake (serve/placed_q.py): the draft worker places a probe, the target
        reads it, and the draft places q from then on only if the target read it exactly. Any
        failure leaves q crossing as before (a draft worker that fails is asked again once back).
        It runs before the step, not beside it: on the compiled graph, a probe holding the draft
        worker's lock (its first segment starts a resource tracker) made the step's draft side
        late, which broke the graph."""
        self._q_handshake_due = False

        async def handshake() -> bool:
            probe = await self.draft_worker.q_offer.remote()
            placing = probe is not None and await self.target.q_accept.remote(probe)
            await self.draft_worker.q_placed.remote(placing)
            return placing

        try:
            placing = await asyncio.wait_for(handshake(), self.deadlines.health_probe_s)
        except Exception as err:
            logger.warning("q placement handshake failed (%s: %s): q crosses through the host",
                           type(err).__name__, err)
            placing = False
            try:
                self.draft_worker.q_placed.remote(False)  # (not waited for: it may be the one not answering)
            except Exception:
                pass
        if placing != self.q_placed:
            logger.info("q of sampled rows %s", "read in place by the target" if placing else "crosses through the host")
        self.q_placed = placing

    # -- the compiled graph -------------------------------------------------------------------------
    def _build_graph_at_start(self) -> None:
        """Compile the step graph now, so that no request pays for it (else the keeper retries)."""
        try:
            self.graph.build()
        except Exception as err:
            logger.warning("compiled graph build failed (%s: %s): plain actor calls meanwhile", type(err).__name__, err)

    def keep_graph(self) -> None:
        """Start the graph's keeper (on the running event loop) unless it runs or there is no graph."""
        if self.graph is not None and (self._graph_task is None or self._graph_task.done()):
            self._graph_task = asyncio.get_running_loop().create_task(self._keep_graph())

    def discard_graph(self, why: str) -> None:
        if self.graph is not None:
            self.graph.discard(why)

    def graph_ready(self, drafting: bool = False) -> bool:
        """Whether this step runs on the compiled graph: configured and built, and either the
        target's graph alone for a step without drafts, or the pair's with the draft side usable."""
        graph = self.graph
        if graph is None or not graph.ready:
            return False
        if graph.solo:
            return not drafting
        return self.draft_worker is None or self.draft_ok

    def graph_solo(self) -> bool:
        """Whether the graph is (to be) the target's alone while a draft worker exists."""
        return self.graph is not None and self.graph.solo

    def maybe_reshape(self) -> None:
        """Give the graph the target alone while the policy keeps drafting off, and the pair's
        again once the steps draft (see `_SOLO_WINDOW`)."""
        if self.draft_worker is None or time.monotonic() - self._reshaped_at < _RESHAPE_EVERY_S:
            return
        graph, recent = self.graph, list(self._drafted)
        if graph.solo:
            recent = recent[-_PAIR_WINDOW:]
            wanted = not (len(recent) == _PAIR_WINDOW and sum(recent) >= _PAIR_SHARE * _PAIR_WINDOW)
        else:
            wanted = len(recent) == _SOLO_WINDOW and sum(recent) <= _SOLO_SHARE * _SOLO_WINDOW
        if wanted != graph.solo:
            graph.reshape(wanted)
            self._drafted.clear()
            self._reshaped_at = time.monotonic()

    async def _keep_graph(self) -> None:
        """Rebuild a broken step graph (on its own thread) once both workers answer again: while
        no request has run for a keeper period (a build stalls the workers' ordinary calls for 1-2 s),
        or under traffic after `_GRAPH_REBUILD_BUSY_S` seconds on plain calls."""
        idle_ticks, broken_ticks = 0, 0
        while True:
            await asyncio.sleep(_GRAPH_KEEPER_PERIOD_S)
            graph = self.graph
            if graph.ready:
                self.maybe_reshape()
            idle = not self.admission.running and not self.admission.waiting
            idle_ticks = idle_ticks + 1 if idle else 0
            broken_ticks = 0 if graph.ready else broken_ticks + 1
            solo = graph.solo
            if graph.ready or not graph.may_rebuild() or (not solo and self.draft_worker is not None
                                                          and not self.draft_ok):
                continue
            if not graph.reshaping and idle_ticks < 2 and broken_ticks * _GRAPH_KEEPER_PERIOD_S < _GRAPH_REBUILD_BUSY_S:
                continue
            workers = [self.target] + ([self.draft_worker] if self.draft_worker is not None and not solo else [])
            if not all(await asyncio.gather(*(answers(w, self.deadlines.health_probe_s) for w in workers))):
                continue
            try:
                await graph.rebuild()
            except Exception as err:
                logger.warning("compiled graph build failed (%s: %s): plain actor calls meanwhile",
                               type(err).__name__, err)

    async def _draft_busy(self) -> bool:
        """Whether the draft worker is still in its graph_propose (waiting for its lock included),
        or does not answer: asked when a graph execution passes the draft's deadline."""
        try:
            return await asyncio.wait_for(asyncio.ensure_future(self.draft_worker.proposing.remote()), _BUSY_PROBE_S)
        except Exception:
            return True

    async def graph_execute(self, seqs: list[Sequence], make_call, width: int,
                            ahead_timeout: float = 0.0, ahead_expected: float = 0.0) -> StepReply | None:
        """Execute make_call()'s StepCall on the graph, again after cache misses (whose marks it
        moves back, as `WorkerCalls.call` does); width: G of the verified block; ahead_*: the seconds
        the ahead call beside the verify may take and should take (pipelined). None when the graph
        cannot run it (a worker method raised, the graph broke, or the draft was late: then the
        draft is out), and the caller's recovery takes over."""
        by_id = {s.request_id: s for s in seqs}
        for _ in range(CALL_ATTEMPTS):
            call = make_call()
            draft_s = self.predicted("draft", call.draft_rows, call.gamma) if call.gamma else 0.0
            target_s = self.predicted("target", call.target_rows, width)
            draft_timeout = self.calls.allowed("draft", draft_s) if call.gamma else 0.0
            target_timeout = self.calls.allowed("target", target_s)
            busy = self._draft_busy if self.draft_worker is not None and call.gamma else None
            if self.draft_worker is not None:
                call = self._with_draft_nap(call, target_s, target_timeout)
            try:
                reply = await self.graph.run(call, draft_timeout, target_timeout, busy, ahead_timeout,
                                             draft_s + max(target_s, ahead_expected))
            except DraftLate as err:
                self.draft_lost(err)
                return None
            except Exception as err:
                logger.warning("compiled-graph step failed (%s): rerunning it on plain actor calls", type(err).__name__)
                return None
            for rid, valid in reply.draft_misses.items():
                by_id[rid].draft_len = valid
            for rid, valid in reply.target_misses.items():
                by_id[rid].target_len = valid
            if reply.verdict is not None:
                return reply
        return None

    def predicted(self, side: str, rows: list[RowInput], extra=None) -> float:
        """Seconds the measured costs predict for a call (`WorkerCalls.predicted`)."""
        return self.calls.predicted(side, rows, extra)

    def _with_draft_nap(self, call: StepCall, target_s: float, target_timeout: float) -> StepCall:
        """The call with the draft side's nap (a pair's graph): in a step that drafts nothing it
        sleeps through the target's forward, for what the coordinator itself would sleep
        (`StepGraph.nap`; at most half the target's allowance, so the nap alone never makes a
        step late), instead of answering at once and spinning a core in its graph loop's read of
        the next step (measured on 2 cores: that cost a target-only graph ~9%)."""
        if call.gamma > 0 or call.block is not None:
            return call
        return dataclasses.replace(call, draft_nap_s=min(self.graph.nap(target_s), 0.5 * target_timeout))


def step_call(plan: StepPlan) -> StepCall:
    """A sequential step's worker inputs, for one call or one graph execution."""
    return StepCall(plan.draft_rows(), plan.gamma, plan.sampling, plan.draft_uniforms, plan.target_rows(),
                    plan.num_draft, plan.accept_uniforms, plan.final_uniforms)

