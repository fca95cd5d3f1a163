"""The Conversations API's store (`/v1/conversations`): each conversation's metadata and items,
kept with the API key that made it (another key does not find it). A response created with
`conversation` goes on from its items and, once it ends, adds its input and output items.

Kept in memory as JSON bytes, one string per item, so adding n items to a conversation costs
those n items only; within `responses.max_conversations` conversations and
`max_conversation_bytes` bytes in all, the least recently used (read or written) go first. In an
app it is one Serve deployment that every ingress replica asks; in process it is this class
alone. With `responses.persist_dir` it keeps a journal of its changes there (journal.py), read
back when its replica restarts (the least recently used order then that of the last changes).
Its methods answer with sentinels rather than raising, so that an answer crosses a handle as it
is; `ConversationClient` turns them into OpenAI's errors.
"""
from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

from ray import serve

from specserve.config import ResponsesConfig

from .front_door import OpenAIError
from .journal import Journal, Journaled
from .response_store import STORE_HEALTH, serialized, store_call
from .responses_api import as_stored, input_page

logger = logging.getLogger("specserve.responses")

NO_CONVERSATION, NO_ITEM, NO_AFTER, TOO_LARGE = "no_conversation", "no_item", "no_after", "too_large"  # (not done)
CONVERSATION_READS = frozenset({"get", "items", "page", "item"})  # (safe to ask again: `store_call`)


@dataclass
class _Conversation:
    owner: int  # the index of the API key that made it (-1 without keys)
    created_at: int
    metadata: bytes  # its JSON
    items: OrderedDict[str, bytes] = field(default_factory=OrderedDict)  # item id -> its JSON, oldest first
    size: int = 0  # the bytes of its metadata and items

    def view(self, cid: str) -> dict:
        return {"id": cid, "object": "conversation", "created_at": self.created_at,
                "metadata": json.loads(self.metadata)}


