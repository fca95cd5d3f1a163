"""The Responses API's store: the responses given with `store: true`, each as a link of its
conversation (its own input items, its output, and the response it went on from), so that
`previous_response_id` goes on from one and `GET /v1/responses/{id}` finds it. Kept in memory as
JSON, within `responses.max_stored` responses and `max_stored_bytes` bytes: the least recently
used go first (a later turn naming one that went is a 400, as for an id never stored). In an app
it is one Serve deployment that every ingress replica asks, so a conversation may go on through
any of them; in process it is this class alone. With `responses.persist_dir` it keeps a journal
of its changes there (journal.py), so that a restart of its replica holds what it held; without,
a restart forgets it.

A background response (`background: true`) is stored as in progress when it starts and replaced
by the finished response when it ends (`finish`); its ingress asks every `POLL_S` seconds whether
it was cancelled or deleted (`poll`, or `append`), which renews its lease: one whose lease ran out
(its ingress replica was lost) reads as failed. A streamed one (with `stream: true`) keeps its
events as well, handed over as they come (`append`) and read from any sequence number on
(`events`); they count in its bytes, and stay with it, packed once it has ended (`EventLog`).

A turn keeps only what it added, so a conversation of n turns costs its own bytes once, not its
early turns n times over. A link that goes (deleted, or dropped as least recently used) while
later turns still go on from it is no longer found, but stays, hidden, as their history: its
bytes still count, and go with the last of them.
"""
from __future__ import annotations

import asyncio
import base64
import functools
import json
import logging
import threading
import time
import zlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from itertools import accumulate

from ray import serve

from specserve.config import ResponsesConfig

from .front_door import OpenAIError
from .journal import Journal, Journaled
from .lost import LOST
from .responses import sse_event
from .responses_api import with_id

logger = logging.getLogger("specserve.responses")

STORED, TOO_LARGE, NO_PREVIOUS = "stored", "too_large", "no_previous"  # what ResponseStore.put did
RUNNING = ("queued", "in_progress")  # a background response's statuses before it ends
POLL_S = 1.0  # how often a background response's ingress asks after it (and renews its lease)
LEASE_S = 15.0  # a background response not asked after for this long: its ingress replica was lost
# a read that met a lost store replica is asked again for this long: a killed replica answered
# again after 13-19 s on the 2-core machine (docs/serving.md)
STORE_RETRY_S, STORE_RETRY_POLL_S = 20.0, 0.5
# what the Responses API reads of the store (safe to ask again); the background machinery's own
# calls (poll, append, hand_over, events, events_many, finish) keep their own loops
RESPONSE_READS = frozenset({"get", "conversation", "items", "input_items"})


def serialized(cls):
    """The class with each of its public methods run under the instance's one lock (`_lock`, an
    RLock: a method may call another). Serve runs a deployment's sync methods on a pool of
    threads, and a store's methods read and change several structures, and its journal, together."""
    for name, method in list(vars(cls).items()):
        if not name.startswith("_") and callable(method):
            setattr(cls, name, _locked(method))
    return cls


def _locked(method):
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return locked


@dataclass
class _Link:
    owner: int  # the index of the API key that made it (-1 without keys)
    previous: str | None  # the response it went on from (None: a first turn)
    response: bytes  # its JSON
    inputs: bytes  # its own input items' JSON (not the earlier turns')
    later: int = 0  # stored links that go on from this one
    shown: bool = True  # False: deleted or dropped, kept only as the later links' history
    events: EventLog | None = None  # a streamed background response's events

    @property
    def size(self) -> int:
        return len(self.response) + len(self.inputs) + (0 if self.events is None else self.events.size)


