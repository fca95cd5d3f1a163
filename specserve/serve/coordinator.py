"""The coordinator deployment: owns one draft+target worker pair, batches every request routed to it.

One replica = one placement group [coordinator, target worker, draft worker] (Serve's
`placement_group_bundles`), so autoscaling the coordinator scales whole groups. The replica holds
the truth (each request's `Sequence`: tokens, sampling params, random stream, cache marks); the
workers hold KV caches. An asyncio loop runs the engine's step protocol remotely:

    await target.prefill + draft.prefill (new prompts' next chunks, both at once; chunked prefill)
    plan_step -> await draft.propose -> await target.verify -> apply_verdict -> policy.observe_*

With `speculation.transport: compiled_graph` the propose -> verify pair is one Ray Compiled Graph
execution (serve/graph.py: the proposal goes draft -> target directly; plain actor calls while
the graph is broken).

Requests join (admission up to max_batch_size) and leave (finish, abort) between steps. The maths
is the engine's (`specserve.engine.step`); this file only moves data and futures around.

Overload and memory (`admission.Admission`): at most `max_queued_requests` wait for the running
batch (beyond: `Rejected` with code "queue_full", which the ingress answers with 429 + Retry-After);
with `max_cached_tokens` set, a request joins only while what the workers' dense caches would
allocate for the batch with it (running x one capacity for the longest) fits the budget.

Deadlines: every worker call has one, sized to the tokens it carries from the measured per-token
costs (`Deadlines`); every request has one (`request_timeout_s`, a `Failed` with code
"request_timeout" when it passes). Worker failures: a TargetWorker that dies is restarted by Ray
and the step waits for it; one that misses its deadline is killed and restarted
(`ray.kill(..., no_restart=False)`); either way the target re-prefills every running request from
the coordinator's tokens (cache misses). A draft that fails in any way (dies, hangs, raises) does
not stall anyone: steps run target-only (γ = 0, still the target's own tokens) until a background
probe sees it answer, then speculation resumes and the draft rebuilds its caches. A step that fails
otherwise is retried row by row, so that only the requests it really fails on get a `Failed`
(a generic message with an error id; the exception goes to the log under that id).
`check_health` fails after `deadlines.health_misses` unanswered probes in a row, and Serve
replaces the whole group.

A lost replica's requests are continued by the ingress on another one (serve/continuation.py): a
`GenerateRequest.resume` carries the tokens already delivered (and a seeded request's random
stream, from `Delta.rng_state`); `_continue` makes them the new Sequence's output.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import statistics
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import AsyncIterator

import ray
import torch
from ray import serve
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from specserve.config import AppConfig, Resources
from specserve.engine import RowInput
from specserve.engine.admission import Admission
from specserve.engine.sampling import SamplingParams
from specserve.engine.scheduler import OverlappedPolicy, SpeculationPolicy, TokenCost
from specserve.engine.step import (
    ContextLengthExceeded, InvalidPrompt, Sequence, StepOutput, StepPlan, advance_marks, empty_proposal, finish_step,
    new_sequence, plan_step, prefill_rows, prefilling, verified_counts,
)
from specserve.engine.verifier import Verdict

from .graph import DraftLate, StepCall, StepGraph, StepReply
from .metrics import CoordinatorMetrics
from .pipeline import Pipeline
from .workers import DraftWorker, TargetWorker
from .wire import Reply

logger = logging.getLogger("specserve.coordinator")
WORKER_NAMESPACE = "specserve"
_CALL_ATTEMPTS = 4
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


# -- messages between ingress and coordinator ------------------------------------------------------
@dataclass(frozen=True)
class Resume:
    """A request continued here after the replica that ran it was lost (see serve/continuation.py)."""

    generated: tuple[int, ...]  # output tokens already generated and delivered (count toward max_tokens)
    rng_state: bytes | None = None  # the request's random stream after them (seeded sampling; Delta.rng_state)


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # as first sent: max_tokens counts the generated tokens of a `resume` too
    num_speculative_tokens: int | None = None  # per-request cap on γ (<= the configured one)
    resume: Resume | None = None  # a continuation: never refused as queue_full (it is not new load)


@dataclass(frozen=True)
class Accepted:
    num_prompt_tokens: int


@dataclass(frozen=True)
class Rejected:
    message: str
    code: str  # "context_length_exceeded" | "invalid_prompt" | "duplicate_request_id" | "queue_full"


@dataclass(frozen=True)
class Delta:
    token_ids: list[int]  # new tokens since the last Delta
    finish_reason: str | None
    num_draft_tokens: int  # running totals for the request
    num_accepted_tokens: int
    num_steps: int
    # seeded sampling only: the request's generator state after these tokens, so that a
    # continuation on another replica draws the numbers this one would have drawn
    rng_state: bytes | None = None


@dataclass(frozen=True)
class Failed:
    message: str  # for the client: no internal text (the log has the details under the error id)
    code: str = "engine_error"  # | "request_timeout"


@dataclass(frozen=True)
class StepRecord:
    wall: float  # seconds, plan to apply
    forward: float  # seconds in model forwards (draft + target verify)
    in_workers: float  # seconds inside the worker methods
    batch: int
    positions: int  # G


class WorkerTimeout(RuntimeError):
    """A worker call missed its deadline; `late` is its reply still on the way (an ObjectRef)."""

    def __init__(self, message: str, late=None) -> None:
        super().__init__(message)
        self.late = late


# -- the deployment ------------------------------------------------------------------------------
@serve.deployment(ray_actor_options={"num_cpus": 0.1})
class Coordinator:
    target_worker_class, draft_worker_class = TargetWorker, DraftWorker  # (a benchmark swaps in its own)

    def __init__(self, config: AppConfig) -> None:
        self.config = config
        self.deadlines = config.deadlines
        self.max_gamma = config.speculation.num_speculative_tokens
        tag = _replica_tag()
        threads = config.target_worker.torch_threads
        self.target = _actor(self.target_worker_class, config.target_worker, 1, f"{tag}:target").remote(
            config.target, config.max_model_len, threads, config.drafter, execution=config.speculation.execution)
        info = ray.get(self.target.info.remote())
        self.vocab_size, self.eos_token_ids = info.vocab_size, info.eos_token_ids
        limits = [config.max_model_len, info.max_positions]
        self.draft = None  # the remote methods of the draft side (ProposerSide), if anything drafts
        self.draft_worker = None  # the DraftWorker actor, if the draft side is one (else: the target)
        if config.has_draft_worker:  # a draft model, or a feature head that pulls from this target
            head = config.drafter if config.draft is None else None
            self.draft_worker = _actor(self.draft_worker_class, config.draft_worker, 2, f"{tag}:draft").remote(
                config.draft or config.target, info.vocab_size, config.max_model_len,
                config.draft_worker.torch_threads, execution=config.speculation.execution, feature_head=head,
                target=self.target if head is not None else None)
            self.draft = ProposerSide.of_draft_worker(self.draft_worker)
        elif config.drafter is not None:
            self.draft = ProposerSide.colocated(self.target)
        if self.draft is not None:
            limits.append(ray.get(self.draft.max_positions.remote()))
        self.max_model_len = min(x for x in limits if x) if any(limits) else 1 << 30
        # a drafter inside the target worker drafts and verifies in one call (`_fused_step`)
        self.fused = self.draft is not None and self.draft_worker is None
        if config.speculation.pipelined:
            # rejection-point branches need the graph (the draft side forks its caches) and a draft model
            branching = config.speculation.transport == "compiled_graph" and config.draft is not None
            self.policy = OverlappedPolicy(self.max_gamma, adaptive=config.speculation.adaptive,
                                           max_branches=config.speculation.branches if branching else 0)
        else:
            self.policy = SpeculationPolicy(self.max_gamma, adaptive=config.speculation.adaptive, fused=self.fused)
        # measured costs start γ (adaptive) and size every worker call's deadline
        self.policy.calibrate_costs("target", ray.get(self.target.time_forwards.remote()))
        if self.draft is not None:
            self.policy.calibrate_costs("draft", ray.get(self.draft.time_forwards.remote()))
        self.admission = Admission(config.max_batch_size, config.max_cached_tokens, self.max_gamma)
        self._queues: dict[str, asyncio.Queue] = {}
        self._aborted: set[str] = set()
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._records: deque[StepRecord] = deque(maxlen=4096)
        self._totals = {"spec_decode_num_draft_tokens": 0, "spec_decode_num_accepted_tokens": 0, "steps": 0,
                        "target_only_steps": 0, "rejected_queue_full": 0, "running_peak": 0,
                        "reserved_tokens_peak": 0, "worker_restarts": 0, "requests_failed": 0,
                        "requests_timed_out": 0, "prefill_tokens": 0, "graph_steps": 0,
                        "fused_steps": 0}
        # draft failure: target-only steps while the draft restarts
        self._draft_ok = self.draft is not None
        self._draft_watch: asyncio.Task | None = None
        self._target_only = SpeculationPolicy(0, adaptive=False)
        self._health_misses = {"target": 0, "draft": 0}
        # metrics: arrival and last-emission times per request (TTFT, inter-token latency)
        self.metrics = CoordinatorMetrics(config.served_model_name)
        self.metrics.set(self.metrics.draft_available, float(self._draft_ok))
        self._timing: dict[str, list[float | None]] = {}
        # draft block k+1 while the target verifies block k (speculation.pipelined; needs a DraftWorker)
        self.pipeline = Pipeline(self) if config.speculation.pipelined and self.draft_worker is not None else None
        # the step's two worker calls as one compiled-graph execution (serve/graph.py)
        self.graph = None
        self._graph_task: asyncio.Task | None = None
        self._drafted: deque[bool] = deque(maxlen=_SOLO_WINDOW)  # recent steps with the draft up: whether each drafted
        self._reshaped_at = -_RESHAPE_EVERY_S  # time.monotonic() of the graph's last reshape
        if config.speculation.transport == "compiled_graph":
            self.graph = StepGraph(self.target, self.draft_worker, ahead=self.pipeline is not None)
            self._build_graph_at_start()

    def _build_graph_at_start(self) -> None:
        """Compile the step graph now, so that no request pays for it (else the keeper retries)."""
        try:
            self.graph.build()
        except Exception as err:
            logger.warning("compiled graph build failed (%s: %s): plain actor calls meanwhile", type(err).__name__, err)

    # -- API (called through DeploymentHandles) ---------------------------------------------------
    def info(self) -> dict:
        return {"max_model_len": self.max_model_len, "vocab_size": self.vocab_size,
                "num_speculative_tokens": self.max_gamma}

    async def ready(self) -> bool:
        """Readiness, for the ingress's /health: a replica answers only once its constructor ran,
        i.e. both workers loaded their models and ran forwards (`time_forwards`): a request sent now
        is served at once. (Answered on the event loop, never behind a worker call.)"""
        return True

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Accepted | Rejected | Delta | Failed]:
        """Stream: Accepted (or Rejected, then end), then Deltas until one has a finish_reason, or a
        Failed (an engine error, or the request's deadline passed).

        Cancelling the stream (client gone, stop string hit) aborts the request and frees its caches."""
        self._ensure_loop()
        arrival = time.monotonic()
        seq_or_rejection = self._check_new(request)
        if isinstance(seq_or_rejection, Rejected):
            yield seq_or_rejection
            return
        seq, rid = seq_or_rejection, request.request_id
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        # a continuation's first token is not a time to first token
        self._timing[rid] = [arrival, arrival if request.resume else None]
        self.admission.enqueue(seq)
        if request.resume is None:
            self.metrics.inc(self.metrics.prompt_tokens, len(seq.prompt))
        self._wake.set()
        finished = False
        deadline = arrival + self.config.request_timeout_s
        try:
            yield Accepted(len(seq.prompt))
            while not finished:
                try:
                    first = await asyncio.wait_for(queue.get(), timeout=max(deadline - time.monotonic(), 0.0))
                except asyncio.TimeoutError:
                    self._totals["requests_timed_out"] += 1
                    yield Failed(f"the request did not finish within {self.config.request_timeout_s:g} s; "
                                 "retry it with fewer max_tokens or later", "request_timeout")
                    return
                item = _merge([first] + _drain(queue))
                finished = isinstance(item, Failed) or item.finish_reason is not None
                yield item
        finally:
            self._queues.pop(rid, None)
            self._timing.pop(rid, None)
            if not finished:
                self._aborted.add(rid)
                self._wake.set()

    def _check_new(self, request: GenerateRequest) -> Sequence | Rejected:
        """A new request as a Sequence, or why it is refused (before anything is allocated)."""
        rid = request.request_id
        if rid in self._queues:
            return Rejected(f"request id {rid!r} is already in use", "duplicate_request_id")
        try:
            seq = new_sequence(rid, request.prompt_token_ids, request.params, vocab_size=self.vocab_size,
                               max_model_len=self.max_model_len, eos_token_ids=self.eos_token_ids,
                               max_gamma=request.num_speculative_tokens)
            if request.resume is not None:
                _continue(seq, request.resume, self.vocab_size)
        except (InvalidPrompt, ContextLengthExceeded) as err:
            code = "context_length_exceeded" if isinstance(err, ContextLengthExceeded) else "invalid_prompt"
            return Rejected(str(err), code)
        if self.admission.too_big(seq):
            return Rejected(f"prompt ({len(seq.prompt)} tokens) + max_tokens ({seq.params.max_tokens}) needs more "
                            f"KV cache than the budget of {self.admission.budget} token positions",
                            "context_length_exceeded")
        self._admit()  # (so that `waiting` counts only requests that really must wait)
        waiting = len(self.admission.waiting)
        if waiting >= self.config.max_queued_requests and request.resume is None and not self.admission.fits_now(seq):
            self._totals["rejected_queue_full"] += 1
            self.metrics.inc(self.metrics.request_rejected, 1, reason="queue_full")
            return Rejected(f"the server is overloaded ({waiting} requests waiting); retry later", "queue_full")
        return seq

    async def num_cached(self) -> dict[str, int]:
        """Requests holding a cache slot on each worker (0 after every request finished or aborted)."""
        counts = {"target": await self.target.num_cached.remote()}
        if self.draft is not None:
            counts["draft"] = await self.draft.num_cached.remote()
        return counts

    async def check_health(self) -> None:
        """Called by Serve: each worker actor (once, even when the draft side is the target) must
        answer a probe within `deadlines.health_probe_s`; after `deadlines.health_misses` misses in a
        row this raises, and Serve replaces the whole group. A slow or restarting worker that answers
        again in time resets its count."""
        workers = {"target": self.target}
        if self.draft_worker is not None:
            workers["draft"] = self.draft_worker
        answered = await asyncio.gather(*(self._answers(w, self.deadlines.health_probe_s) for w in workers.values()))
        for name, ok in zip(workers, answered):
            self._health_misses[name] = 0 if ok else self._health_misses[name] + 1
        stuck = [name for name in workers if self._health_misses[name] >= self.deadlines.health_misses]
        if stuck:
            raise RuntimeError(f"{' and '.join(stuck)} worker unanswered for {self.deadlines.health_misses} "
                               "health checks in a row")

    @staticmethod
    async def _answers(actor, timeout: float) -> bool:
        try:
            await asyncio.wait_for(asyncio.ensure_future(actor.ready.remote()), timeout=timeout)
            return True
        except (asyncio.TimeoutError, RayActorError):
            return False

    async def memory(self) -> dict:
        """Resident memory (bytes) of this replica's process and workers, and the workers' KV-cache
        storage; a worker that does not answer within 1 s (busy with a long step, restarting) is
        left out, so that stats never wait behind generation."""
        from .workers import _rss_bytes

        workers = {"target": self.target}
        if self.draft_worker is not None:
            workers["draft"] = self.draft_worker

        async def ask(actor):
            try:
                return await asyncio.wait_for(asyncio.ensure_future(actor.memory.remote()), timeout=1.0)
            except (asyncio.TimeoutError, RayActorError):
                return None

        out: dict = {"coordinator": {"rss_bytes": _rss_bytes()}}
        for name, answer in zip(workers, await asyncio.gather(*(ask(w) for w in workers.values()))):
            if answer is not None:
                out[name] = answer
        return out

    async def stats(self) -> dict:
        """This replica's step timings (p50 over the last <= 4096 steps), speculation totals, admission
        state and memory."""
        recs = list(self._records)
        out = {"replica": _replica_tag(), "running": len(self.admission.running),
               "waiting": len(self.admission.waiting), **self._totals, "draft_available": self._draft_ok,
               "reserved_tokens": self.admission.allocated(), "max_cached_tokens": self.admission.budget,
               "max_queued_requests": self.config.max_queued_requests,
               "kv_cache_usage_tokens": self._kv_usage(), "memory": await self.memory(),
               "transport": "compiled_graph" if self.graph is not None else "actor_calls"}
        if self.graph is not None:
            out.update(graph_ready=self.graph.ready, graph_builds=self.graph.builds, graph_breaks=self.graph.breaks,
                       graph_solo=self.graph.solo, graph_reshapes=self.graph.reshapes)
        if recs:
            out.update({
                "step_wall_p50_ms": 1e3 * statistics.median(r.wall for r in recs),
                "forward_p50_ms": 1e3 * statistics.median(r.forward for r in recs),
                "overhead_p50_ms": 1e3 * statistics.median(r.wall - r.forward for r in recs),
                "rpc_overhead_p50_ms": 1e3 * statistics.median(r.wall - r.in_workers for r in recs),
                "batch_mean": statistics.fmean(r.batch for r in recs),
                "positions_mean": statistics.fmean(r.positions for r in recs),
            })
        return out

    def reset_stats(self) -> None:
        self._records.clear()
        self._totals = dict.fromkeys(self._totals, 0)

    # -- the step loop ------------------------------------------------------------------------
    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._loop())
        if self.graph is not None and (self._graph_task is None or self._graph_task.done()):
            self._graph_task = asyncio.get_running_loop().create_task(self._keep_graph())

    async def _loop(self) -> None:
        while True:
            self._drop_aborted()
            self._admit()
            if not self.admission.running:
                self._wake.clear()
                await self._wake.wait()
                continue
            seqs = list(self.admission.running.values())
            try:
                outputs = await self._iteration(seqs)
            except Exception as err:  # a worker dead for good, a bad row, a bug: fail only whom it fails
                outputs = await self._isolate(seqs, err)
            self._publish(outputs)
            self._update_gauges()

    async def _isolate(self, seqs: list[Sequence], err: Exception) -> list[StepOutput]:
        """After a failed step: retry each request alone (target-only), failing only those that fail
        again. A dead target fails them all at once (each retry would too)."""
        if len(seqs) == 1 or isinstance(err, RayActorError):
            self._fail(seqs, err)
            return []
        logger.warning("step over %d requests failed (%s): retrying them one by one", len(seqs), type(err).__name__)
        outputs = []
        for seq in seqs:
            if seq.request_id not in self.admission.running or seq.request_id in self._aborted:
                continue
            try:
                outputs += await self._step([seq], self._target_only)
            except Exception as row_err:
                self._fail([seq], row_err)
        return outputs

    def _admit(self) -> None:
        """FIFO into the running batch while it has room and the KV-cache budget allows."""
        self.admission.admit()
        totals = self._totals
        totals["running_peak"] = max(totals["running_peak"], len(self.admission.running))
        totals["reserved_tokens_peak"] = max(totals["reserved_tokens_peak"], self.admission.allocated())
        self._update_gauges()

    def _kv_usage(self) -> dict[str, int]:
        running = self.admission.running.values()
        usage = {"target": sum(s.target_len for s in running)}
        if self.draft is not None:
            usage["draft"] = sum(s.draft_len for s in running)
        return usage

    def _update_gauges(self) -> None:
        m, budget, allocated = self.metrics, self.admission.budget, self.admission.allocated()
        m.set(m.running, len(self.admission.running))
        m.set(m.waiting, len(self.admission.waiting))
        for worker, tokens in self._kv_usage().items():
            m.set(m.kv_usage, tokens, worker=worker)
        m.set(m.kv_reserved, allocated)
        m.set(m.kv_usage_perc, allocated / budget if budget else 0.0)

    async def _iteration(self, seqs: list[Sequence]) -> list[StepOutput]:
        """This step's prompt chunks (chunked prefill), then one speculative step over the requests
        whose prompts both caches hold (the target's alone while the draft is down)."""
        ready = seqs
        if self.config.prefill_chunk_tokens:
            await self._prefill(seqs, self.config.prefill_chunk_tokens)
            with_draft = self.draft is not None and self._draft_ok
            ready = [s for s in seqs if not prefilling(s, with_draft)]
        return await self._step(ready, self.policy) if ready else []

    async def _prefill(self, seqs: list[Sequence], budget: int) -> None:
        """Send each worker its chunks of at most `budget` prompt tokens (FIFO, `prefill_rows`), the
        two workers at once. A draft failure only turns the draft off (as in a step); a target
        failure is raised once both calls are over, so that no mark moves after the caller moved on."""
        calls = [self._prefill_side("target", self.target.prefill, seqs, "target_len", budget)]
        if self.draft is not None and self._draft_ok:
            calls.append(self._prefill_side("draft", self.draft.prefill, seqs, "draft_len", budget, retry=False))
        results = await asyncio.gather(*calls, return_exceptions=True)
        if len(results) > 1 and isinstance(results[1], Exception):
            self._draft_lost(results[1])
        if isinstance(results[0], BaseException):
            raise results[0]

    async def _prefill_side(self, side: str, method, seqs: list[Sequence], mark: str, budget: int,
                            retry: bool = True) -> None:
        """One worker's prefill call: rows planned from the marks (again after cache misses, which
        move marks back), then the marks moved to the ends of the chunks the worker cached."""
        sent: list[RowInput] = []

        def make_args():
            sent[:] = prefill_rows(seqs, mark, budget)
            return (list(sent),)

        if not prefill_rows(seqs, mark, budget):
            return
        await self._call(side, method, seqs, mark, make_args, retry=retry)
        advance_marks(seqs, mark, sent)
        if side == "target":
            self._totals["prefill_tokens"] += sum(len(r.tokens) for r in sent)

    async def _step(self, seqs: list[Sequence], policy: SpeculationPolicy) -> list[StepOutput]:
        if self.pipeline is not None:
            outputs = await self.pipeline.step(seqs, policy)  # None: this step runs sequentially
            if outputs is not None:
                return outputs
        began = time.perf_counter()
        if not self._draft_ok:
            policy = self._target_only
        plan = plan_step(seqs, policy)
        if self._graph_ready(drafting=plan.num_positions > 0):
            outputs = await self._graph_step(plan, policy, began)
            if outputs is not None:
                return outputs
            if not self._draft_ok:  # the draft was late in the graph: this step goes target-only
                policy = self._target_only
                plan = plan_step(seqs, policy)
        elif self.fused and plan.num_positions > 0:
            outputs = await self._fused_step(plan, policy, began)
            if outputs is not None:
                return outputs
        proposal, in_workers = empty_proposal(len(seqs)), 0.0
        if plan.num_positions > 0:
            try:
                reply = await self._call("draft", self.draft.propose, seqs, "draft_len", lambda: (
                    plan.draft_rows(), plan.num_positions, plan.sampling, plan.draft_uniforms), retry=False)
                proposal, in_workers = reply.result, reply.seconds
            except Exception as err:
                # Any draft failure (dead, restarting, hung, out of memory, a bug): re-plan this very
                # step without it. Greedy rows are unaffected; seeded sampled rows draw fresh numbers
                # (same distribution, another sample).
                if isinstance(err, WorkerTimeout) and err.late is not None:
                    asyncio.get_running_loop().create_task(
                        self._adopt_late_draft(err.late, {s.request_id: s.num_tokens for s in seqs}))
                self._draft_lost(err)
                policy = self._target_only
                plan = plan_step(seqs, policy)
        self._count_target_only(policy)
        reply = await self._call("target", self.target.verify, seqs, "target_len", lambda: (
            plan.target_rows(), proposal.tokens, proposal.probs, verified_counts(plan.num_draft, proposal),
            plan.sampling, plan.accept_uniforms, plan.final_uniforms))
        outputs = finish_step(plan, proposal, reply.result, policy, began)
        wall = time.perf_counter() - began
        self._record(StepRecord(wall, proposal.seconds + reply.result.seconds, in_workers + reply.seconds,
                                len(seqs), plan.num_positions), plan, reply.result)
        return outputs

    def _count_target_only(self, policy: SpeculationPolicy) -> None:
        if policy is self._target_only and self.draft is not None:
            self._totals["target_only_steps"] += 1
            self.metrics.inc(self.metrics.target_only_steps, 1)

    def _graph_ready(self, drafting: bool = False) -> bool:
        """Whether this step runs on the compiled graph: configured and built, and either the
        target's graph alone for a step without drafts, or the pair's with the draft side usable."""
        graph = self.graph
        if graph is None or not graph.ready:
            return False
        if graph.solo:
            return not drafting
        return self.draft_worker is None or self._draft_ok

    def _graph_solo(self) -> bool:
        """Whether the graph is (to be) the target's alone while a draft worker exists."""
        return self.graph is not None and self.graph.solo

    def _maybe_reshape(self) -> None:
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
        graph, idle_ticks, broken_ticks = self.graph, 0, 0
        while True:
            await asyncio.sleep(_GRAPH_KEEPER_PERIOD_S)
            if graph.ready:
                self._maybe_reshape()
            idle = not self.admission.running and not self.admission.waiting
            idle_ticks = idle_ticks + 1 if idle else 0
            broken_ticks = 0 if graph.ready else broken_ticks + 1
            solo = graph.solo
            if graph.ready or not graph.may_rebuild() or (not solo and self.draft_worker is not None
                                                          and not self._draft_ok):
                continue
            if not graph.reshaping and idle_ticks < 2 and broken_ticks * _GRAPH_KEEPER_PERIOD_S < _GRAPH_REBUILD_BUSY_S:
                continue
            workers = [self.target] + ([self.draft_worker] if self.draft_worker is not None and not solo else [])
            if not all(await asyncio.gather(*(self._answers(w, self.deadlines.health_probe_s) for w in workers))):
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

    async def _graph_step(self, plan: StepPlan, policy: SpeculationPolicy, began: float) -> list[StepOutput] | None:
        """The step as compiled-graph executions; None when the graph cannot run it (see
        `_graph_execute`): the caller then runs this very step on plain actor calls."""
        reply = await self._graph_execute(plan.seqs, lambda: _step_call(plan), plan.num_positions)
        if reply is None:
            return None
        self._count_target_only(policy)
        self._totals["graph_steps"] += 1
        return self._finish_one_call(plan, reply, policy, began, reply.draft_seconds + reply.target_seconds)

    async def _fused_step(self, plan: StepPlan, policy: SpeculationPolicy, began: float) -> list[StepOutput] | None:
        """A colocated drafter's step as one plain call to the target worker (propose, then
        verify); None when that call failed or was late: the caller then reruns this very step as
        two calls (same plan, same random numbers), whose recovery takes over."""
        call = lambda: (_step_call(plan),)
        deadline = lambda c: (self._deadline("draft", c.draft_rows, c.num_positions)
                              + self._deadline("target", c.target_rows, c.num_positions))
        try:
            reply = await self._call("target", self.target.fused_step, plan.seqs, "target_len", call, retry=False,
                                     deadline=deadline)
        except Exception as err:  # a late reply is dropped: the resent rows overwrite what it cached
            logger.warning("fused step failed (%s): rerunning it as two calls", type(err).__name__)
            return None
        self._totals["fused_steps"] += 1
        return self._finish_one_call(plan, reply.result, policy, began, reply.seconds)

    def _finish_one_call(self, plan: StepPlan, step: StepReply, policy: SpeculationPolicy, began: float,
                         in_workers: float) -> list[StepOutput]:
        """Apply a step that one call or graph execution ran (`step`: its proposal without q and
        verdict) and record it; in_workers: seconds inside the worker methods."""
        outputs = finish_step(plan, step.proposal, step.verdict, policy, began)
        self._record(StepRecord(time.perf_counter() - began, step.proposal.seconds + step.verdict.seconds,
                                in_workers, len(plan.seqs), plan.num_positions), plan, step.verdict)
        return outputs

    async def _graph_execute(self, seqs: list[Sequence], make_call, width: int,
                             ahead_timeout: float = 0.0, ahead_expected: float = 0.0) -> StepReply | None:
        """Execute make_call()'s StepCall on the graph, again after cache misses (whose marks it
        moves back, as `_call` does); width: G of the verified block; ahead_*: the seconds the
        ahead call beside the verify may take and should take (pipelined). None when the graph cannot
        run it (a worker method raised, the graph broke, or the draft was late: then the draft is
        out), and the caller's recovery takes over."""
        by_id = {s.request_id: s for s in seqs}
        for _ in range(_CALL_ATTEMPTS):
            call = make_call()
            draft_s = self._predicted("draft", call.draft_rows, call.num_positions) if call.num_positions else 0.0
            target_s = self._predicted("target", call.target_rows, width)
            draft_timeout = self._allowed("draft", draft_s) if call.num_positions else 0.0
            target_timeout = self._allowed("target", target_s)
            busy = self._draft_busy if self.draft_worker is not None and call.num_positions else None
            if self.draft_worker is not None:
                call = self._with_draft_nap(call, target_s, target_timeout)
            try:
                reply = await self.graph.run(call, draft_timeout, target_timeout, busy, ahead_timeout,
                                             draft_s + max(target_s, ahead_expected))
            except DraftLate as err:
                self._draft_lost(err)
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

    def _with_draft_nap(self, call: StepCall, target_s: float, target_timeout: float) -> StepCall:
        """The call with the draft side's nap (a pair's graph): in a step that drafts nothing it
        sleeps through the target's forward, for what the coordinator itself would sleep
        (`StepGraph.nap`; at most half the target's allowance, so the nap alone never makes a
        step late), instead of answering at once and spinning a core in its graph loop's read of
        the next step (measured on 2 cores: that cost a target-only graph ~9%)."""
        if call.num_positions > 0 or call.block is not None:
            return call
        return dataclasses.replace(call, draft_nap_s=min(self.graph.nap(target_s), 0.5 * target_timeout))

    async def _call(self, side: str, method, seqs: list[Sequence], mark: str, make_args, retry: bool = True,
                    deadline=None) -> Reply:
        """Call a worker ("target" or "draft") within a deadline sized to the call's tokens
        (deadline(*args) when given); on cache misses move the rows' marks back (`mark`, and the
        draft marks for a fused step's `draft_misses`) and resend. The target is waited for while
        Ray restarts it, and killed for a restart when it misses the deadline (retry=False: raise
        at once instead)."""
        by_id = {s.request_id: s for s in seqs}
        for attempt in range(_CALL_ATTEMPTS):
            args = make_args()
            timeout = self._deadline(side, *args[:2]) if deadline is None else deadline(*args)
            ref = method.remote(*args)
            try:
                reply: Reply = await asyncio.wait_for(asyncio.ensure_future(ref), timeout=timeout)
            except asyncio.TimeoutError:
                if not retry:
                    raise WorkerTimeout(f"{side} worker missed its {timeout:.1f} s deadline", ref) from None
                if attempt + 1 == _CALL_ATTEMPTS:
                    raise WorkerTimeout(f"{side} worker missed its deadline {_CALL_ATTEMPTS} times") from None
                await self._restart_target(f"missed its {timeout:.1f} s deadline")
                continue
            except RayActorError as err:
                if attempt + 1 == _CALL_ATTEMPTS or not retry:
                    raise
                logger.warning("%s worker call failed (%s); retrying once it restarts", side, type(err).__name__)
                await self._until_ready(self.target)
                continue
            if not reply.misses and not reply.draft_misses:
                return reply
            for rid, valid in reply.misses.items():
                setattr(by_id[rid], mark, valid)
            for rid, valid in reply.draft_misses.items():
                by_id[rid].draft_len = valid
        raise RuntimeError(f"{side} worker still misses caches after {_CALL_ATTEMPTS} attempts")

    def _deadline(self, side: str, rows: list[RowInput], extra=None) -> float:
        """Seconds a call may take, from the time the measured per-token costs predict for its
        tokens (`_predicted`, `_allowed`)."""
        return self._allowed(side, self._predicted(side, rows, extra))

    def _allowed(self, side: str, predicted: float) -> float:
        """Seconds a call predicted to take `predicted` seconds may take: floor + multiple x predicted."""
        d = self.deadlines
        return (d.target_floor_s if side == "target" else d.draft_floor_s) + d.multiple * predicted

    def _predicted(self, side: str, rows: list[RowInput], extra=None) -> float:
        """Seconds the measured per-token costs predict for a call's forwards, prefill backlog
        included (0 before anything was measured). extra: G drafts per row (verify: the draft
        tokens [B, G], or G; propose: G); None for a prefill call (one forward over its rows, padded)."""
        cost = self.policy.target_cost if side == "target" else self.policy.draft_cost
        if extra is None:
            return _predict(cost, len(rows) * max((len(r.tokens) for r in rows), default=0))
        backlog = sum(max(len(r.tokens) - 1, 0) for r in rows)
        if side == "target":
            width = 1 + (extra.shape[1] if hasattr(extra, "shape") else int(extra))
            return _predict(cost, backlog) + _predict(cost, len(rows) * width)
        return _predict(cost, backlog) + int(extra) * _predict(cost, len(rows))

    async def _restart_target(self, why: str) -> None:
        """Kill a stuck target for Ray to restart it; its caches rebuild from our tokens."""
        logger.error("target worker %s: killing it for a restart", why)
        self._totals["worker_restarts"] += 1
        self._discard_graph("target restart")
        ray.kill(self.target, no_restart=False)
        await self._until_ready(self.target)

    async def _until_ready(self, actor) -> None:
        """Wait until a (restarting) actor answers, up to deadlines.restart_timeout_s; then raise."""
        self._discard_graph("a worker restarts")
        give_up = time.monotonic() + self.deadlines.restart_timeout_s
        delay = 0.1
        while True:
            left = give_up - time.monotonic()
            if left <= 0:
                raise WorkerTimeout(f"worker not back within {self.deadlines.restart_timeout_s:g} s")
            try:
                await asyncio.wait_for(asyncio.ensure_future(actor.ready.remote()), timeout=left)
                return
            except asyncio.TimeoutError:
                continue
            except RayActorError:  # dying or restarting: Ray queues calls once it is restarting
                await asyncio.sleep(delay)
                delay = min(2 * delay, 2.0)

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

    def _draft_lost(self, err: Exception) -> None:
        """Go target-only until the draft answers again (a background probe), then speculate again."""
        if self._draft_ok:
            logger.warning("draft worker failed (%s: %s): target-only steps until it answers again",
                           type(err).__name__, err)
        self._draft_ok = False
        if self.draft_worker is not None:  # it may be dead: rebuild the graph once it answers again
            self._discard_graph("draft failure")
        self.metrics.set(self.metrics.draft_available, 0.0)
        if self._draft_watch is None or self._draft_watch.done():
            self._draft_watch = asyncio.get_running_loop().create_task(self._watch_draft())

    async def _watch_draft(self) -> None:
        """Probe the draft until it answers; a separate draft worker that stays silent for
        health_misses probes is hung and is killed for Ray to restart it (once per outage)."""
        delay, misses, killed = 0.2, 0, False
        while True:
            if await self._answers(self.draft, self.deadlines.health_probe_s):
                break
            misses += 1
            if misses >= self.deadlines.health_misses and not killed and self.draft_worker is not None:
                logger.error("draft worker unanswered for %d probes: killing it for a restart", misses)
                self._totals["worker_restarts"] += 1
                ray.kill(self.draft_worker, no_restart=False)
                killed = True
            await asyncio.sleep(delay)
            delay = min(2 * delay, 5.0)
        logger.warning("draft worker back: speculation resumes")
        self._draft_ok = True
        self.metrics.set(self.metrics.draft_available, 1.0)

    def _discard_graph(self, why: str) -> None:
        if self.graph is not None:
            self.graph.discard(why)

    def _record(self, record: StepRecord, plan: StepPlan, verdict: Verdict) -> None:
        self._records.append(record)
        if self.draft_worker is None or self._draft_ok:
            self._drafted.append(plan.num_positions > 0)
        self._totals["steps"] += 1
        num_draft = plan.num_verified.tolist()
        drafted, accepted = sum(num_draft), sum(verdict.num_accepted)
        self._totals["spec_decode_num_draft_tokens"] += drafted
        self._totals["spec_decode_num_accepted_tokens"] += accepted
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
        if drafted:
            total = self._totals["spec_decode_num_draft_tokens"]
            m.set(m.acceptance_rate, self._totals["spec_decode_num_accepted_tokens"] / total)

    # -- requests leaving ---------------------------------------------------------------------
    def _publish(self, outputs: list[StepOutput]) -> None:
        done, now, mx = [], time.monotonic(), self.metrics
        for out in outputs:
            timing = self._timing.get(out.request_id)
            if timing is not None and out.new_token_ids:
                arrival, last = timing
                if last is None:
                    mx.observe(mx.ttft, now - arrival)
                else:
                    for _ in out.new_token_ids:
                        mx.observe(mx.itl, (now - last) / len(out.new_token_ids))
                timing[1] = now
            mx.inc(mx.generation_tokens, len(out.new_token_ids))
            if out.finish_reason is not None:
                mx.inc(mx.request_success, 1, finished_reason=out.finish_reason)
            seq = self.admission.running[out.request_id]
            queue = self._queues.get(out.request_id)
            if queue is not None:
                m = seq.metrics
                rng = seq.generator.get_state().numpy().tobytes() if seq.reproducible else None
                queue.put_nowait(Delta(out.new_token_ids, out.finish_reason, m.num_draft_tokens,
                                       m.num_accepted_tokens, m.num_steps, rng))
            if out.finish_reason is not None:
                done.append(out.request_id)
        self._release(done)

    def _drop_aborted(self) -> None:
        if not self._aborted:
            return
        aborted, self._aborted = self._aborted, set()
        self.admission.drop_waiting(aborted)
        self._release([rid for rid in aborted if rid in self.admission.running])

    def _fail(self, seqs: list[Sequence], err: Exception) -> None:
        """Fail these requests: the client gets a generic message with an error id, the log the
        exception under that id (exception texts hold no prompt or output)."""
        error_id = uuid.uuid4().hex[:12]
        logger.error("error %s: %d request(s) failed (%s)", error_id, len(seqs),
                     ", ".join(s.request_id for s in seqs), exc_info=err)
        self._totals["requests_failed"] += len(seqs)
        message = f"the engine failed while generating this request (error id {error_id}); retry it"
        for seq in seqs:
            queue = self._queues.get(seq.request_id)
            if queue is not None:
                queue.put_nowait(Failed(message))
        self._release([s.request_id for s in seqs])

    def _release(self, request_ids: list[str]) -> None:
        """Forget finished/aborted requests and free their caches (after the step that used them:
        actor calls from this process run in submission order)."""
        if not request_ids:
            return
        for rid in request_ids:
            self.admission.release(rid)
        self.target.free.remote(request_ids)
        if self.draft is not None:
            self.draft.free.remote(request_ids)


# -- helpers ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProposerSide:
    """The remote methods that serve the draft side of a step: a DraftWorker's own, or the
    proposer_* methods of a TargetWorker that hosts a colocated drafter (layer skip, prompt lookup).
    Each field is an actor method: `side.propose.remote(...)`."""

    propose: object
    free: object
    num_cached: object
    max_positions: object
    time_forwards: object
    ready: object
    memory: object
    prefill: object

    @staticmethod
    def of_draft_worker(actor) -> "ProposerSide":
        return ProposerSide(actor.propose, actor.free, actor.num_cached, actor.max_positions, actor.time_forwards,
                            actor.ready, actor.memory, actor.prefill)

    @staticmethod
    def colocated(target) -> "ProposerSide":
        return ProposerSide(target.propose, target.proposer_free, target.proposer_num_cached,
                            target.proposer_max_positions, target.proposer_time_forwards, target.ready,
                            target.memory, target.proposer_prefill)


def _step_call(plan: StepPlan) -> StepCall:
    """A sequential step's worker inputs, for one call or one graph execution."""
    return StepCall(plan.draft_rows(), plan.num_positions, plan.sampling, plan.draft_uniforms, plan.target_rows(),
                    plan.num_draft, plan.accept_uniforms, plan.final_uniforms)


def _merge(items: list) -> Delta | Failed:
    """Several queued Deltas -> one (tokens concatenated, latest totals); a Failed wins."""
    failed = [i for i in items if isinstance(i, Failed)]
    if failed:
        return failed[0]
    last = items[-1]
    tokens = [t for d in items for t in d.token_ids]
    return Delta(tokens, last.finish_reason, last.num_draft_tokens, last.num_accepted_tokens, last.num_steps,
                 last.rng_state)


def _continue(seq: Sequence, resume: Resume, vocab_size: int) -> None:
    """Make a new Sequence the continuation of a request: its delivered tokens become its output
    (the caches prefill prompt + output at its first step), and its random stream goes on where
    the lost replica's stopped. Raises InvalidPrompt for tokens that cannot be a continuation."""
    generated = [int(t) for t in resume.generated]
    if generated and (min(generated) < 0 or max(generated) >= vocab_size):
        raise InvalidPrompt(f"generated token ids must lie in [0, {vocab_size})")
    if len(generated) >= seq.params.max_tokens:
        raise InvalidPrompt(f"{len(generated)} tokens already generated leave nothing of max_tokens "
                            f"({seq.params.max_tokens}) to continue")
    seq.output.extend(generated)
    if resume.rng_state is not None:
        seq.generator.set_state(torch.frombuffer(bytearray(resume.rng_state), dtype=torch.uint8))
    elif generated and seq.params.seed is not None:
        # without the state, the seed's stream would replay the numbers that drew the tokens
        # already there: fresh numbers keep the continuation a valid sample
        seq.generator.seed()


def _predict(cost: TokenCost, tokens: int) -> float:
    """Seconds a forward over `tokens` tokens should take (0 when none, or nothing measured yet)."""
    return cost.predict(tokens) if tokens > 0 and cost.ready else 0.0


def _drain(queue: asyncio.Queue) -> list:
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


def _replica_tag() -> str:
    try:
        ctx = serve.get_replica_context()
        return f"{ctx.app_name}:{ctx.replica_id.unique_id}"
    except Exception:  # not inside a Serve replica
        return f"local:{id(object())}"


def _actor(cls, resources: Resources, bundle_index: int, name: str):
    """cls as a Ray actor in this replica's placement group (bundle 1: target, 2: draft)."""
    pg = ray.util.get_current_placement_group()
    options = dict(num_cpus=resources.num_cpus, num_gpus=resources.num_gpus, name=name,
                   namespace=WORKER_NAMESPACE, max_restarts=2, max_task_retries=0)
    if resources.memory:
        options["memory"] = resources.memory
    if resources.custom_request():
        options["resources"] = resources.custom_request()
    if pg is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle_index)
    return ray.remote(cls).options(**options)
