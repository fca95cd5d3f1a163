"""The Responses API's store: the responses given with `store: true`, each with the input that led
to it (the earlier turns' items included), so that `previous_response_id` goes on from one and
`GET /v1/responses/{id}` finds it. Kept in memory as JSON, within `responses.max_stored` responses
and `max_stored_bytes` bytes: the least recently used go first (a later turn naming one that went
is a 400, as for an id never stored). In an app it is one Serve deployment that every ingress
replica asks, so a conversation may go on through any of them; in process it is this class alone.
A restart of the store's replica forgets what it held.
"""
from __future__ import annotations

import json
import logging
import uuid
from collections import OrderedDict

from ray import serve

from specserve.config import ResponsesConfig

from .front_door import OpenAIError

logger = logging.getLogger("specserve.responses")


class ResponseStore:
    """Each response is kept with its owner, the index of the API key that made it (-1 without
    keys): asked with another key, it is not there."""

    def __init__(self, max_stored: int, max_stored_bytes: int) -> None:
        self.max_stored, self.max_bytes = max_stored, max_stored_bytes
        self._entries: OrderedDict[str, tuple[int, bytes, bytes]] = OrderedDict()  # id -> (owner, response, inputs)
        self._bytes = 0

    def put(self, response: dict, inputs: list[dict], owner: int = -1) -> bool:
        """Keep a response and its input items (an item without an id gets one). False when it
        alone is over the byte bound (then nothing is kept)."""
        inputs = [item if item.get("id") else {**item, "id": f"{_prefix(item)}_{uuid.uuid4().hex}"}
                  for item in inputs]
        entry = (owner, json.dumps(response).encode(), json.dumps(inputs).encode())
        size = _size(entry)
        if size > self.max_bytes:
            logger.warning("response %s (%d bytes) is larger than responses.max_stored_bytes: not stored",
                           response["id"], size)
            return False
        self.delete(response["id"], owner)
        self._entries[response["id"]] = entry
        self._bytes += size
        while len(self._entries) > self.max_stored or self._bytes > self.max_bytes:
            self._bytes -= _size(self._entries.popitem(last=False)[1])
        return True

    def get(self, response_id: str, owner: int = -1) -> dict | None:
        entry = self._touch(response_id, owner)
        return None if entry is None else json.loads(entry[1])

    def conversation(self, response_id: str, owner: int = -1) -> list[dict] | None:
        """A response's input items and then its output items: what a next turn goes on from."""
        entry = self._touch(response_id, owner)
        return None if entry is None else json.loads(entry[2]) + json.loads(entry[1])["output"]

    def input_items(self, response_id: str, owner: int = -1) -> list[dict] | None:
        entry = self._touch(response_id, owner)
        return None if entry is None else json.loads(entry[2])

    def delete(self, response_id: str, owner: int = -1) -> bool:
        if self._touch(response_id, owner) is None:
            return False
        self._bytes -= _size(self._entries.pop(response_id))
        return True

    def __len__(self) -> int:
        return len(self._entries)

    def _touch(self, response_id: str, owner: int) -> tuple[int, bytes, bytes] | None:
        entry = self._entries.get(response_id)
        if entry is None or entry[0] != owner:
            return None
        self._entries.move_to_end(response_id)
        return entry


def _size(entry: tuple[int, bytes, bytes]) -> int:
    return len(entry[1]) + len(entry[2])


def _prefix(item: dict) -> str:
    return {"message": "msg", "function_call": "fc", "function_call_output": "fco",
            "reasoning": "rs"}.get(item.get("type", "message"), "item")


class StoreClient:
    """The ingress's side of the store: the app's ResponseStore deployment (a handle), or, in
    process, a ResponseStore of its own; none where `responses.store` is off."""

    def __init__(self, handle, config: ResponsesConfig) -> None:
        self.on = config.store
        self._local = ResponseStore(config.max_stored, config.max_stored_bytes) if handle is None else None
        self._handle = handle

    async def call(self, method: str, *args):
        if self._local is not None:
            return getattr(self._local, method)(*args)
        try:
            return await getattr(self._handle, method).remote(*args)
        except Exception as err:
            raise OpenAIError(503, f"the response store is unavailable: {type(err).__name__}", None,
                              "store_unavailable", "server_error", {"Retry-After": "1"}) from err

    async def history(self, previous_id: str | None, owner: int) -> list[dict]:
        """The items a previous response leaves (its input, then its output); 400 for one not kept."""
        if previous_id is None:
            return []
        items = await self.call("conversation", previous_id, owner) if self.on else None
        if items is None:
            raise OpenAIError(400, f"previous_response_id: no stored response {previous_id!r} (never stored, "
                                   "deleted, or dropped from the store)", "previous_response_id", "not_found")
        return items

    async def stored(self, method: str, response_id: str, owner: int):
        """What `method` (get, input_items, delete) gives for a stored response; 404 for another id."""
        found = await self.call(method, response_id, owner) if self.on else None
        if found is None or found is False:
            raise OpenAIError(404, f"no stored response {response_id!r}", "response_id", "not_found")
        return found

    async def keep(self, response: dict, inputs: list[dict], owner: int) -> bool:
        """Store a response; False when it could not be kept (too large, or the store unavailable)."""
        try:
            return await self.call("put", response, inputs, owner)
        except OpenAIError:
            logger.warning("the response store is unavailable: response %s not stored", response["id"])
            return False


# One replica for the whole app (a second would hold other responses); every call is a dict lookup.
ResponseStoreDeployment = serve.deployment(num_replicas=1, max_ongoing_requests=1024,
                                           ray_actor_options={"num_cpus": 0.05})(ResponseStore)
