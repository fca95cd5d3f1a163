"""The coordinator deployment: owns one draft+target worker pair, batches every request routed to it.

One replica = one placement group [coordinator, target worker, draft worker] (Serve's
`placement_group_bundles`), so autoscaling the coordinator scales whole groups. The replica holds
the truth (each request's `Sequence`: tokens, sampling params, random stream, cache marks); the
workers hold KV caches. An asyncio loop runs the engine's step loop (`engine/loop.py`: admit,
prefill chunks, one step) over the replica's remote executor (serve/executor.py: how a step's
propose and verify run on the workers: two plain calls, one fused call or a compiled-graph
execution, pipelined or not). This file composes no step: it keeps request I/O (streams, metrics),
request deadlines and fault policy (a failed step isolated, health checks).

Overload and memory (`admission.Admission`): at most `max_queued_requests` wait for the running
batch (beyond: `Rejected` with code "queue_full", which the ingress answers with 429 + Retry-After);
with `max_cached_tokens` set, a request joins only while what the workers' dense caches would
allocate for the batch with it (running x one capacity for the longest) fits the budget.

Deadlines: every worker call has one, sized to the tokens it carries from the measured per-token
costs (`Deadlines`, serve/calls.py); every request has one (`request_timeout_s`, a `Failed` with code
"request_timeout" when it passes). Worker failures: a TargetWorker that dies is restarted by Ray
and the step waits for it; one that misses its deadline is killed and restarted
(`ray.kill(..., no_restart=False)`); either way the target re-prefills every running request from
the coordinator's tokens (cache misses). A draft that fails in any way (dies, hangs, raises) does
not stall anyone: steps run target-only (γ = 0, still the target's own tokens) until a background
probe sees it answer, then speculation resumes and the draft rebuilds its caches. A step that fails
otherwise is retried row by row, so that only the requests it really fails on get a `Failed`
(a generic message with an error id; the exception goes to the log under that id).
`check_health` fails after `deadlines.health_misses` unanswered probes in a row, and Serve
replaces the whole group. A target whose *node* is gone (its placement-group bundle without a node
for `deadlines.worker_lost_s`, serve/placement.py) cannot come back: the replica sends each request
a `Lost` (the ingress continues them elsewhere) and exits, and Serve builds a new group.

A lost replica's requests are continued by the ingress on another one (serve/continuation.py): a
`GenerateRequest.resume` carries the tokens already delivered (and a seeded request's random
stream, from `Delta.rng_state`); `_continue` makes them the new Sequence's output.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
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
from specserve.engine.admission import Admission
from specserve.engine.loop import StepLoop
from specserve.engine.sampling import SamplingParams
from specserve.engine.policy import OverlappedPolicy, SpeculationPolicy
from specserve.engine.step import ContextLengthExceeded, InvalidPrompt, Sequence, StepOutput, new_sequence

from .calls import ProposerSide, StepRecord, answers
from .executor import RemoteExecutor
from .metrics import CoordinatorMetrics
from .placement import POLL_S, TARGET_BUNDLE, PlacementWatch
from .wire import fast_tensor_pickling
from .workers import DraftWorker, TargetWorker, TokenizerSource

logger = logging.getLogger("specserve.coordinator")
WORKER_NAMESPACE = "specserve"
LEAVE_S = 0.2  # after giving its requests up, a leaving replica exits this much later (the Lost messages out first)


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
    priority: int = 0  # lower is admitted first (vLLM's `priority`)


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
    # when the request asked (SamplingParams.logprobs): per token of token_ids, its log-probability
    # and its k likeliest alternatives [(token, logprob)]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    cached_tokens: int = 0  # prompt tokens the target's cache took from shared blocks (prefix caching)
    # predicted outputs (running totals): predicted drafts the target verified, and those it accepted
    num_prediction_tokens: int = 0
    num_accepted_prediction_tokens: int = 0
    # drafts recalled from earlier answers (running totals, `speculation.history`)
    num_recalled_tokens: int = 0
    num_accepted_recalled_tokens: int = 0


# A Delta's running totals (a continuation on another replica adds its own to the ones before)
TOTALS = ("num_draft_tokens", "num_accepted_tokens", "num_steps", "num_prediction_tokens",
          "num_accepted_prediction_tokens", "num_recalled_tokens", "num_accepted_recalled_tokens")


@dataclass(frozen=True)
class Failed:
    message: str  # for the client: no internal text (the log has the details under the error id)
    code: str = "engine_error"  # | "request_timeout"


@dataclass(frozen=True)
class Lost:
    """This replica cannot finish the request (its target worker has no node left): the ingress
    continues it on another replica from the tokens it has delivered, as after a lost replica."""

    message: str


@serve.deployment(ray_actor_options={"num_cpus": 0.1})
class Coordinator:
    target_worker_class, draft_worker_class = TargetWorker, DraftWorker  # (a benchmark swaps in its own)
    _lost: str | None = None  # why this replica gave its requests up and is leaving (see _leave)
    _placement: PlacementWatch | None = None  # its placement group, watched (None: not in one)
    _watch_task: asyncio.Task | None = None

    def __init__(self, config: AppConfig) -> None:
        fast_tensor_pickling()  # every step call carries tensors (sampling parameters, uniforms)
        self.config = config
        self.deadlines = config.deadlines
        self.max_gamma = config.speculation.num_speculative_tokens
        tag = _replica_tag()
        threads = config.target_worker.torch_threads
        tokenizer = TokenizerSource(config.target, config.tokenizer)
        self.target = _actor(self.target_worker_class, config.target_worker, 1, f"{tag}:target").remote(
            config.target, config.max_model_len, threads, config.drafter, execution=config.speculation.execution,
            tokenizer=tokenizer, kv=config.worker_kv,
            wide_share=config.speculation.grammar_wide_share)
        info = ray.get(self.target.info.remote())
        self.vocab_size, self.eos_token_ids = info.vocab_size, info.eos_token_ids
        limits = [config.max_model_len, info.max_model_len]
        self.draft = None  # the remote methods of the draft side (ProposerSide), if anything drafts
        self.draft_worker = None  # the DraftWorker actor, if the draft side is one (else: the target)
        if config.has_draft_worker:  # a draft model, or a feature head that pulls from this target
            head = config.drafter if config.draft is None else None
            self.draft_worker = _actor(self.draft_worker_class, config.draft_worker, 2, f"{tag}:draft").remote(
                config.draft or config.target, info.vocab_size, config.max_model_len,
                config.draft_worker.torch_threads, execution=config.speculation.execution, feature_head=head,
                target=self.target if head is not None else None, planted=config.speculation.planted,
                tokenizer=tokenizer, eos_token_ids=info.eos_token_ids,
                kv=config.worker_kv,
                q_dtype=info.dtype if info.dtype in ("bfloat16", "float16") else "float32",
                wide_share=config.speculation.grammar_wide_share)
            self.draft = ProposerSide.of_draft_worker(self.draft_worker)
        elif config.drafter is not None:
            self.draft = ProposerSide.colocated(self.target)
        if self.draft is not None:
            limits.append(ray.get(self.draft.max_model_len.remote()))
        self.max_model_len = min(x for x in limits if x) if any(limits) else 1 << 30
        fused = self.draft is not None and self.draft_worker is None  # one call drafts and verifies
        if config.speculation.pipelined:
            # rejection-point branches need the graph (the draft side forks its caches) and a draft model
            branching = config.speculation.transport == "compiled_graph" and config.draft is not None
            self.policy = OverlappedPolicy(self.max_gamma, adaptive=config.speculation.adaptive,
                                           max_branches=config.speculation.branches if branching else 0)
        else:
            self.policy = SpeculationPolicy(self.max_gamma, adaptive=config.speculation.adaptive, fused=fused,
                                            own_drafts=getattr(config.drafter, "own_drafts", True))
        # the usual step shapes' CUDA graphs, before any request pays for their capture (GPU workers);
        # a pipelined step's ahead call drafts one more than γ (`pipeline.Ahead`)
        ahead = 1 if config.speculation.pipelined else 0
        sides = [(self.target, self.max_gamma)] + ([] if self.draft_worker is None else
                                                    [(self.draft_worker, self.max_gamma + ahead)])
        ray.get([w.capture_graphs.remote(config.max_batch_size, gamma, config.max_cached_tokens) for w, gamma in sides])
        # measured costs start γ (adaptive) and size every worker call's deadline
        self.policy.calibrate_costs("target", ray.get(self.target.time_forwards.remote()))
        if self.draft is not None:
            self.policy.calibrate_costs("draft", ray.get(self.draft.time_forwards.remote()))
        workers = [w for w, _ in sides]
        caches = ray.get([w.caches.remote() for w in workers])  # [(dense cache grows, kept behind marks)]
        behind = {mark: kept for _, marks in caches for mark, kept in marks.items()}  # (windowed: blocks go back)
        self.admission = Admission(config.max_batch_size, config.max_cached_tokens, self.max_gamma,
                                   config.kv_block_size, behind, config.prefill_chunk_tokens)
        self._queues: dict[str, asyncio.Queue] = {}
        self._aborted: set[str] = set()
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._records: deque[StepRecord] = deque(maxlen=4096)
        self._totals = {"spec_decode_num_draft_tokens": 0, "spec_decode_num_accepted_tokens": 0,
                        "spec_decode_num_prediction_tokens": 0, "spec_decode_num_accepted_prediction_tokens": 0,
                        "spec_decode_num_recalled_tokens": 0, "spec_decode_num_accepted_recalled_tokens": 0,
                        "steps": 0,
                        "target_only_steps": 0, "rejected_queue_full": 0, "running_peak": 0,
                        "reserved_tokens_peak": 0, "worker_restarts": 0, "requests_failed": 0,
                        "requests_timed_out": 0, "prefill_tokens": 0, "graph_steps": 0,
                        "fused_steps": 0}
        self._health_misses = {"target": 0, "draft": 0}
        # metrics: arrival and last-emission times per request (TTFT, inter-token latency)
        self.metrics = CoordinatorMetrics(config.served_model_name)
        self._timing: dict[str, list[float | None]] = {}
        # how steps run on the workers (transports, pipelining, the draft's availability)
        self.executor = RemoteExecutor(config, self.target, self.draft_worker, self.draft, self.policy,
                                       self.admission, self._totals, self._records, self.metrics)
        # workers whose graphs sit on dense caches that grow: sized as requests join (`executor.reserve`)
        self.executor.growing = [w for w, (grows, _) in zip(workers, caches) if grows]
        history = config.speculation.history
        self.loop = StepLoop(self.admission, self.executor, self.policy, config.prefill_chunk_tokens,
                             None if history is None else history.engine_history())
        # failure domains: the group's bundles watched for a node that is gone (serve/placement.py)
        pg = ray.util.get_current_placement_group() if ray.is_initialized() else None  # (None: in-process tests)
        self._placement = None if pg is None else PlacementWatch(pg, config.deadlines.worker_lost_s)

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
        if self._lost is not None:
            yield Lost(self._lost)
            return
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
                finished = isinstance(item, (Failed, Lost)) or item.finish_reason is not None
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
                               max_gamma=request.num_speculative_tokens, priority=request.priority)
            if request.resume is not None:
                _continue(seq, request.resume, self.vocab_size)
        except (InvalidPrompt, ContextLengthExceeded) as err:
            code = "context_length_exceeded" if isinstance(err, ContextLengthExceeded) else "invalid_prompt"
            return Rejected(str(err), code)
        if self.admission.too_big(seq):
            return Rejected(f"prompt ({len(seq.prompt)} tokens) + max_tokens ({seq.params.max_tokens}) needs more "
                            f"KV cache than the budget of {self.admission.budget} token positions",
                            "context_length_exceeded")
        self._admit(preempt=False)  # (so that `waiting` counts only requests that really must wait; a step
        # may be under way: only the loop preempts, between steps)
        waiting = len(self.admission.waiting)
        if waiting >= self.config.max_queued_requests and request.resume is None and not self.admission.fits_now(seq):
            self._totals["rejected_queue_full"] += 1
            self.metrics.inc(self.metrics.request_rejected, 1, reason="queue_full")
            return Rejected(f"the server is overloaded ({waiting} requests waiting); retry later", "queue_full")
        return seq

    async def prompt_logprobs(self, tokens: list[int], k: int) -> list:
        """The prompt's log-probabilities on this replica's target (for `echo` with `logprobs`)."""
        if not 0 < len(tokens) <= self.max_model_len or min(tokens) < 0 or max(tokens) >= self.vocab_size:
            raise ValueError("prompt tokens out of range")
        return await self.target.prompt_logprobs.remote(list(tokens), k)

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
        if self._lost is not None:
            raise RuntimeError(self._lost)
        self._ensure_watch()
        workers = {"target": self.target}
        if self.draft_worker is not None:
            workers["draft"] = self.draft_worker
        answered = await asyncio.gather(*(answers(w, self.deadlines.health_probe_s) for w in workers.values()))
        for name, ok in zip(workers, answered):
            self._health_misses[name] = 0 if ok else self._health_misses[name] + 1
        stuck = [name for name in workers if self._health_misses[name] >= self.deadlines.health_misses]
        if stuck:
            raise RuntimeError(f"{' and '.join(stuck)} worker unanswered for {self.deadlines.health_misses} "
                               "health checks in a row")

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
        recs, graph = list(self._records), self.executor.graph
        out = {"replica": _replica_tag(), "running": len(self.admission.running),
               "waiting": len(self.admission.waiting), **self._totals, "draft_available": self.executor.draft_ok,
               "q_placed": self.executor.q_placed,
               "reserved_tokens": self.admission.allocated(), "max_cached_tokens": self.admission.budget,
               "max_queued_requests": self.config.max_queued_requests,
               "kv_cache_usage_tokens": self._kv_usage(), "memory": await self.memory(),
               "transport": "compiled_graph" if graph is not None else "actor_calls"}
        history = self.loop.history
        if history is not None:  # (`speculation.history`: what it keeps, and how often a row found a run)
            out.update(history_requests=len(history), history_tokens=history.held_tokens,
                       history_lookups=history.num_lookups, history_found=history.num_found)
        if graph is not None:
            out.update(graph_ready=graph.ready, graph_builds=graph.builds, graph_breaks=graph.breaks,
                       graph_solo=graph.solo, graph_reshapes=graph.reshapes, graph_spins=graph.spins)
        if recs:
            for name, values in (("step_wall", [r.wall for r in recs]), ("forward", [r.forward for r in recs]),
                                 ("overhead", [r.wall - r.forward for r in recs]),
                                 ("rpc_overhead", [r.wall - r.in_workers for r in recs])):
                values.sort()
                out[f"{name}_p50_ms"] = 1e3 * statistics.median(values)
                out[f"{name}_p99_ms"] = 1e3 * values[min(len(values) - 1, math.ceil(0.99 * len(values)) - 1)]
            out.update(batch_mean=statistics.fmean(r.batch for r in recs),
                       gamma_mean=statistics.fmean(r.gamma for r in recs))
        return out

    def reset_stats(self) -> None:
        self._records.clear()
        self._totals.update(dict.fromkeys(self._totals, 0))  # (in place: the executor counts into it too)
        if self.loop.history is not None:
            self.loop.history.reset_counts()

    # -- the step loop ------------------------------------------------------------------------
    def _ensure_loop(self) -> None:
        if self._lost is not None:
            return
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._loop())
        self.executor.keep_graph()
        self._ensure_watch()

    # -- failure domains: a target whose node is gone ---------------------------------------------
    def _ensure_watch(self) -> None:
        if self._placement is not None and (self._watch_task is None or self._watch_task.done()):
            self._watch_task = asyncio.get_running_loop().create_task(self._watch_placement())

    async def _watch_placement(self) -> None:
        """Every POLL_S: leave once the target's bundle has had no node for deadlines.worker_lost_s."""
        while self._lost is None:
            await asyncio.sleep(POLL_S)
            try:
                lost = await asyncio.to_thread(self._placement.check)
            except Exception as err:  # the GCS busy or restarting: look again next time
                logger.warning("reading this replica's placement group failed: %s", err)
                continue
            if TARGET_BUNDLE in lost:
                self._leave(f"the target worker's node is gone and no node took its bundle within "
                            f"{self.deadlines.worker_lost_s:g} s")

    def _leave(self, why: str) -> None:
        """Give every request up as Lost (the ingress continues them on other replicas from what
        they delivered), stop stepping, fail health checks, and exit the process after LEAVE_S so
        that Serve replaces the group (its placement group and workers go with this actor)."""
        logger.error("%s: giving %d requests up to other replicas and leaving", why, len(self._queues))
        self._lost = why
        for queue in self._queues.values():
            queue.put_nowait(Lost(why))
        if self._loop_task is not None:
            self._loop_task.cancel()
        asyncio.get_running_loop().call_later(LEAVE_S, _exit_process)

    async def _loop(self) -> None:
        """The engine's step loop (`StepLoop`) with this replica's request I/O around it: aborted
        requests dropped, the loop asleep while nothing runs, a failed step isolated to the requests
        it fails on, every step's tokens published to their streams."""
        while True:
            self._drop_aborted()
            self._admit()
            if not self.admission.running:
                self._wake.clear()
                await self._wake.wait()
                continue
            seqs = list(self.admission.running.values())
            try:
                outputs = await self.loop.iterate(seqs)
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
                outputs += await self.executor.step([seq], self.executor.target_only)
            except Exception as row_err:
                self._fail([seq], row_err)
        return outputs

    def _admit(self, preempt: bool = True) -> None:
        """FIFO into the running batch while it has room and the KV-cache budget allows (first,
        with preempt, what the budget no longer holds out of it: `StepLoop.admit`)."""
        self.loop.admit(preempt)
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
                                       m.num_accepted_tokens, m.num_steps, rng, out.logprobs, out.top_logprobs,
                                       seq.cached_tokens, m.num_prediction_drafts, m.num_prediction_accepted,
                                       m.num_recalled_drafts, m.num_recalled_accepted))
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
        """Forget finished/aborted requests and free their caches (`StepLoop.retire`)."""
        self.loop.retire(request_ids)


# -- helpers ---------------------------------------------------------------------------------------
def _merge(items: list) -> Delta | Failed | Lost:
    """Several queued Deltas -> one (tokens concatenated, latest totals); a Failed or Lost wins
    (after a Lost, the continuation regenerates what the Deltas queued before it held)."""
    ended = [i for i in items if isinstance(i, (Failed, Lost))]
    if ended:
        return ended[0]
    last = items[-1]
    tokens = [t for d in items for t in d.token_ids]
    logprobs = None if last.logprobs is None else [v for d in items for v in d.logprobs or ()]
    tops = None if last.top_logprobs is None else [t for d in items for t in d.top_logprobs or ()]
    return dataclasses.replace(last, token_ids=tokens, logprobs=logprobs, top_logprobs=tops)


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


def _drain(queue: asyncio.Queue) -> list:
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


def _exit_process() -> None:
    os._exit(1)  # a Serve replica that leaves: the controller replaces it (tests replace this function)


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