class EventLog:
    """A streamed background response's events (SSE text), the n-th with sequence number n: a
    list while it runs; once it has ended, packed (zlib, with where each event ends), since it
    is read rarely then and its deltas repeat themselves (about 20x smaller)."""

    def __init__(self) -> None:
        self._events: list[str] = []
        self._packed: bytes | None = None
        self._ends: array | None = None  # each packed event's end, in characters
        self.size = 0  # bytes held

    def __len__(self) -> int:
        return len(self._events) if self._packed is None else len(self._ends)

    def extend(self, events: list[str]) -> int:
        """Events added at the end (a packed log unpacked first, and packed again); the change in size."""
        packed, before = self._packed is not None, self.size
        self._unpack()
        self._events.extend(events)
        self.size += sum(len(event.encode()) for event in events)
        if packed:
            self.pack()
        return self.size - before

    def since(self, start: int) -> list[str]:
        if self._packed is None:
            return self._events[start:]
        text = zlib.decompress(self._packed).decode()
        return [text[(self._ends[k - 1] if k else 0):self._ends[k]] for k in range(start, len(self._ends))]

    def pack(self) -> int:
        """Packed (once it has ended); the change in size."""
        if self._packed is not None:
            return 0
        before = self.size
        self._ends = array("I", accumulate(len(event) for event in self._events))
        self._packed = zlib.compress("".join(self._events).encode(), 1)
        self._events = []
        self.size = len(self._packed) + self._ends.itemsize * len(self._ends)
        return self.size - before

    def _unpack(self) -> None:
        if self._packed is not None:
            self._events, self._packed, self._ends = self.since(0), None, None

    def dump(self) -> list[str] | dict:
        """As a journal record holds it: the events, or once packed, the packed bytes (base64) and ends."""
        if self._packed is None:
            return list(self._events)
        return {"packed": base64.b64encode(self._packed).decode(), "ends": self._ends.tolist()}

    @classmethod
    def restored(cls, dumped: list[str] | dict | None) -> EventLog | None:
        """The log `dump` gave (None: a response that keeps no events)."""
        if dumped is None:
            return None
        log = cls()
        if isinstance(dumped, list):
            log.extend(dumped)
        else:
            log._packed, log._ends = base64.b64decode(dumped["packed"]), array("I", dumped["ends"])
            log.size = len(log._packed) + log._ends.itemsize * len(log._ends)
        return log