@serialized
class ConversationStore(Journaled):
    """With `journal` (a file's path), every change is recorded there first and read back at
    start (journal.py): `_create`, `_add`, `_set_metadata`, `_drop_item`, `_drop`."""

    def __init__(self, max_conversations: int, max_bytes: int, journal: str | None = None) -> None:
        self._lock = threading.RLock()  # (every public method holds it: `serialized`)
        self.max_conversations, self.max_bytes = max_conversations, max_bytes
        self._conversations: OrderedDict[str, _Conversation] = OrderedDict()  # least recently used first
        self._bytes = 0  # of every conversation
        if journal is not None:
            self._open(Journal(journal, "conversations"))

    # -- the journal (journal.py) --------------------------------------------------------------------
    def _apply(self, record: list) -> None:
        op, cid, *args = record
        if op == "create":
            owner, created_at, metadata = args
            self._create(cid, _Conversation(owner, created_at, metadata.encode()))
        elif op == "items":
            self._add(cid, self._conversations[cid], [(item_id, encoded.encode()) for item_id, encoded in args[0]])
        elif op == "metadata":
            self._set_metadata(cid, self._conversations[cid], args[0].encode())
        elif op == "drop_item":
            self._drop_item(cid, self._conversations[cid], args[0])
        elif op == "drop":
            self._drop(cid)
        else:
            raise ValueError(f"conversation store journal: unknown record {op!r}")

    def _snapshot(self):
        """Records that make the store as it is: each conversation and its items, the least
        recently used first."""
        for cid, conversation in self._conversations.items():
            yield ["create", cid, conversation.owner, conversation.created_at, conversation.metadata.decode()]
            yield ["items", cid, [[item_id, encoded.decode()] for item_id, encoded in conversation.items.items()]]

    def _create(self, cid: str, conversation: _Conversation) -> None:
        self._log(["create", cid, conversation.owner, conversation.created_at, conversation.metadata.decode()])
        conversation.size = len(conversation.metadata)
        self._conversations[cid] = conversation
        self._bytes += conversation.size

    def _add(self, cid: str, conversation: _Conversation, items: list[tuple[str, bytes]]) -> None:
        """Items (id, JSON) added at the end."""
        self._log(["items", cid, [[item_id, encoded.decode()] for item_id, encoded in items]])
        for item_id, encoded in items:
            conversation.items[item_id] = encoded
        self._resize(conversation, sum(len(encoded) for _, encoded in items))

    def _set_metadata(self, cid: str, conversation: _Conversation, encoded: bytes) -> None:
        self._log(["metadata", cid, encoded.decode()])
        self._resize(conversation, len(encoded) - len(conversation.metadata))
        conversation.metadata = encoded

    def _drop_item(self, cid: str, conversation: _Conversation, item_id: str) -> None:
        self._log(["drop_item", cid, item_id])
        self._resize(conversation, -len(conversation.items.pop(item_id)))

    # -- conversations --------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._conversations)

    def create(self, items: list[dict], metadata: dict, owner: int = -1) -> dict | str:
        """A new conversation holding these items: its object, or TOO_LARGE (nothing kept)."""
        cid = f"conv_{uuid.uuid4().hex}"
        conversation = _Conversation(owner, int(time.time()), json.dumps(metadata).encode())
        self._create(cid, conversation)
        if self.append(cid, items, owner) == TOO_LARGE:
            self._drop(cid)
            return TOO_LARGE
        return conversation.view(cid)

    def get(self, cid: str, owner: int = -1) -> dict | str:
        conversation = self._find(cid, owner)
        return NO_CONVERSATION if conversation is None else conversation.view(cid)

    def update(self, cid: str, metadata: dict, owner: int = -1) -> dict | str:
        """The conversation with this metadata in place of its own."""
        conversation = self._find(cid, owner)
        if conversation is None:
            return NO_CONVERSATION
        self._set_metadata(cid, conversation, json.dumps(metadata).encode())
        self._bound()
        return conversation.view(cid)

    def delete(self, cid: str, owner: int = -1) -> bool:
        if self._find(cid, owner) is None:
            return False
        self._drop(cid)
        return True

    def append(self, cid: str, items: list[dict], owner: int = -1) -> list[dict] | str:
        """Add items at the end: them as stored (ids given where missing, or taken already in
        this conversation), or NO_CONVERSATION, or TOO_LARGE when the conversation would be over
        the byte bound alone (then nothing is added)."""
        conversation = self._find(cid, owner)
        if conversation is None:
            return NO_CONVERSATION
        stored, taken = [], set()
        for item in items:
            item = as_stored(item)
            if item["id"] in conversation.items or item["id"] in taken:
                item = as_stored({**item, "id": None})
            taken.add(item["id"])
            stored.append((item, json.dumps(item).encode()))
        added = sum(len(encoded) for _, encoded in stored)
        if conversation.size + added > self.max_bytes:
            logger.warning("conversation %s would be over responses.max_conversation_bytes: %d items not added",
                           cid, len(items))
            return TOO_LARGE
        self._add(cid, conversation, [(item["id"], encoded) for item, encoded in stored])
        self._bound()  # (never this one: it is the most recently used, and fits alone)
        return [item for item, _ in stored]

    def items(self, cid: str, owner: int = -1) -> list[dict] | str:
        """Every item, the oldest first (what a response goes on from)."""
        conversation = self._find(cid, owner)
        if conversation is None:
            return NO_CONVERSATION
        return [json.loads(encoded) for encoded in conversation.items.values()]

    def page(self, cid: str, limit: int, order: str, after: str | None, owner: int = -1) -> dict | str:
        """OpenAI's list of `limit` items from the one after `after` (NO_AFTER: not here), in `order`;
        only the page's items are decoded."""
        conversation = self._find(cid, owner)
        if conversation is None:
            return NO_CONVERSATION
        ids = list(conversation.items)[::-1] if order == "desc" else list(conversation.items)
        if after is not None and after not in conversation.items:
            return NO_AFTER
        start = 0 if after is None else ids.index(after) + 1
        window = [json.loads(conversation.items[i]) for i in ids[start:start + limit + 1]]
        return input_page(window, limit, "asc", None)  # (in order already)

    def item(self, cid: str, item_id: str, owner: int = -1) -> dict | str:
        conversation = self._find(cid, owner)
        if conversation is None:
            return NO_CONVERSATION
        encoded = conversation.items.get(item_id)
        return NO_ITEM if encoded is None else json.loads(encoded)

    def delete_item(self, cid: str, item_id: str, owner: int = -1) -> dict | str:
        """The conversation without that item."""
        conversation = self._find(cid, owner)
        if conversation is None:
            return NO_CONVERSATION
        if item_id not in conversation.items:
            return NO_ITEM
        self._drop_item(cid, conversation, item_id)
        return conversation.view(cid)

    def _find(self, cid: str, owner: int) -> _Conversation | None:
        conversation = self._conversations.get(cid)
        if conversation is None or conversation.owner != owner:
            return None
        self._conversations.move_to_end(cid)
        return conversation

    def _resize(self, conversation: _Conversation, change: int) -> None:
        conversation.size += change
        self._bytes += change

    def _drop(self, cid: str) -> None:
        self._log(["drop", cid])
        self._bytes -= self._conversations.pop(cid).size

    def _bound(self) -> None:
        """The least recently used conversations dropped until both bounds hold."""
        while len(self._conversations) > self.max_conversations or self._bytes > self.max_bytes:
            self._drop(next(iter(self._conversations)))


