"""The coordinator deployment: owns one draft+target worker pair, batches every request routed to it.

One replica = one placement group [coordinator, target worker, draft worker] (Serve's
`placement_group_bundles`), so autoscaling the coordinator scales whole groups. The replica holds
the truth (each request's `Sequence`: tokens, sampling params, random stream, cache marks); the
workers hold KV caches. An asyncio loop runs the engine's step protocol remotely:

    plan_step -> await draft.propose -> await target.verify -> apply_verdict -> policy.observe_*

Requests join (admission up to max_batch_size) and leave (finish, abort) between steps. The maths
is the engine's (`specserve.engine.step`); this file only moves data and futures around.

Overload and memory: at most `max_queued_requests` wait for the running batch (beyond: `Rejected`
with code "queue_full", which the ingress answers with 429 + Retry-After); with `max_cached_tokens`
set, a request reserves prompt + max_tokens of the workers' KV caches while it runs, and admission
(FIFO) waits while the running reservations would exceed the budget.

Worker failures: a TargetWorker that dies is restarted by Ray and the step waits for it (no target,
no tokens). A DraftWorker that dies does not stall anyone: steps run target-only (γ = 0, still the
target's own tokens) until a background probe sees the restarted draft answer, then speculation
resumes and the draft rebuilds its caches from the coordinator's tokens (cache misses).
"""
from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import AsyncIterator

import ray
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from specserve.config import AppConfig, Resources
from specserve.engine.proposers import Proposal
from specserve.engine.sampling import SamplingParams
from specserve.engine.scheduler import SpeculationPolicy
from specserve.engine.step import (
    ContextLengthExceeded, InvalidPrompt, Sequence, StepOutput, StepPlan, empty_proposal, finish_step, new_sequence,
    plan_step,
)
from specserve.engine.verifier import Verdict

from .metrics import CoordinatorMetrics
from .workers import DraftWorker, Reply, TargetWorker

logger = logging.getLogger("specserve.coordinator")
WORKER_NAMESPACE = "specserve"
_CALL_ATTEMPTS = 4
_DRAFT_TIMEOUT_MIN_S = 0.5  # a propose call slower than max(this, 20 x its usual time): draft gone


# -- messages between ingress and coordinator ------------------------------------------------------
@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    num_speculative_tokens: int | None = None  # per-request cap on γ (<= the configured one)


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


@dataclass(frozen=True)
class Failed:
    message: str


@dataclass(frozen=True)
class StepRecord:
    wall: float  # seconds, plan to apply
    forward: float  # seconds in model forwards (draft + target verify)
    in_workers: float  # seconds inside the worker methods
    batch: int
    positions: int  # G


