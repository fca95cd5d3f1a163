"""Plain actor calls to a replica's workers: deadlines, the cache-miss protocol, target restarts.

Every worker call has a deadline sized to the tokens it carries from the measured per-token
costs (`deadline`). A call whose rows start past what a worker caches is answered with misses;
the rows' marks move back and the call is resent (positional caches: the resent rows rewrite what
was there). A TargetWorker that dies is restarted by Ray and the call waits for it; one that
misses its deadline is killed and restarted (`ray.kill(..., no_restart=False)`); either way the
target re-prefills from the coordinator's tokens (cache misses). A draft call raises instead
(`retry=False`): the executor then goes target-only (serve/executor.py).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import ray
from ray.exceptions import RayActorError

from specserve.config import Deadlines
from specserve.engine import RowInput
from specserve.engine.model_runner import DRAFT_ROW_TOKENS, VERIFY_ROW_TOKENS, catch_up
from specserve.engine.policy import SpeculationPolicy, TokenCost
from specserve.engine.step import Sequence

from .wire import Reply

logger = logging.getLogger("specserve.coordinator")
CALL_ATTEMPTS = 4


class WorkerTimeout(RuntimeError):
    """A worker call missed its deadline; `late` is its reply still on the way (an ObjectRef)."""

    def __init__(self, message: str, late=None) -> None:
        super().__init__(message)
        self.late = late


@dataclass(frozen=True)
class StepRecord:
    wall: float  # seconds, plan to apply
    forward: float  # seconds in model forwards (draft + target verify)
    in_workers: float  # seconds inside the worker methods
    batch: int
    gamma: int  # G: drafts per row the step proposed


@dataclass(frozen=True)
class ProposerSide:
    """The remote methods that serve the draft side of a step: a DraftWorker's own, or the
    proposer_* methods of a TargetWorker that hosts a colocated drafter (layer skip, prompt lookup).
    Each field is an actor method: `side.propose.remote(...)`."""

    propose: object
    free: object
    num_cached: object
    max_model_len: object
    time_forwards: object
    ready: object
    memory: object
    prefill: object

    @staticmethod
    def of_draft_worker(actor) -> "ProposerSide":
        return ProposerSide(actor.propose, actor.free, actor.num_cached, actor.max_model_len, actor.time_forwards,
                            actor.ready, actor.memory, actor.prefill)

    @staticmethod
    def colocated(target) -> "ProposerSide":
        return ProposerSide(target.propose, target.proposer_free, target.proposer_num_cached,
                            target.proposer_max_positions, target.proposer_time_forwards, target.ready,
                            target.memory, target.proposer_prefill)


class WorkerCalls:
    """A replica's calls to its target worker and draft side, with deadlines and restarts.

    on_restart(why): called before a worker restart is waited for (the executor discards its
    compiled graph, which a restarted actor breaks)."""

    def __init__(self, target, deadlines: Deadlines, policy: SpeculationPolicy, totals: dict,
                 on_restart=lambda why: None) -> None:
        self.target, self.deadlines, self.policy, self.totals = target, deadlines, policy, totals
        self.on_restart = on_restart

    async def call(self, side: str, method, seqs: list[Sequence], mark: str, make_args, retry: bool = True,
                   deadline=None) -> Reply:
        """Call a worker ("target" or "draft") within a deadline sized to the call's tokens
        (deadline(*args) when given); on cache misses move the rows' marks back (`mark`, and the
        draft marks for a fused step's `draft_misses`) and resend. The target is waited for while
        Ray restarts it, and killed for a restart when it misses the deadline (retry=False: raise
        at once instead)."""
        by_id = {s.request_id: s for s in seqs}
        for attempt in range(CALL_ATTEMPTS):
            args = make_args()
            timeout = self.deadline(side, *args[:2]) if deadline is None else deadline(*args)
            ref = method.remote(*args)
            try:
                reply: Reply = await asyncio.wait_for(asyncio.ensure_future(ref), timeout=timeout)
            except asyncio.TimeoutError:
                if not retry:
                    raise WorkerTimeout(f"{side} worker missed its {timeout:.1f} s deadline", ref) from None
                if attempt + 1 == CALL_ATTEMPTS:
                    raise WorkerTimeout(f"{side} worker missed its deadline {CALL_ATTEMPTS} times") from None
                await self.restart_target(f"missed its {timeout:.1f} s deadline")
                continue
            except RayActorError as err:
                if attempt + 1 == CALL_ATTEMPTS or not retry:
                    raise
                logger.warning("%s worker call failed (%s); retrying once it restarts", side, type(err).__name__)
                await self.until_ready(self.target)
                continue
            if not reply.misses and not reply.draft_misses:
                return reply
            for rid, valid in reply.misses.items():
                setattr(by_id[rid], mark, valid)
            for rid, valid in reply.draft_misses.items():
                by_id[rid].draft_len = valid
        raise RuntimeError(f"{side} worker still misses caches after {CALL_ATTEMPTS} attempts")

    def deadline(self, side: str, rows: list[RowInput], extra=None) -> float:
        """Seconds a call may take, from the time the measured per-token costs predict for its
        tokens (`predicted`, `allowed`)."""
        return self.allowed(side, self.predicted(side, rows, extra))

    def allowed(self, side: str, predicted: float) -> float:
        """Seconds a call predicted to take `predicted` seconds may take: floor + multiple x predicted."""
        d = self.deadlines
        return (d.target_floor_s if side == "target" else d.draft_floor_s) + d.multiple * predicted

    def predicted(self, side: str, rows: list[RowInput], extra=None) -> float:
        """Seconds the measured per-token costs predict for a call's forwards, prefill backlog
        included (0 before anything was measured). extra: G drafts per row (verify: the draft
        tokens [B, G], or G; propose: G); None for a prefill call (one forward over its rows, padded)."""
        cost = self.policy.target_cost if side == "target" else self.policy.draft_cost
        if extra is None:
            return _predict(cost, len(rows) * max((len(r.tokens) for r in rows), default=0))
        backlog = sum(catch_up(r.tokens, VERIFY_ROW_TOKENS if side == "target" else DRAFT_ROW_TOKENS) for r in rows)
        if side == "target":
            width = 1 + (extra.shape[1] if hasattr(extra, "shape") else int(extra))
            return _predict(cost, backlog) + _predict(cost, len(rows) * width)
        return _predict(cost, backlog) + int(extra) * _predict(cost, len(rows))

    async def restart_target(self, why: str) -> None:
        """Kill a stuck target for Ray to restart it; its caches rebuild from our tokens."""
        logger.error("target worker %s: killing it for a restart", why)
        self.totals["worker_restarts"] += 1
        self.on_restart("target restart")
        ray.kill(self.target, no_restart=False)
        await self.until_ready(self.target)

    async def until_ready(self, actor) -> None:
        """Wait until a (restarting) actor answers, up to deadlines.restart_timeout_s; then raise."""
        self.on_restart("a worker restarts")
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


async def answers(actor, timeout: float) -> bool:
    """Whether an actor answers a `ready` probe within timeout seconds."""
    try:
        await asyncio.wait_for(asyncio.ensure_future(actor.ready.remote()), timeout=timeout)
        return True
    except (asyncio.TimeoutError, RayActorError):
        return False


def _predict(cost: TokenCost, tokens: int) -> float:
    """Seconds a forward over `tokens` tokens should take (0 when none, or nothing measured yet)."""
    return cost.predict(tokens) if tokens > 0 and cost.ready else 0.0
