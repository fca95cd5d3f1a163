"""Background responses (`background: true` in OpenAI's Responses API): the request returns at
once with the response in progress, stored; this ingress replica generates it in a task of its
own and stores the finished response, which `GET /v1/responses/{id}` then gives. Every `POLL_S`
seconds the task asks the store whether to go on: a cancel (`POST /v1/responses/{id}/cancel`)
or a DELETE, through any replica, stops the generation there. Where this replica is lost, the
store reads the response as failed once its lease runs out (response_store.py).

With `stream: true` as well, the request's answer is the response's event stream, and the events
are kept too: this replica sends its followers each event as it comes, and hands the store the
new ones every `FLUSH_S` seconds, so that `GET /v1/responses/{id}?stream=true&starting_after=n`,
through any replica, streams every event after the n-th and then follows the rest. A client that
goes away stops nothing: the generation goes on, and the stream can be taken up again.

A replica's runs hand over on the same ticks, and its followers of responses generating
elsewhere ask on the same ticks: each tick's hand-overs are one store call, and so are its
followers' questions (`Batched`), however many there are.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Hashable

from . import response_store
from .front_door import KeyLimits, OpenAIError
from .response_store import StoreClient
from .responses_api import Generation, ResponseEvents, ResponseShape, abandon, whole_response

logger = logging.getLogger("specserve.responses")

FLUSH_S = 0.1  # how often a streamed background response's new events are handed to the store
FOLLOW_S = 0.1  # how often a follower on another replica asks the store for new events
FINISH_S = 60.0  # how long a finished response is offered to a store that is unavailable (restarting)


@dataclass
class _Run:
    """A background response generating on this replica; `events` (streamed ones only): every
    event so far, the n-th with sequence number n."""

    owner: int
    events: list[str] | None
    ended: bool = False
    held: bool = True  # whether it holds a running request of its key (not while its creator streams it)
    changed: asyncio.Event = field(default_factory=asyncio.Event)  # set (and replaced) at each change

    def add(self, event: str) -> None:
        self.events.append(event)
        self._tell()

    def end(self) -> None:
        self.ended = True
        self._tell()

    def _tell(self) -> None:
        told, self.changed = self.changed, asyncio.Event()
        told.set()


class BackgroundRuns:
    """The background responses this ingress replica is generating; each counts as a running
    request of its key (`limits`: front_door.per_key) until it ends: a streamed one as its
    creating request while that streams it, then by itself."""

    def __init__(self, store: StoreClient, limits: KeyLimits) -> None:
        self.store, self.limits = store, limits
        self._runs: dict[str, _Run] = {}  # response id -> its run, while it generates
        self._batch = Batched(store, "hand_over")  # (every run hands over on the same ticks: one store call a tick)
        self._follows = Batched(store, "events_many")  # (so do the followers of runs on other replicas)
        self._tasks: set[asyncio.Task] = set()  # (held: a task only the loop refers to may be collected)

    def __len__(self) -> int:
        return len(self._tasks)

    async def start(self, shape: ResponseShape, generation: Generation, field_name: str | None,
                    history: list[dict], inputs: list[dict], owner: int,
                    events: ResponseEvents | None = None,
                    then: Callable[[dict], Awaitable[None]] | None = None) -> dict:
        """Store the response as in progress and generate it in the background (its events kept
        where `events` is given: streamed); the response as stored now. A generation still to
        begin (a compaction's summary first) begins in the task. A 503 (the generation stopped)
        when it cannot be stored, since nobody could read it then. `then(response)`, where given,
        once the finished response is stored."""
        response = shape.envelope("in_progress", [])
        if not await self.store.keep(response, history, inputs, owner, events is not None):
            abandon(generation)
            raise OpenAIError(503, "background: the response could not be stored, so it could not be read back "
                                   "(the store is unavailable, or the conversation is over "
                                   "responses.max_stored_bytes)", "background", "store_unavailable", "server_error",
                              {"Retry-After": "1"})
        # a running request of its key until it ends; a streamed one's creator is one while it streams it
        run = self._runs[shape.rid] = _Run(owner, None if events is None else [], held=events is None)
        if run.held:
            self.limits.hold(owner)
        if events is None:
            work = whole_response(shape, generation, field_name, _marked_stored)
        else:
            work = _streamed(run, events, generation)
        task = asyncio.ensure_future(self._run(shape.rid, run, work, shape, then))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return response

    def opening(self, response_id: str) -> AsyncIterator[str]:
        """The stream of the request that has just created a streamed background response: each
        event as it comes. Call creator_gone once that stream has closed."""
        return _local(self._runs[response_id], None)

    def creator_gone(self, response_id: str) -> None:
        """The creating request's stream closed (read to its end, or its client gone): where the
        response still runs, it takes that request's place among its key's running requests."""
        run = self._runs.get(response_id)
        if run is not None and not run.held:
            self.limits.hold(run.owner)
            run.held = True

    def _let_go(self, run: _Run) -> None:
        """The run's running request of its key given up, where it holds one."""
        if run.held:
            self.limits.leave(run.owner)
            run.held = False

    async def follow(self, response_id: str, owner: int, after: int | None) -> AsyncIterator[str]:
        """A streamed background response's events after the `after`-th (None: all), then the
        rest as they come; 404 for a response not stored, 400 for one that was not streamed."""
        run = self._runs.get(response_id)
        if run is not None and run.owner == owner and run.events is not None:
            return _local(run, after)
        found = await self.store.call("events", response_id, owner, after) if self.store.on else None
        if found is None:  # (before any event is sent)
            raise OpenAIError(404, f"no stored response {response_id!r}", "response_id", "not_found")
        if found["events"] is None:
            raise OpenAIError(400, f"response {response_id!r} was not created with background: true and "
                                   "stream: true: only those can be streamed again", "stream")
        return self._stored(response_id, owner, after, found)

    async def _stored(self, response_id: str, owner: int, after: int | None, found: dict) -> AsyncIterator[str]:
        """Events as the store holds them (`found`: its first answer), asked every FOLLOW_S until
        the response has ended."""
        while True:
            if found is None:  # (deleted, or dropped, meanwhile)
                return
            for event in found["events"]:
                yield event
            after = (-1 if after is None else after) + len(found["events"])
            if found["ended"]:
                return
            found = await self._next_events(response_id, owner, after)

    async def _next_events(self, response_id: str, owner: int, after: int) -> dict | None:
        """The store's next answer, on the next FOLLOW_S tick (every follower of this replica asks
        on the same ticks: one call); through a store unavailable for a while, asked again (for at
        most LEASE_S: then None, and the stream ends)."""
        deadline = time.monotonic() + response_store.LEASE_S
        while True:
            await asyncio.sleep(FOLLOW_S - time.monotonic() % FOLLOW_S)
            try:
                return await self._follows((response_id, owner, after), (response_id, owner, after))
            except OpenAIError:
                if time.monotonic() > deadline:
                    logger.warning("the response store stayed unavailable: a stream of %s ended", response_id)
                    return None

    async def _run(self, response_id: str, run: _Run, work, shape: ResponseShape,
                   then: Callable[[dict], Awaitable[None]] | None) -> None:
        """The whole generation, then the finished (or failed) response stored; stopped at the
        first poll that says it is not to go on."""
        work = asyncio.ensure_future(work)
        tick = response_store.POLL_S if run.events is None else min(FLUSH_S, response_store.POLL_S)
        try:
            kept, asked = 0, time.monotonic()  # events the store holds; when it was last asked
            while not (await asyncio.wait([work], timeout=tick - time.monotonic() % tick))[0]:  # (on the tick)
                new = run.events is not None and len(run.events) > kept
                if new or time.monotonic() - asked >= response_store.POLL_S:
                    going, kept = await self._hand_over(response_id, run, kept)
                    asked = time.monotonic()
                    if not going:
                        logger.info("background response %s cancelled or deleted: its generation stopped", response_id)
                        return
            try:
                response = work.result()
            except OpenAIError as err:  # (the engine failed, or was lost beyond every continuation)
                response = shape.failed([], err.body()["error"])
            new = [] if run.events is None else run.events[kept:]
            if not await self._finish(response, run.owner, new):
                logger.info("background response %s ended after it was cancelled or deleted", response_id)
            elif then is not None:
                await then(response)
        except Exception:
            logger.exception("background response %s could not be finished", response_id)
        finally:
            work.cancel()
            run.end()
            del self._runs[response_id]
            self._let_go(run)

    async def _finish(self, response: dict, owner: int, events: list[str]) -> bool:
        """The finished response stored (ResponseStore.finish); through a store unavailable for a
        while (its replica restarting, which with responses.persist_dir keeps what it held),
        offered again every POLL_S for up to FINISH_S (then the OpenAIError is raised)."""
        deadline = time.monotonic() + FINISH_S
        while True:
            try:
                return await self.store.call("finish", response, owner, events)
            except OpenAIError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(response_store.POLL_S)

    async def _hand_over(self, response_id: str, run: _Run, kept: int) -> tuple[bool, int]:
        """The run's new events to the store (which renews its lease): whether it is to go on (not
        cancelled, deleted or failed), and how many of its events the store now holds."""
        new = [] if run.events is None else run.events[kept:]
        try:
            return await self._batch(response_id, (run.owner, new)), kept + len(new)
        except OpenAIError:  # the store unavailable for a moment: go on (the lease allows LEASE_S)
            return True, kept


class Batched:
    """Calls of one store method from many tasks of this replica, as one: the asks made in the
    same moment (the tasks tick together) go in one call of `method` with {key: args}, which
    answers {key: answer}, and those made while a call is under way go in the next. Asks with
    the same key share one answer (two followers of one response at one place). A task waits for
    its answer before it asks again, so a run's hand-overs stay in order."""

    def __init__(self, store: StoreClient, method: str) -> None:
        self.store, self.method = store, method
        self._waiting: dict[Hashable, tuple[Any, list[asyncio.Future]]] = {}  # key -> (args, its askers' answers)
        self._sending: asyncio.Task | None = None

    async def __call__(self, key: Hashable, args: Any):
        """The answer to `args` (raises OpenAIError where the store is unavailable)."""
        answer = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(key, (args, []))[1].append(answer)
        if self._sending is None or self._sending.done():
            self._sending = asyncio.ensure_future(self._send())
        return await answer

    async def _send(self) -> None:
        await asyncio.sleep(0)  # (the other tasks woken on this tick ask first)
        while self._waiting:
            batch, self._waiting = self._waiting, {}
            try:
                answers = await self.store.call(self.method, {key: args for key, (args, _) in batch.items()})
            except OpenAIError as err:
                answers = err
            for key, (_, askers) in batch.items():
                for answer in askers:
                    if answer.done():  # (its task was cancelled meanwhile)
                        continue
                    if isinstance(answers, OpenAIError):
                        answer.set_exception(answers)
                    else:
                        answer.set_result(answers[key])


async def _marked_stored(response: dict) -> None:
    """whole_response's keep for a background response: the store is written by its task."""
    response["store"] = True


async def _streamed(run: _Run, events: ResponseEvents, generation: Generation) -> dict:
    """Every event of the generation into the run; the finished response."""
    done: list[dict] = []

    async def ended(response: dict) -> None:
        await _marked_stored(response)
        done.append(response)

    try:
        async for event in events.stream(generation, ended):
            run.add(event)
    except OpenAIError as err:  # (raised, not streamed: a StreamFailed ends in its own response.failed)
        done.append(events.shape.failed(events.output, err.body()["error"]))
        run.add(events.event("response.failed", response=done[0]))
    return done[0]


async def _local(run: _Run, after: int | None) -> AsyncIterator[str]:
    """A run's events after the `after`-th, each as it comes, until the run ends."""
    sent = 0 if after is None else after + 1
    while True:
        changed = run.changed
        while sent < len(run.events):
            yield run.events[sent]
            sent += 1
        if run.ended:
            return
        await changed.wait()
