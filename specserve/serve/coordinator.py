"""The coordinator deployment: owns one draft+target worker pair, batches every request routed to it.

One replica = one placement group [coordinator, target worker, draft worker] (Serve's
`placement_group_bundles`), so autoscaling the coordinator scales whole groups. The replica holds
the truth (each request's `Sequence`: tokens, sampling params, random stream, cache marks); the
workers hold KV caches. An asyncio loop runs the engine's step protocol remotely:

    plan_step -> await draft.propose -> await target.verify -> apply_verdict -> policy.observe_*

Requests join (admission up to max_batch_size) and leave (finish, abort) between steps. The maths
is the engine's (`specserve.engine.step`); this file only moves data and futures around.
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

from .workers import DraftWorker, Reply, TargetWorker

logger = logging.getLogger("specserve.coordinator")
WORKER_NAMESPACE = "specserve"
_CALL_ATTEMPTS = 4


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
    code: str  # "context_length_exceeded" | "invalid_prompt" | "duplicate_request_id"


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
            config.target, config.max_model_len, threads)
        info = ray.get(self.target.info.remote())
        self.vocab_size, self.eos_token_ids = info.vocab_size, info.eos_token_ids
        limits = [config.max_model_len, info.max_positions]
        self.draft = None
        if config.draft is not None:
            self.draft = _actor(DraftWorker, config.draft_worker, 2, f"{tag}:draft").remote(
                config.draft, info.vocab_size, config.max_model_len, config.draft_worker.torch_threads)
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
        self._totals = {"spec_decode_num_draft_tokens": 0, "spec_decode_num_accepted_tokens": 0, "steps": 0}

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
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        self._waiting.append(seq)
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

    def stats(self) -> dict:
        """This replica's step timings (p50 over the last <= 4096 steps) and speculation totals."""
        recs = list(self._records)
        out = {"replica": _replica_tag(), "running": len(self._running), "waiting": len(self._waiting),
               **self._totals}
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
            except Exception as err:  # a worker died for good, or a bug: fail these, keep serving
                logger.exception("step failed")
                self._fail(seqs, f"{type(err).__name__}: {err}")
                continue
            self._publish(outputs)

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.config.max_batch_size:
            seq = self._waiting.popleft()
            self._running[seq.request_id] = seq

    async def _step(self, seqs: list[Sequence], policy: SpeculationPolicy) -> list[StepOutput]:
        began = time.perf_counter()
        plan = plan_step(seqs, policy)
        proposal, in_workers = empty_proposal(len(seqs)), 0.0
        if plan.num_positions > 0:
            reply = await self._call(self.draft.propose, seqs, "draft_len", lambda: (
                plan.draft_rows(), plan.num_positions, plan.sampling, plan.draft_uniforms))
            proposal, in_workers = reply.result, reply.seconds
        reply = await self._call(self.target.verify, seqs, "target_len", lambda: (
            plan.target_rows(), proposal.tokens, proposal.probs, plan.num_draft, plan.sampling,
            plan.accept_uniforms, plan.final_uniforms))
        outputs = finish_step(plan, proposal, reply.result, policy, began)
        wall = time.perf_counter() - began
        self._record(StepRecord(wall, proposal.seconds + reply.result.seconds, in_workers + reply.seconds,
                                len(seqs), plan.num_positions), plan, reply.result)
        return outputs

    async def _call(self, method, seqs: list[Sequence], mark: str, make_args) -> Reply:
        """Call a worker; on cache misses move the rows' marks back and resend; retry a restarting actor."""
        by_id = {s.request_id: s for s in seqs}
        for attempt in range(_CALL_ATTEMPTS):
            try:
                reply: Reply = await method.remote(*make_args())
            except RayActorError as err:
                if attempt + 1 == _CALL_ATTEMPTS:
                    raise
                logger.warning("worker call failed (%s); retrying once it restarts", type(err).__name__)
                await asyncio.sleep(min(2.0**attempt, 5.0))  # Ray queues calls while it restarts
                continue
            if not reply.misses:
                return reply
            for rid, valid in reply.misses.items():
                setattr(by_id[rid], mark, valid)
        raise RuntimeError(f"worker still misses caches after {_CALL_ATTEMPTS} attempts")

    def _record(self, record: StepRecord, plan: StepPlan, verdict: Verdict) -> None:
        self._records.append(record)
        self._totals["steps"] += 1
        self._totals["spec_decode_num_draft_tokens"] += int(plan.num_draft.sum())
        self._totals["spec_decode_num_accepted_tokens"] += sum(verdict.num_accepted)

    # -- requests leaving ---------------------------------------------------------------------
    def _publish(self, outputs: list[StepOutput]) -> None:
        done = []
        for out in outputs:
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
        self.target.free.remote(request_ids)
        if self.draft is not None:
            self.draft.free.remote(request_ids)


# -- helpers ---------------------------------------------------------------------------------------
def _merge(items: list) -> Delta | Failed:
    """Several queued Deltas -> one (tokens concatenated, latest totals); a Failed wins."""
    failed = [i for i in items if isinstance(i, Failed)]
    if failed:
        return failed[0]
    last = items[-1]
    tokens = [t for d in items for t in d.token_ids]
    return Delta(tokens, last.finish_reason, last.num_draft_tokens, last.num_accepted_tokens, last.num_steps)


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