# -- the deployment ------------------------------------------------------------------------------
@serve.deployment(ray_actor_options={"num_cpus": 0.1})
class Coordinator:
    def __init__(self, config: AppConfig) -> None:
        self.config = config
        self.max_gamma = config.speculation.num_speculative_tokens
        tag = _replica_tag()
        threads = config.target_worker.torch_threads
        self.target = _actor(TargetWorker, config.target_worker, 1, f"{tag}:target").remote(
            config.target, config.max_model_len, threads, config.drafter, execution=config.speculation.execution)
        info = ray.get(self.target.info.remote())
        self.vocab_size, self.eos_token_ids = info.vocab_size, info.eos_token_ids
        limits = [config.max_model_len, info.max_positions]
        self.draft = None  # the remote methods of the draft side (ProposerSide), if anything drafts
        if config.draft is not None:
            self.draft = ProposerSide.of_draft_worker(_actor(DraftWorker, config.draft_worker, 2, f"{tag}:draft").remote(
                config.draft, info.vocab_size, config.max_model_len, config.draft_worker.torch_threads,
                execution=config.speculation.execution))
        elif config.drafter is not None:
            self.draft = ProposerSide.colocated(self.target)
        if self.draft is not None:
            limits.append(ray.get(self.draft.max_positions.remote()))
        self.max_model_len = min(x for x in limits if x) if any(limits) else 1 << 30
        self.policy = SpeculationPolicy(self.max_gamma, adaptive=config.speculation.adaptive)
        if self.draft is not None and config.speculation.adaptive:  # start γ from measured costs
            self.policy.observe_costs("target", ray.get(self.target.time_forwards.remote()))
            self.policy.observe_costs("draft", ray.get(self.draft.time_forwards.remote()))
        self._waiting: deque[Sequence] = deque()
        self._running: dict[str, Sequence] = {}
        self._queues: dict[str, asyncio.Queue] = {}
        self._aborted: set[str] = set()
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._records: deque[StepRecord] = deque(maxlen=4096)
        self._totals = {"spec_decode_num_draft_tokens": 0, "spec_decode_num_accepted_tokens": 0, "steps": 0,
                        "target_only_steps": 0, "rejected_queue_full": 0, "running_peak": 0,
                        "reserved_tokens_peak": 0}
        # overload / memory: reservations (prompt + max_tokens) of the running requests
        self.max_cached_tokens = config.max_cached_tokens
        self._reservations: dict[str, int] = {}
        self._reserved = 0
        # draft failure: target-only steps while the draft restarts
        self._draft_ok = self.draft is not None
        self._draft_watch: asyncio.Task | None = None
        self._target_only = SpeculationPolicy(0, adaptive=False)
        self._draft_call_s = 0.05  # EMA of a propose call's wall time
        # metrics: arrival and last-emission times per request (TTFT, inter-token latency)
        self.metrics = CoordinatorMetrics(config.served_model_name)
        self.metrics.set(self.metrics.draft_available, float(self._draft_ok))
        self._timing: dict[str, list[float | None]] = {}

    # -- API (called through DeploymentHandles) ---------------------------------------------------
    def info(self) -> dict:
        return {"max_model_len": self.max_model_len, "vocab_size": self.vocab_size,
                "num_speculative_tokens": self.max_gamma}

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Accepted | Rejected | Delta | Failed]:
        """Stream: Accepted (or Rejected, then end), then Deltas until one has a finish_reason.

        Cancelling the stream (client gone, stop string hit) aborts the request and frees its caches."""
        self._ensure_loop()
        rid = request.request_id
        if rid in self._queues:
            yield Rejected(f"request id {rid!r} is already in use", "duplicate_request_id")
            return
        try:
            seq = new_sequence(rid, request.prompt_token_ids, request.params, vocab_size=self.vocab_size,
                               max_model_len=self.max_model_len, eos_token_ids=self.eos_token_ids,
                               max_gamma=request.num_speculative_tokens)
        except (InvalidPrompt, ContextLengthExceeded) as err:
            code = "context_length_exceeded" if isinstance(err, ContextLengthExceeded) else "invalid_prompt"
            yield Rejected(str(err), code)
            return
        need = _reservation(seq)
        if self.max_cached_tokens is not None and need > self.max_cached_tokens:
            yield Rejected(f"prompt ({len(seq.prompt)} tokens) + max_tokens ({seq.params.max_tokens}) exceeds the "
                           f"KV-cache budget of {self.max_cached_tokens} tokens", "context_length_exceeded")
            return
        self._admit()  # (so that `waiting` counts only requests that really must wait)
        if len(self._waiting) >= self.config.max_queued_requests and not self._fits_now(need):
            self._totals["rejected_queue_full"] += 1
            self.metrics.inc(self.metrics.request_rejected, 1, reason="queue_full")
            yield Rejected(f"the server is overloaded ({len(self._waiting)} requests waiting); retry later",
                           "queue_full")
            return
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        self._timing[rid] = [time.monotonic(), None]
        self._waiting.append(seq)
        self.metrics.inc(self.metrics.prompt_tokens, len(seq.prompt))
        self._wake.set()
        finished = False
        try:
            yield Accepted(len(seq.prompt))
            while not finished:
                item = _merge([await queue.get()] + _drain(queue))
                finished = isinstance(item, Failed) or item.finish_reason is not None
                yield item
        finally:
            self._queues.pop(rid, None)
            self._timing.pop(rid, None)
            if not finished:
                self._aborted.add(rid)
                self._wake.set()

    async def num_cached(self) -> dict[str, int]:
        """Requests holding a cache slot on each worker (0 after every request finished or aborted)."""
        counts = {"target": await self.target.num_cached.remote()}
        if self.draft is not None:
            counts["draft"] = await self.draft.num_cached.remote()
        return counts

    async def check_health(self) -> None:
        """Called by Serve: a worker dead for good (restarts used up) fails the replica, and Serve
        replaces the whole group. A busy or restarting worker is not a failure."""
        for worker in (self.target, self.draft):
            if worker is None:
                continue
            try:
                await asyncio.wait_for(asyncio.ensure_future(worker.ready.remote()), timeout=20)
            except (asyncio.TimeoutError, ActorUnavailableError):
                pass

    async def memory(self) -> dict:
        """Resident memory (bytes) of this replica's process and workers, and the workers' KV-cache
        storage; a worker that does not answer within 5 s (restarting) is left out."""
        from .workers import _rss_bytes

        out: dict = {"coordinator": {"rss_bytes": _rss_bytes()}}
        for name, worker in (("target", self.target), ("draft", self.draft)):
            if worker is None:
                continue
            try:
                out[name] = await asyncio.wait_for(asyncio.ensure_future(worker.memory.remote()), timeout=5)
            except (asyncio.TimeoutError, RayActorError):
                pass
        return out

    async def stats(self) -> dict:
        """This replica's step timings (p50 over the last <= 4096 steps), speculation totals, admission
        state and memory."""
        recs = list(self._records)
        out = {"replica": _replica_tag(), "running": len(self._running), "waiting": len(self._waiting),
               **self._totals, "draft_available": self._draft_ok, "reserved_tokens": self._reserved,
               "max_cached_tokens": self.max_cached_tokens,
               "max_queued_requests": self.config.max_queued_requests,
               "kv_cache_usage_tokens": self._kv_usage(), "memory": await self.memory()}
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

    async def _loop(self) -> None:
        while True:
            self._drop_aborted()
            self._admit()
            if not self._running:
                self._wake.clear()
                await self._wake.wait()
                continue
            seqs = list(self._running.values())
            try:
                outputs = await self._step(seqs, self.policy)
                self._publish(outputs)
                self._update_gauges()
            except Exception as err:  # a worker died for good, or a bug: fail these, keep serving
                logger.exception("step failed")  # (the exception text holds no prompt or output)
                self._fail([s for s in seqs if s.request_id in self._running], f"{type(err).__name__}: {err}")

    def _fits_now(self, need: int) -> bool:
        """Whether a request reserving `need` tokens would join the running batch at once."""
        if self._waiting or len(self._running) >= self.config.max_batch_size:
            return False
        return self.max_cached_tokens is None or self._reserved + need <= self.max_cached_tokens

    def _admit(self) -> None:
        """FIFO into the running batch while it has room and the KV-cache budget allows (no
        overtaking: a large request at the head waits rather than starve)."""
        while self._waiting and len(self._running) < self.config.max_batch_size:
            seq = self._waiting[0]
            need = _reservation(seq)
            if self.max_cached_tokens is not None and self._reserved + need > self.max_cached_tokens:
                break
            self._waiting.popleft()
            self._running[seq.request_id] = seq
            self._reservations[seq.request_id] = need
            self._reserved += need
        totals = self._totals
        totals["running_peak"] = max(totals["running_peak"], len(self._running))
        totals["reserved_tokens_peak"] = max(totals["reserved_tokens_peak"], self._reserved)
        self._update_gauges()

    def _kv_usage(self) -> dict[str, int]:
        usage = {"target": sum(s.target_len for s in self._running.values())}
        if self.draft is not None:
            usage["draft"] = sum(s.draft_len for s in self._running.values())
        return usage

    def _update_gauges(self) -> None:
        m = self.metrics
        m.set(m.running, len(self._running))
        m.set(m.waiting, len(self._waiting))
        for worker, tokens in self._kv_usage().items():
            m.set(m.kv_usage, tokens, worker=worker)
        m.set(m.kv_reserved, self._reserved)
        m.set(m.kv_usage_perc, self._reserved / self.max_cached_tokens if self.max_cached_tokens else 0.0)

    async def _step(self, seqs: list[Sequence], policy: SpeculationPolicy) -> list[StepOutput]:
        began = time.perf_counter()
        if not self._draft_ok:
            policy = self._target_only
        plan = plan_step(seqs, policy)
        proposal, in_workers = empty_proposal(len(seqs)), 0.0
        if plan.num_positions > 0:
            try:
                # A call to a dead actor fails; one to a restarting actor waits until it is back, so
                # a draft answering far slower than usual counts as gone too.
                called = time.perf_counter()
                reply = await asyncio.wait_for(self._call(self.draft.propose, seqs, "draft_len", lambda: (
                    plan.draft_rows(), plan.num_positions, plan.sampling, plan.draft_uniforms), retry=False),
                    timeout=max(_DRAFT_TIMEOUT_MIN_S, 20 * self._draft_call_s))
                proposal, in_workers = reply.result, reply.seconds
                self._draft_call_s = 0.9 * self._draft_call_s + 0.1 * (time.perf_counter() - called)
            except (RayActorError, asyncio.TimeoutError) as err:
                # The draft is gone (restarting): re-plan this very step without it. Greedy rows are
                # unaffected; seeded sampled rows draw fresh numbers (same distribution, another sample).
                self._draft_lost(err)
                policy = self._target_only
                plan = plan_step(seqs, policy)
        if policy is self._target_only and self.draft is not None:
            self._totals["target_only_steps"] += 1
            self.metrics.inc(self.metrics.target_only_steps, 1)
        reply = await self._call(self.target.verify, seqs, "target_len", lambda: (
            plan.target_rows(), proposal.tokens, proposal.probs, plan.num_draft, plan.sampling,
            plan.accept_uniforms, plan.final_uniforms))
        outputs = finish_step(plan, proposal, reply.result, policy, began)
        wall = time.perf_counter() - began
        self._record(StepRecord(wall, proposal.seconds + reply.result.seconds, in_workers + reply.seconds,
                                len(seqs), plan.num_positions), plan, reply.result)
        return outputs

    async def _call(self, method, seqs: list[Sequence], mark: str, make_args, retry: bool = True) -> Reply:
        """Call a worker; on cache misses move the rows' marks back and resend; retry a restarting
        actor (retry=False: raise RayActorError at once)."""
        by_id = {s.request_id: s for s in seqs}
        for attempt in range(_CALL_ATTEMPTS):
            try:
                reply: Reply = await method.remote(*make_args())
            except RayActorError as err:
                if attempt + 1 == _CALL_ATTEMPTS or not retry:
                    raise
                logger.warning("worker call failed (%s); retrying once it restarts", type(err).__name__)
                await asyncio.sleep(min(2.0**attempt, 5.0))  # Ray queues calls while it restarts
                continue
            if not reply.misses:
                return reply
            for rid, valid in reply.misses.items():
                setattr(by_id[rid], mark, valid)
        raise RuntimeError(f"worker still misses caches after {_CALL_ATTEMPTS} attempts")

    def _draft_lost(self, err: Exception) -> None:
        """Go target-only until the draft answers again (a background probe), then speculate again."""
        if self._draft_ok:
            logger.warning("draft worker unavailable (%s): target-only steps until it is back", type(err).__name__)
        self._draft_ok = False
        self.metrics.set(self.metrics.draft_available, 0.0)
        if self._draft_watch is None or self._draft_watch.done():
            self._draft_watch = asyncio.get_running_loop().create_task(self._watch_draft())

    async def _watch_draft(self) -> None:
        delay = 0.2
        while True:
            try:  # calls to a restarting actor are queued by Ray until it is alive again
                await asyncio.wait_for(asyncio.ensure_future(self.draft.ready.remote()), timeout=60)
                break
            except (asyncio.TimeoutError, RayActorError):
                await asyncio.sleep(delay)
                delay = min(2 * delay, 5.0)
        logger.warning("draft worker back: speculation resumes")
        self._draft_ok = True
        self.metrics.set(self.metrics.draft_available, 1.0)

    def _record(self, record: StepRecord, plan: StepPlan, verdict: Verdict) -> None:
        self._records.append(record)
        self._totals["steps"] += 1
        num_draft = plan.num_draft.tolist()
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
            seq = self._running[out.request_id]
            queue = self._queues.get(out.request_id)
            if queue is not None:
                m = seq.metrics
                queue.put_nowait(Delta(out.new_token_ids, out.finish_reason, m.num_draft_tokens,
                                       m.num_accepted_tokens, m.num_steps))
            if out.finish_reason is not None:
                done.append(out.request_id)
        self._release(done)

    def _drop_aborted(self) -> None:
        if not self._aborted:
            return
        aborted, self._aborted = self._aborted, set()
        self._waiting = deque(s for s in self._waiting if s.request_id not in aborted)
        self._release([rid for rid in aborted if rid in self._running])

    def _fail(self, seqs: list[Sequence], message: str) -> None:
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
            self._running.pop(rid, None)
            self._reserved -= self._reservations.pop(rid, 0)
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

    @staticmethod
    def of_draft_worker(actor) -> "ProposerSide":
        return ProposerSide(actor.propose, actor.free, actor.num_cached, actor.max_positions, actor.time_forwards,
                            actor.ready, actor.memory)

    @staticmethod
    def colocated(target) -> "ProposerSide":
        return ProposerSide(target.propose, target.proposer_free, target.proposer_num_cached,
                            target.proposer_max_positions, target.proposer_time_forwards, target.ready,
                            target.memory)


def _merge(items: list) -> Delta | Failed:
    """Several queued Deltas -> one (tokens concatenated, latest totals); a Failed wins."""
    failed = [i for i in items if isinstance(i, Failed)]
    if failed:
        return failed[0]
    last = items[-1]
    tokens = [t for d in items for t in d.token_ids]
    return Delta(tokens, last.finish_reason, last.num_draft_tokens, last.num_accepted_tokens, last.num_steps)


def _reservation(seq: Sequence) -> int:
    """KV-cache tokens a request may come to hold on each worker: prompt + max_tokens (capped at
    the context; drafts beyond a row's limit go to clamped positions, see engine.step.plan_step)."""
    return min(len(seq.prompt) + seq.params.max_tokens, seq.max_positions)


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