@serialized
class ResponseStore(Journaled):
    """Each response is kept with its owner: asked with another key, it is not there. With
    `journal` (a file's path), every change is recorded there first (`_log`) and the file read
    back at start: the changes themselves (`_add`, `_rewrite`, `_extend`, `_hide`), not the calls
    that made them, so what a time-dependent call decided (a lease that ran out) or which link
    the bounds dropped reads back as it was. Reads are not recorded: after a restart the least
    recently used order is that of the last changes."""

    def __init__(self, max_stored: int, max_stored_bytes: int, journal: str | None = None) -> None:
        self._lock = threading.RLock()  # (every public method holds it: `serialized`)
        self.max_stored, self.max_bytes = max_stored, max_stored_bytes
        self._links: dict[str, _Link] = {}  # id -> link, shown or hidden (a link after the one it went on from)
        self._shown: OrderedDict[str, None] = OrderedDict()  # the shown links' ids, least recently used first
        self._bytes = 0  # of every link, hidden ones included
        self._leases: dict[str, float] = {}  # a running background response's id -> when its ingress last asked
        self._index: dict[tuple[int, str], list[str]] = {}  # (owner, item id) -> the shown responses holding it
        if journal is not None:
            self._open(Journal(journal, "responses"))

    # -- the journal (journal.py) --------------------------------------------------------------------
    def _apply(self, record: list) -> None:
        op, args = record[0], record[1:]
        if op == "put":
            rid, owner, previous, response, inputs, events = args
            link = _Link(owner, previous, response.encode(), inputs.encode(), events=EventLog.restored(events))
            self._add(rid, link, json.loads(response), json.loads(inputs))
        elif op == "rewrite":
            self._rewrite(args[0], json.loads(args[1]))
        elif op == "events":
            self._extend(args[0], self._links[args[0]], args[1])
        elif op == "hide":
            self._hide(args[0])
        elif op == "order":
            for rid in args[0]:
                self._shown.move_to_end(rid)
        else:
            raise ValueError(f"response store journal: unknown record {op!r}")

    def _snapshot(self):
        """Records that make the store as it is: every link (after the one it went on from), the
        hidden ones hidden, then the shown ones' order."""
        for rid, link in self._links.items():
            yield self._put_record(rid, link)
        for rid, link in self._links.items():
            if not link.shown:
                yield ["hide", rid]
        yield ["order", list(self._shown)]

    @staticmethod
    def _put_record(rid: str, link: _Link) -> list:
        return ["put", rid, link.owner, link.previous, link.response.decode(), link.inputs.decode(),
                None if link.events is None else link.events.dump()]

    # -- responses ----------------------------------------------------------------------------------
    def put(self, response: dict, inputs: list[dict], owner: int = -1, previous: str | None = None,
            streamed: bool = False) -> str:
        """Keep a response, its own input items (an item without an id gets one) and the response
        it went on from (`streamed`: a background response whose events are kept as well):
        STORED; TOO_LARGE when its whole conversation is over the byte bound, or NO_PREVIOUS when
        `previous` is no longer here (then nothing is kept)."""
        inputs = [with_id(item) for item in inputs]
        link = _Link(owner, previous, json.dumps(response).encode(), json.dumps(inputs).encode(),
                     events=EventLog() if streamed else None)
        before = None if previous is None else self._links.get(previous)
        if previous is not None and (before is None or before.owner != owner):
            return NO_PREVIOUS
        if response["id"] in self._links:
            raise ValueError(f"response {response['id']} is stored already")
        size = link.size + sum(earlier.size for _, earlier in self._chain(previous))
        if size > self.max_bytes:
            logger.warning("response %s (%d bytes with its earlier turns) is larger than "
                           "responses.max_stored_bytes: not stored", response["id"], size)
            return TOO_LARGE
        self._add(response["id"], link, response, inputs)
        self._bound()  # (never this one: its conversation alone fits)
        return STORED

    def _add(self, rid: str, link: _Link, response: dict, inputs: list[dict]) -> None:
        """A new link kept (`response` and `inputs`: its JSON, decoded)."""
        self._log(self._put_record(rid, link))
        if link.previous is not None:
            self._links[link.previous].later += 1
        self._links[rid] = link
        self._shown[rid] = None
        self._bytes += link.size
        if response.get("background") and response["status"] in RUNNING:
            self._leases[rid] = time.monotonic()
        self._list(rid, link.owner, inputs + response.get("output", []))

    def get(self, response_id: str, owner: int = -1) -> dict | None:
        link = self._touch(response_id, owner)
        return None if link is None else self._response(response_id, link)

    def conversation(self, response_id: str, owner: int = -1) -> list[dict] | None:
        """A response's input items and then its output items, the earlier turns' first: what a
        next turn goes on from (None, too, while it is in progress)."""
        link = self._touch(response_id, owner)
        if link is None or self._response(response_id, link).get("status") in RUNNING:
            return None
        return self._items(response_id)

    def items(self, item_ids: list[str], owner: int = -1) -> list[dict | None]:
        """Each of these items as a stored response holds it (its input or output; None: in none)."""
        found = []
        for item_id in item_ids:
            holders = self._index.get((owner, item_id))
            link = None if not holders else self._touch(holders[-1], owner)
            found.append(None if link is None else next(
                (item for item in _own_items(link) if item.get("id") == item_id), None))
        return found

    # -- background responses ---------------------------------------------------------------------
    def poll(self, response_id: str, owner: int = -1) -> bool:
        """Whether a background response is to go on (not cancelled, not deleted, not failed),
        its lease renewed."""
        link = self._touch(response_id, owner)
        if link is None or response_id not in self._leases:
            return False
        self._response(response_id, link)  # (a lease that ran out: failed)
        if response_id not in self._leases:
            return False
        self._leases[response_id] = time.monotonic()
        return True

    def append(self, response_id: str, owner: int = -1, events: list[str] = ()) -> bool:
        """poll, with a streamed background response's new events kept as well: those made before
        its generation learnt of a cancel too (this call tells it), but none after its end."""
        going = self.poll(response_id, owner)
        link = self._links.get(response_id) if events else None
        if link is None or link.events is None or not link.shown or link.owner != owner:
            return going
        if going or self._response(response_id, link)["status"] == "cancelled":
            self._extend(response_id, link, events)
            self._bound()  # (this one too, where its events alone pass the bound: it stops then)
        return going and link.shown

    def hand_over(self, batch: dict[str, tuple[int, list[str]]]) -> dict[str, bool]:
        """`append` for many responses at once (response id -> (owner, events)), as one ingress
        replica's background responses hand over together: whether each is to go on."""
        return {rid: self.append(rid, owner, events) for rid, (owner, events) in batch.items()}

    def events_many(self, asks: dict) -> dict:
        """`events` for many asks at once (key -> (response id, owner, after)), as one ingress
        replica's followers ask together: key -> the answer."""
        return {key: self.events(*ask) for key, ask in asks.items()}

    def events(self, response_id: str, owner: int = -1, after: int | None = None) -> dict | None:
        """A response's events after the `after`-th (None: all; `events` None where it was not a
        streamed background response) and whether it has ended (no more will come)."""
        link = self._touch(response_id, owner)
        if link is None:
            return None
        ended = self._response(response_id, link)["status"] not in RUNNING
        start = 0 if after is None else after + 1
        return {"events": None if link.events is None else link.events.since(start), "ended": ended}

    def finish(self, response: dict, owner: int = -1, events: list[str] = ()) -> bool:
        """A background response's end (its last events kept first): the finished response in
        place of the running one; False (nothing changed) when it was cancelled, deleted, or its
        lease ran out meanwhile."""
        rid = response["id"]
        if not self.append(rid, owner, events):
            return False
        self._rewrite(rid, response)
        self._bound()
        return True

    def cancel(self, response_id: str, owner: int = -1) -> dict | None:
        """A background response cancelled (its ingress stops it at its next poll), as it now
        reads; one that has ended as it is."""
        link = self._touch(response_id, owner)
        if link is None:
            return None
        response = self._response(response_id, link)
        if response_id in self._leases:
            response["status"] = "cancelled"
            self._rewrite(response_id, response)
            self._bound()
        return response

    def _response(self, response_id: str, link: _Link) -> dict:
        """A link's response; a background one whose lease ran out rewritten as failed first."""
        response = json.loads(link.response)
        lease = self._leases.get(response_id)
        if lease is not None and time.monotonic() - lease > LEASE_S:
            response.update(status="failed", error={
                "code": "server_error", "message": "the server replica generating this background response was "
                                                   "lost; create the response again"})
            if link.events is not None:  # (a follower's stream ends with it)
                data = {"type": "response.failed", "sequence_number": len(link.events), "response": response}
                self._extend(response_id, link, [f"event: {data['type']}\n" + sse_event(data)])
            self._rewrite(response_id, response)
            self._bound()
        return response

    def _extend(self, response_id: str, link: _Link, events: list[str]) -> None:
        """A streamed background response's new events kept."""
        self._log(["events", response_id, list(events)])
        self._bytes += link.events.extend(events)

    def _rewrite(self, response_id: str, response: dict) -> None:
        """A stored link's response replaced (it has ended: no lease any more, its events packed)."""
        encoded = json.dumps(response)
        self._log(["rewrite", response_id, encoded])
        link = self._links[response_id]
        self._leases.pop(response_id, None)
        self._bytes -= len(link.response)
        link.response = encoded.encode()
        self._bytes += len(link.response) + (0 if link.events is None else link.events.pack())
        self._list(response_id, link.owner, response.get("output", []))  # (its inputs are listed already)

    def _bound(self) -> None:
        """The least recently used links hidden until both bounds hold."""
        while self._shown and (len(self._shown) > self.max_stored or self._bytes > self.max_bytes):
            self._hide(next(iter(self._shown)))

    def input_items(self, response_id: str, owner: int = -1) -> list[dict] | None:
        """The items that led to a response: the earlier turns' inputs and outputs, then its own inputs."""
        link = self._touch(response_id, owner)
        return None if link is None else self._items(link.previous) + json.loads(link.inputs)

    def delete(self, response_id: str, owner: int = -1) -> bool:
        if self._touch(response_id, owner) is None:
            return False
        self._hide(response_id)
        return True

    def __len__(self) -> int:
        return len(self._shown)

    def _touch(self, response_id: str, owner: int) -> _Link | None:
        link = self._links.get(response_id)
        if link is None or not link.shown or link.owner != owner:
            return None
        self._shown.move_to_end(response_id)
        return link

    def _chain(self, response_id: str | None) -> list[tuple[str, _Link]]:
        """A link and the ones it went on from, the latest first."""
        chain = []
        while response_id is not None:
            chain.append((response_id, self._links[response_id]))
            response_id = chain[-1][1].previous
        return chain

    def _items(self, response_id: str | None) -> list[dict]:
        """Every item of a conversation through this link (hidden links' included), the first turn's first."""
        return [item for _, link in reversed(self._chain(response_id)) for item in _own_items(link)]

    def _list(self, response_id: str, owner: int, items: list[dict]) -> None:
        """A shown link's items in the index (item_reference finds them), from the dicts at hand
        rather than its JSON decoded again."""
        for item in items:
            if not item.get("id"):
                continue
            holders = self._index.setdefault((owner, item["id"]), [])
            if response_id not in holders:
                holders.append(response_id)

    def _hide(self, response_id: str) -> None:
        """No longer found; its bytes freed, and any earlier hidden link's that only it kept."""
        self._log(["hide", response_id])
        hidden = self._links[response_id]
        hidden.shown = False
        self._leases.pop(response_id, None)
        del self._shown[response_id]
        for item in _own_items(hidden):
            holders = self._index.get((hidden.owner, item.get("id")), [])
            if response_id in holders:
                holders.remove(response_id)
                if not holders:
                    del self._index[hidden.owner, item["id"]]
        while response_id is not None:
            link = self._links[response_id]
            if link.shown or link.later:
                return
            del self._links[response_id]
            self._bytes -= link.size
            response_id = link.previous
            if response_id is not None:
                self._links[response_id].later -= 1


