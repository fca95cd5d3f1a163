"""Background responses (`background: true` in OpenAI's Responses API): the request returns at
once with the response in progress, stored; this ingress replica generates it in a task of its
own and stores the finished response, which `GET /v1/responses/{id}` then gives. Every `POLL_S`
seconds the task asks the store whether to go on: a cancel (`POST /v1/responses/{id}/cancel`)
or a DELETE, through any replica, stops the generation there. Where this replica is lost, the
store reads the response as failed once its lease runs out (response_store.py).
"""
from __future__ import annotations

import asyncio
import logging

from . import response_store
from .front_door import KeyLimits, OpenAIError
from .response_store import StoreClient
from .responses import ResponseFormat
from .responses_api import ResponseShape, whole_response

logger = logging.getLogger("specserve.responses")


class BackgroundRuns:
    """The background responses this ingress replica is generating; each counts as a running
    request of its key (`limits`: front_door.per_key) until it ends."""

    def __init__(self, store: StoreClient, limits: KeyLimits) -> None:
        self.store, self.limits = store, limits
        self._tasks: set[asyncio.Task] = set()  # (held: a task only the loop refers to may be collected)

    def __len__(self) -> int:
        return len(self._tasks)

    async def start(self, shape: ResponseShape, fmt: ResponseFormat, pieces, field_name: str | None,
                    history: list[dict], inputs: list[dict], owner: int, then=None) -> dict:
        """Store the response as in progress and generate it in the background; the response as
        stored now. A 503 (the generation stopped) when it cannot be stored, since nobody could
        read it then. `then(response)`, where given, once the finished response is stored."""
        response = shape.envelope("in_progress", [])
        if not await self.store.keep(response, history, inputs, owner):
            fmt.gen.close()
            raise OpenAIError(503, "background: the response could not be stored, so it could not be read back "
                                   "(the store is unavailable, or the conversation is over "
                                   "responses.max_stored_bytes)", "background", "store_unavailable", "server_error",
                              {"Retry-After": "1"})
        self.limits.hold(owner)  # (released when the task ends)
        task = asyncio.ensure_future(self._run(shape, fmt, pieces, field_name, owner, then))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return response

    async def _run(self, shape: ResponseShape, fmt: ResponseFormat, pieces, field_name: str | None,
                   owner: int, then=None) -> None:
        """The whole generation, then the finished (or failed) response stored; stopped at the
        first poll that says it is not to go on."""
        async def stored(response: dict) -> None:  # (whole_response's keep: the store is written below)
            response["store"] = True

        work = asyncio.ensure_future(whole_response(shape, fmt, pieces, field_name, stored))
        try:
            while not (await asyncio.wait([work], timeout=response_store.POLL_S))[0]:
                if not await self._going_on(shape.rid, owner):
                    logger.info("background response %s cancelled or deleted: its generation stopped", shape.rid)
                    return
            try:
                response = work.result()
            except OpenAIError as err:  # (the engine failed, or was lost beyond every continuation)
                response = shape.failed([], err.body()["error"])
            if not await self.store.call("finish", response, owner):
                logger.info("background response %s ended after it was cancelled or deleted", shape.rid)
            elif then is not None:
                await then(response)
        except Exception:
            logger.exception("background response %s could not be finished", shape.rid)
        finally:
            work.cancel()
            fmt.gen.close()
            self.limits.leave(owner)

    async def _going_on(self, response_id: str, owner: int) -> bool:
        try:
            return await self.store.call("poll", response_id, owner)
        except OpenAIError:  # the store unavailable for a moment: go on (the lease allows LEASE_S)
            return True
