"""One request's coordinator stream, continued on another replica when the one running it is lost.

The coordinator replica that runs a request holds its state (tokens, caches, random stream); the
ingress has already delivered every generated token to the client. So when that replica dies or is
replaced mid-request (the handle's stream raises one of `LOST`, or the replica sends `Lost` as it
leaves because its target has no node left), the ingress submits the request
again with those tokens as `GenerateRequest.resume`: the next replica prefills prompt + them and
goes on, and the caller sees one unbroken sequence of Deltas (speculation totals added up across
replicas). Greedy output is the same as an undisturbed run's; a seeded sampled request carries its
random stream's state (`Delta.rng_state`), so it continues with the numbers the lost replica would
have drawn.

At most `max_resumes` losses per request (first submission included); then `EngineLost`, which the
ingress turns into a 503 before the first byte, or an SSE error event after. A continuation waits
for a replica at most until the request's own deadline.

    cont = Continuation(submit, request, max_resumes, deadline)
    first = await cont.start()          # Accepted | Rejected (raises BackPressureError, EngineLost)
    async for item in cont.items():     # Delta ... (last: finish_reason set) | Failed
        ...
    cont.close()                        # cancels the live stream unless it ran to its end
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import AsyncIterator, Callable

from ray.serve.exceptions import BackPressureError

from .coordinator import TOTALS, Accepted, Delta, Failed, GenerateRequest, Lost, Rejected, Resume
from .lost import LOST

logger = logging.getLogger("specserve.ingress")

BACKOFF_S = (0.05, 0.2, 0.5, 1.0)  # before each continuation: the router learns the replica is gone
LEAVING_RETRY_S = 0.1  # before asking again after a leaving replica's Lost


class EngineLost(RuntimeError):
    """No coordinator replica could continue the request."""


class _EarlyEnd(RuntimeError):
    """A coordinator stream that ended before its final Delta (treated as a lost replica)."""


class _Leaving(RuntimeError):
    """A coordinator replica that gave the request up (`Lost`: its target has no node left)."""


class Continuation:
    """The coordinator stream(s) of one request. `submit(GenerateRequest)` returns a streaming
    handle response (an async iterator with cancel())."""

    def __init__(self, submit: Callable, request: GenerateRequest, max_resumes: int, deadline: float,
                 counts: dict[str, int] | None = None) -> None:
        self._submit = submit
        self.counts = counts if counts is not None else {}  # "continuations", "given_up": the ingress's totals
        self.request = request
        self.max_resumes = max_resumes
        self.deadline = deadline  # time.monotonic(): no continuation starts waiting beyond it
        self.losses = 0
        self.token_ids: list[int] = []  # generated and handed to the caller, in order
        self._rng_state: bytes | None = None
        self._base = (0,) * len(TOTALS)  # speculation totals of the replicas before the current one
        self._totals = self._base  # ... and including it, as last delivered
        self.stream = None
        self.finished = False  # the live stream ran to its end (or was cancelled): nothing to cancel

    async def start(self) -> Accepted | Rejected:
        """Submit the request; its first answer. A replica lost before answering is retried like
        any other loss."""
        while True:
            self.stream = self._submit(self._attempt_request())
            try:
                first = await self._first()
            except LOST as err:
                await self._lost(err)
                continue
            if not isinstance(first, Lost):
                return first
            await self._leaving()

    async def items(self) -> AsyncIterator[Delta | Failed]:
        """Deltas (token ids new since the last one; totals over the whole request) until one has a
        finish_reason, or a Failed; a lost replica in between is invisible here."""
        while True:
            try:
                async for item in self.stream:
                    if isinstance(item, Lost):
                        raise _Leaving(item.message)
                    if isinstance(item, Failed):
                        self.finished = True
                        yield item
                        return
                    delta = self._record(item)
                    if delta.finish_reason is not None:
                        self.finished = True
                    yield delta
                    if self.finished:
                        return
                raise _EarlyEnd("the coordinator stream ended before the request finished")
            except (*LOST, _EarlyEnd, _Leaving) as err:
                await self._lost(err)
                await self._resume()

    def close(self) -> None:
        if not self.finished and self.stream is not None:
            self.finished = True
            self.stream.cancel()

    # -- internals --------------------------------------------------------------------------------
    def _attempt_request(self) -> GenerateRequest:
        """The request as sent this time: the first submission, or a continuation (its own request
        id, in case the lost replica still lives and holds the first)."""
        if self.losses == 0:
            return self.request
        return dataclasses.replace(self.request, request_id=f"{self.request.request_id}.{self.losses}",
                                   resume=Resume(tuple(self.token_ids), self._rng_state))

    async def _first(self):
        left = self.deadline - time.monotonic()
        if self.losses == 0:
            return await self.stream.__anext__()  # Serve's own queue and timeouts bound the first
        try:
            return await asyncio.wait_for(self.stream.__anext__(), timeout=max(left, 0.0))
        except asyncio.TimeoutError:
            self._cancel_quietly()
            self.counts["given_up"] = self.counts.get("given_up", 0) + 1
            raise EngineLost("no engine replica took the request over before its deadline") from None

    async def _lost(self, err: BaseException) -> None:
        """Count a loss (raise EngineLost when none is left) and wait a moment before the next try."""
        self._cancel_quietly()
        self.losses += 1
        if self.losses > self.max_resumes:
            self.counts["given_up"] = self.counts.get("given_up", 0) + 1
            raise EngineLost(f"the engine replica serving this request was lost ({type(err).__name__}) and "
                             f"{self.max_resumes} continuations did not complete it") from err
        logger.warning("request %s: engine replica lost (%s) after %d tokens; continuing it on another replica "
                       "(%d/%d)", self.request.request_id, type(err).__name__, len(self.token_ids), self.losses,
                       self.max_resumes)
        self.counts["continuations"] = self.counts.get("continuations", 0) + 1
        self._base = self._totals
        await asyncio.sleep(BACKOFF_S[min(self.losses - 1, len(BACKOFF_S) - 1)])

    async def _resume(self) -> None:
        """Submit the continuation; raise EngineLost if none gets accepted."""
        while True:
            self.stream = self._submit(self._attempt_request())
            try:
                first = await self._first()
            except (*LOST, BackPressureError) as err:  # (Serve's queue full: try again, as bounded)
                await self._lost(err)
                continue
            if isinstance(first, Lost):
                await self._leaving()
                continue
            if isinstance(first, Accepted):
                return
            self._cancel_quietly()
            self.counts["given_up"] = self.counts.get("given_up", 0) + 1
            raise EngineLost(f"no engine replica took the request over ({first.code}: {first.message})")

    async def _leaving(self) -> None:
        """The replica chosen is leaving (`Lost` as its first answer: it took nothing over): ask
        again shortly, not counted as a loss; it exits within moments and the router drops it."""
        self._cancel_quietly()
        if time.monotonic() > self.deadline:
            self.counts["given_up"] = self.counts.get("given_up", 0) + 1
            raise EngineLost("no engine replica took the request over before its deadline")
        await asyncio.sleep(LEAVING_RETRY_S)

    def _record(self, delta: Delta) -> Delta:
        self.token_ids.extend(delta.token_ids)
        if delta.rng_state is not None:
            self._rng_state = delta.rng_state
        self._totals = tuple(b + getattr(delta, name) for b, name in zip(self._base, TOTALS))
        if not any(self._base):
            return delta
        return dataclasses.replace(delta, **dict(zip(TOTALS, self._totals)))

    def _cancel_quietly(self) -> None:
        try:
            if self.stream is not None:
                self.stream.cancel()
        except Exception:  # a stream of a dead replica may refuse; nothing is left to free there
            pass