class ConversationClient:
    """The ingress's side of the store: the app's ConversationStore deployment (a handle), or, in
    process, a ConversationStore of its own; none where `responses.store` is off (then every use
    is a 400)."""

    def __init__(self, handle, config: ResponsesConfig) -> None:
        self.on = config.store
        self._handle = handle
        self._local = ConversationStore(config.max_conversations, config.max_conversation_bytes,
                                        config.journal("conversations")) if handle is None and self.on else None

    def require(self, param: str) -> None:
        """A 400 naming `param` with the store off."""
        if not self.on:
            raise OpenAIError(400, "conversations need the server's response store (responses.store), "
                                   "which is off", param)

    async def call(self, method: str, *args, param: str = "conversation_id"):
        """What the store's `method` answers; a 400 naming `param` with the store off, a 503 when
        the store is unavailable."""
        self.require(param)
        return await store_call(self._local, self._handle, "conversation store", method, *args,
                                reads=CONVERSATION_READS)

    async def found(self, method: str, cid: str, *args, param: str = "conversation_id"):
        """What `method` gives for a conversation; a 404 for one not there (or an item not in it),
        a 400 for items over the byte bound."""
        answer = await self.call(method, cid, *args, param=param)
        if answer == NO_CONVERSATION or answer is False:
            raise OpenAIError(404, f"no conversation {cid!r} (never created, deleted, or dropped from the store)",
                              param, "not_found")
        if answer == NO_ITEM:
            raise OpenAIError(404, f"no item {args[0]!r} in conversation {cid!r}", "item_id", "not_found")
        if answer == NO_AFTER:
            raise OpenAIError(400, f"after: no item {args[2]!r} in conversation {cid!r}", "after")
        if answer == TOO_LARGE:
            raise OpenAIError(400, "the conversation would be over the server's responses.max_conversation_bytes",
                              "items", "conversation_too_large")
        return answer

    async def add(self, cid: str, items: list[dict], owner: int) -> None:
        """A response's items added once it ended; where they cannot be (the conversation went, is
        full, or the store is unavailable), logged: the response itself was given."""
        try:
            answer = await self.call("append", cid, items, owner)
        except OpenAIError:
            answer = "unavailable"
        if not isinstance(answer, list):
            logger.warning("conversation %s: a response's %d items not added (%s)", cid, len(items), answer)


# One replica for the whole app (a second would hold other conversations); every call is a dict
# lookup, so it asks for a sliver of a CPU (beside the response store's replica on small test clusters).
ConversationStoreDeployment = serve.deployment(num_replicas=1, max_ongoing_requests=1024, **STORE_HEALTH,
                                               ray_actor_options={"num_cpus": 0.01})(ConversationStore)