def _own_items(link: _Link) -> list[dict]:
    """A link's own input items, then its output items."""
    return json.loads(link.inputs) + json.loads(link.response).get("output", [])


async def store_call(local, handle, name: str, method: str, *args, reads: frozenset = frozenset()):
    """What a store's `method` answers: the local store's (in process), else its deployment's
    through `handle`; a 503 when the deployment is unavailable. One of `reads` (it changes
    nothing, so asking twice is safe) that met a lost replica is asked again, every
    `STORE_RETRY_POLL_S`, for up to `STORE_RETRY_S`: while Serve replaces the replica, the caller
    waits rather than getting the 503 (a change is not asked twice: the lost replica may have
    made it)."""
    if local is not None:
        return getattr(local, method)(*args)
    deadline = time.monotonic() + STORE_RETRY_S
    while True:
        try:
            return await getattr(handle, method).remote(*args)
        except LOST as err:
            if method not in reads or time.monotonic() >= deadline:
                raise _unavailable(name, err) from err
            logger.info("the %s's replica was lost (%s): asking %s again", name, type(err).__name__, method)
        except Exception as err:
            raise _unavailable(name, err) from err
        await asyncio.sleep(STORE_RETRY_POLL_S)


def _unavailable(name: str, err: BaseException) -> OpenAIError:
    return OpenAIError(503, f"the {name} is unavailable: {type(err).__name__}", None,
                       "store_unavailable", "server_error", {"Retry-After": "1"})


class StoreClient:
    """The ingress's side of the store: the app's ResponseStore deployment (a handle), or, in
    process, a ResponseStore of its own; none where `responses.store` is off."""

    def __init__(self, handle, config: ResponsesConfig) -> None:
        self.on = config.store
        self._local = None if handle is not None else \
            ResponseStore(config.max_stored, config.max_stored_bytes, config.journal("responses"))
        self._handle = handle

    async def call(self, method: str, *args):
        return await store_call(self._local, self._handle, "response store", method, *args, reads=RESPONSE_READS)

    async def history(self, previous_id: str | None, owner: int) -> list[dict]:
        """The items a previous response leaves (its input, then its output); 400 for one not kept."""
        if previous_id is None:
            return []
        items = await self.call("conversation", previous_id, owner) if self.on else None
        if items is None:
            raise OpenAIError(400, f"previous_response_id: no stored response {previous_id!r} (never stored, "
                                   "deleted, dropped from the store, or a background response still in progress)",
                              "previous_response_id", "not_found")
        return items

    async def referenced(self, item_ids: list[str], owner: int) -> dict[str, dict]:
        """The stored items these `item_reference` inputs name, by id; 400 for one in no stored response."""
        found = await self.call("items", item_ids, owner) if self.on else [None] * len(item_ids)
        for item_id, item in zip(item_ids, found):
            if item is None:
                raise OpenAIError(400, f"input: item_reference {item_id!r}: no stored response holds that item "
                                       "(never stored, deleted, or dropped from the store)", "input", "not_found")
        return dict(zip(item_ids, found))

    async def stored(self, method: str, response_id: str, owner: int):
        """What `method` (get, input_items, delete, cancel) gives for a stored response; 404 for another id."""
        found = await self.call(method, response_id, owner) if self.on else None
        if found is None or found is False:
            raise OpenAIError(404, f"no stored response {response_id!r}", "response_id", "not_found")
        return found

    async def keep(self, response: dict, history: list[dict], inputs: list[dict], owner: int,
                   streamed: bool = False) -> bool:
        """Store a response that went on from `response["previous_response_id"]` (its items:
        `history`) with its own input items (`streamed`: ResponseStore.put's); False when it could
        not be kept (too large, or the store unavailable). Where the previous response went while
        this one was generated, its items are kept with this one's."""
        previous = response.get("previous_response_id")
        try:
            done = await self.call("put", response, inputs, owner, previous, streamed)
            if done == NO_PREVIOUS:
                done = await self.call("put", response, history + inputs, owner, None, streamed)
        except OpenAIError:
            logger.warning("the response store is unavailable: response %s not stored", response["id"])
            return False
        return done == STORED


# Serve checks a store replica's health every second (not every 10 s): one that died is replaced
# sooner, and every Responses API call that needs the store is a 503 until it is (a killed replica
# answered again after 13.4 s instead of 20.8 s on the 2-core machine, docs/serving.md). A dead
# replica fails its check at once; the timeout stays Serve's 30 s, so that a replica that is only
# slow on a loaded machine is not restarted for it.
STORE_HEALTH = {"health_check_period_s": 1.0, "health_check_timeout_s": 30.0}

# One replica for the whole app (a second would hold other responses); every call is a dict lookup.
# A redeploy stops the old replica before it starts the new one (Serve's max_surge_percent 0): the
# new one waits for the old one's journal (journal.py, `hold`), which the old lets go at its stop.
ResponseStoreDeployment = serve.deployment(num_replicas=1, max_ongoing_requests=1024, **STORE_HEALTH,
                                           ray_actor_options={"num_cpus": 0.05})(ResponseStore)
