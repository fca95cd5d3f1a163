"""The Responses API's output: one chat generation (responses.py's ResponseFormat and its pieces)
as a response object, whole, or as its stream of typed server-sent events.

    output item        from the chat answer's           streamed as
    reasoning          reasoning (config `reasoning`)   output_item.added, content_part.added,
                                                        reasoning_text.delta ..., reasoning_text.done,
                                                        content_part.done, output_item.done
    message            content                          ... output_text.delta (with its logprobs) ...
    function_call      each tool call                   output_item.added, function_call_arguments.delta ...,
                                                        function_call_arguments.done, output_item.done

The stream opens with response.created and response.in_progress and ends with response.completed
(response.incomplete when max_output_tokens cut it, response.failed when the engine failed); every
event carries its sequence_number, and no [DONE] follows. An output_text's logprobs are those of
the tokens after the reasoning (the reasoning's own tokens are not the text's).
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Union

from .front_door import OpenAIError
from .responses import ResponseFormat, StreamFailed, sse_event, usage, whole_body
from .responses_schema import FunctionChoice, ResponsesRequest, compaction_content, since_compaction


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def with_id(item: dict) -> dict:
    """An item with an id (one of its kind's prefix where it had none)."""
    if item.get("id"):
        return item
    prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs",
              "compaction": "cmp"}.get(item.get("type", "message"), "item")
    return {**item, "id": item_id(prefix)}


def as_stored(item: dict) -> dict:
    """An input item as OpenAI's APIs give one back (a conversation's, a compaction's): with an id
    and a type, a message's text as content parts, its status completed where it said none."""
    item = {"type": "message", **with_id(item)} if item.get("type", "message") == "message" else with_id(item)
    if item["type"] != "message":
        return item
    if isinstance(item.get("content"), str):
        part = {"type": "output_text", "text": item["content"], "annotations": []} \
            if item.get("role") == "assistant" else {"type": "input_text", "text": item["content"]}
        item = {**item, "content": [part]}
    return {**item, "status": item.get("status") or "completed"}


@dataclass
class ResponseShape:
    """What a response object says besides its output: its id and the request's options."""

    rid: str
    model: str
    body: ResponsesRequest
    stored: bool
    created: int = field(default_factory=lambda: int(time.time()))
    first: list[dict] = field(default_factory=list)  # items the output begins with (a compaction's)
    spent: dict | None = None  # the chat usage of what ran before the answer (that compaction's pass)

    def envelope(self, status: str, output: list[dict], usage_: dict | None = None, error: dict | None = None,
                 incomplete: dict | None = None, speculation: dict | None = None) -> dict:
        body = self.body
        fmt = body.text.format if body.text is not None and body.text.format is not None else None
        choice = body.tool_choice or "auto"
        return {
            "id": self.rid, "object": "response", "created_at": self.created, "status": status,
            "background": bool(body.background),
            "error": error, "incomplete_details": incomplete, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "max_tool_calls": body.max_tool_calls, "model": self.model,
            "output": output, "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
            "service_tier": "default", "store": self.stored, "temperature": body.temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"},
                     "verbosity": body.text.verbosity if body.text else None},
            "tool_choice": choice.model_dump() if isinstance(choice, FunctionChoice) else choice,
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "top_logprobs": body.top_logprobs or 0, "top_p": body.top_p, "truncation": body.truncation or "disabled",
            "usage": usage_, "user": body.user, "metadata": body.metadata or {},
            "safety_identifier": body.safety_identifier, "prompt_cache_key": body.prompt_cache_key,
            **({} if speculation is None else {"speculation": speculation}),
            **({} if body.conversation is None else {"conversation": {"id": body.conversation_id()}}),
        }

    def finished(self, output: list[dict], finish: str | None, formats: list[ResponseFormat]) -> dict:
        """The whole response once its generation ended (finish: the chat choice's reason)."""
        chat_usage, speculation = usage(formats)
        if self.spent is not None:
            chat_usage = added_usage(chat_usage, self.spent)
        cut = finish == "length"
        return self.envelope("incomplete" if cut else "completed", output, responses_usage(chat_usage),
                             incomplete={"reason": "max_output_tokens"} if cut else None, speculation=speculation)

    def failed(self, output: list[dict], error: dict) -> dict:
        return self.envelope("failed", output, error={"code": error.get("code") or "server_error",
                                                      "message": error["message"]})


def added_usage(chat: dict, more: dict) -> dict:
    """Two chat usages together (the answer's and a compaction pass's)."""
    out = {name: chat[name] + more[name] for name in ("prompt_tokens", "completion_tokens", "total_tokens")}
    out["prompt_tokens_details"] = {"cached_tokens": chat["prompt_tokens_details"]["cached_tokens"]
                                    + more["prompt_tokens_details"]["cached_tokens"]}
    if "completion_tokens_details" in chat:
        out["completion_tokens_details"] = chat["completion_tokens_details"]  # (the answer's reasoning)
    return out


def responses_usage(chat: dict) -> dict:
    details = chat.get("completion_tokens_details") or {}
    return {"input_tokens": chat["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": chat["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": chat["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens", 0)},
            "total_tokens": chat["total_tokens"]}


# -- whole ----------------------------------------------------------------------------------------
def output_items(message: dict, finish: str | None, field_name: str | None, logprobs: list | None,
                 reasoning_tokens: int) -> list[dict]:
    """A whole chat answer's message -> the response's output items (logprobs: every token's
    entries, the reasoning's first)."""
    out = []
    if field_name is not None and message.get(field_name):
        out.append(reasoning_item(item_id("rs"), message[field_name], "completed"))
    calls = message.get("tool_calls") or []
    if message.get("content") or not (out or calls):  # (an empty answer is an empty message)
        entries = None if logprobs is None else logprobs[reasoning_tokens:]
        out.append(message_item(item_id("msg"), message.get("content") or "", entries, "completed"))
    out.extend(call_item(item_id("fc"), c["id"], c["function"]["name"], c["function"]["arguments"], "completed")
               for c in calls)
    if finish == "length":  # the item max_output_tokens cut (a call's arguments then end where it cut them)
        out[-1]["status"] = "incomplete"
    return out


def reasoning_item(rid: str, text: str | None, status: str) -> dict:
    return {"type": "reasoning", "id": rid, "summary": [],
            "content": [] if text is None else [{"type": "reasoning_text", "text": text}], "status": status}


def text_part(text: str, logprobs: list | None) -> dict:
    part = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return part


def message_item(mid: str, text: str | None, logprobs: list | None, status: str) -> dict:
    return {"type": "message", "id": mid, "status": status, "role": "assistant",
            "content": [] if text is None else [text_part(text, logprobs)]}


def call_item(fid: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": fid, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


# A response's generation: admitted, (its ResponseFormat, its pieces); or work still to do first
# (a compaction's summary) that admits it and gives those, an awaitable run once the response has
# begun (streamed: after its first events; in the background: in its task).
Generation = Union[tuple[ResponseFormat, Any], Awaitable[tuple[ResponseFormat, Any]]]


async def begun(generation: Generation) -> tuple[ResponseFormat, Any]:
    """A generation admitted (awaited where it is still to begin; its errors raised)."""
    return generation if isinstance(generation, tuple) else await generation


def abandon(generation: Generation) -> None:
    """A generation that will not be read: stopped where it was admitted, never begun where not."""
    if isinstance(generation, tuple):
        generation[0].gen.close()
    else:
        generation.close()


async def whole_response(shape: ResponseShape, generation: Generation, field_name: str | None,
                         keep: Callable[[dict], Awaitable[None]]) -> dict:
    """The whole response of one generation (an engine failure, or one of what comes before the
    generation begins, is its error, raised); `keep` as ResponseEvents.stream's `on_done`."""
    fmt, pieces = await begun(generation)
    whole = await whole_body([(fmt, pieces)])
    (choice,), details = whole["choices"], whole["usage"].get("completion_tokens_details") or {}
    output = shape.first + output_items(choice["message"], choice["finish_reason"], field_name,
                                        (choice["logprobs"] or {}).get("content"), details.get("reasoning_tokens", 0))
    response = shape.finished(output, choice["finish_reason"], [fmt])
    await keep(response)
    return response


def compacted(rid: str, items: list[dict], summary: str, chat_usage: dict) -> dict:
    """OpenAI's compacted conversation (`/v1/responses/compact`): its user messages (those since
    its latest compaction, which the new one covers with the rest), as given back, then one
    compaction item holding the model's summary of it all."""
    users = [as_stored(item) for item in since_compaction(items)
             if item.get("type", "message") == "message" and item["role"] == "user"]
    return {"id": rid, "object": "response.compaction", "created_at": int(time.time()),
            "output": users + [compaction_item(summary)], "usage": responses_usage(chat_usage)}


def compaction_item(summary: str) -> dict:
    return {"type": "compaction", "id": item_id("cmp"), "encrypted_content": compaction_content(summary)}


def input_page(items: list[dict], limit: int, order: str, after: str | None) -> dict:
    """OpenAI's list of a response's input items: `limit` of them from the one after `after`, in
    `order` ("desc": the newest first)."""
    ordered = items[::-1] if order == "desc" else items
    ids = [item["id"] for item in ordered]
    if after is not None:
        if after not in ids:
            raise OpenAIError(400, f"after: no input item {after!r} in this response", "after")
        ordered = ordered[ids.index(after) + 1:]
    page = ordered[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(ordered) > limit}


# -- streamed -------------------------------------------------------------------------------------
class ResponseEvents:
    """One generation's chat chunks -> the Responses API's events. With `logprobs`, a reasoning
    model's text gets only its own tokens' logprobs (`count_reasoning(token_ids)`: how many of
    those tokens are reasoning, its ResponseFormat's)."""

    def __init__(self, shape: ResponseShape, field_name: str | None, logprobs: bool = False) -> None:
        self.shape, self.field, self.logprobs = shape, field_name, logprobs
        self.count_reasoning: Callable[[list[int]], Awaitable[int]] | None = None
        self.sequence = 0
        self.output: list[dict] = []  # items done (the ones the output begins with, once begun)
        self.open: dict | None = None  # the item being streamed
        self.text = ""  # its text (reasoning or output text) or arguments so far
        self.token_ids: list[int] = []
        self.entries: list | None = None  # every token's logprob entry so far (None: not asked)
        self.text_from: int | None = None  # the first of the text's own tokens (known once the text begins)
        self.sent = 0  # entries sent with text deltas so far

    def event(self, kind: str, **payload) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **payload}
        self.sequence += 1
        return f"event: {kind}\n" + sse_event(data)

    async def stream(self, generation: Generation,
                     on_done: Callable[[dict], Awaitable[None]]) -> AsyncIterator[str]:
        """Every event of the response; `on_done(response)` once it ended (stored, where asked).
        A generation still to begin begins after the first two events (which carry the id), and
        where that fails, the response ends in response.failed with its error."""
        yield self.event("response.created", response=self.shape.envelope("in_progress", []))
        yield self.event("response.in_progress", response=self.shape.envelope("in_progress", []))
        try:
            fmt, pieces = await begun(generation)
        except OpenAIError as err:
            response = self.shape.failed([], err.body()["error"])
            await on_done(response)
            yield self.event("response.failed", response=response)
            return
        self.count_reasoning = fmt.thoughts if self.logprobs else None
        self.output = list(self.shape.first)
        for index, item in enumerate(self.shape.first):  # (done before the answer began)
            yield self.event("response.output_item.added", output_index=index, item=item)
            yield self.event("response.output_item.done", output_index=index, item=item)
        finish = None
        try:
            async for chunk in fmt.chunks(pieces, return_token_ids=True):
                choice = chunk["choices"][0]
                for event in await self._chunk(choice):
                    yield event
                finish = choice["finish_reason"] or finish
        except StreamFailed as err:
            for event in self._close("incomplete"):
                yield event
            response = self.shape.failed(self.output, err.error.body()["error"])
            await on_done(response)
            yield self.event("response.failed", response=response)
            return
        if self.open is None and len(self.output) == len(self.shape.first):  # (an empty answer: an empty message)
            for event in await self._begin_text():
                yield event
        for event in self._close("incomplete" if finish == "length" else "completed"):
            yield event
        response = self.shape.finished(self.output, finish, [fmt])
        await on_done(response)
        yield self.event("response.incomplete" if response["status"] == "incomplete" else "response.completed",
                         response=response)

    async def _chunk(self, choice: dict) -> list[str]:
        delta, events = choice["delta"], []
        self.token_ids.extend(choice.get("token_ids") or [])
        entries = (choice.get("logprobs") or {}).get("content")
        if entries is not None:
            self.entries = (self.entries or []) + entries
        thinking = delta.get(self.field) if self.field else None
        if thinking:
            events += self._begin("reasoning")
            self.text += thinking
            events.append(self._part_event("response.reasoning_text.delta", delta=thinking))
        if delta.get("content"):
            events += await self._begin_text()
            self.text += delta["content"]
            own = [] if self.entries is None else self.entries[self.sent:]
            self.sent += len(own)
            events.append(self._part_event("response.output_text.delta", delta=delta["content"], logprobs=own))
        for call in delta.get("tool_calls") or []:
            if call.get("id"):  # a call begins
                events += self._begin("function_call", call)
            arguments = call["function"].get("arguments") or ""
            if arguments:
                self.text += arguments
                events.append(self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                         output_index=len(self.output), delta=arguments))
        return events

    async def _begin_text(self) -> list[str]:
        """Events that open the message item; the first time, where its own tokens begin (after
        the reasoning's: their logprobs are not the text's)."""
        if self.text_from is None:
            self.text_from = await self.count_reasoning(self.token_ids) if self.count_reasoning else 0
            self.sent = self.text_from
        return self._begin("message")

    def _part_event(self, kind: str, **payload) -> str:
        return self.event(kind, item_id=self.open["id"], output_index=len(self.output), content_index=0, **payload)

    def _begin(self, kind: str, call: dict | None = None) -> list[str]:
        """Events that open an item of this kind (none when one is open already; a new call always)."""
        if self.open is not None and self.open["type"] == kind and call is None:
            return []
        events = self._close("completed")
        self.text = ""
        if kind == "reasoning":
            self.open = reasoning_item(item_id("rs"), None, "in_progress")
            part = {"type": "reasoning_text", "text": ""}
        elif kind == "message":
            self.open = message_item(item_id("msg"), None, None, "in_progress")
            part = text_part("", None)
        else:
            self.open = call_item(item_id("fc"), call["id"], call["function"]["name"], "", "in_progress")
            part = None
        events.append(self.event("response.output_item.added", output_index=len(self.output), item=self.open))
        if part is not None:
            events.append(self._part_event("response.content_part.added", part=part))
        return events

    def _close(self, status: str) -> list[str]:
        """Events that close the open item (with its whole text) and move it to the output."""
        item, events = self.open, []
        if item is None:
            return events
        if item["type"] == "reasoning":
            done = reasoning_item(item["id"], self.text, status)
            part = done["content"][0]
            events.append(self._part_event("response.reasoning_text.done", text=self.text))
        elif item["type"] == "message":
            own = None if self.entries is None else self.entries[self.text_from:]
            done = message_item(item["id"], self.text, own, status)
            part = done["content"][0]
            events.append(self._part_event("response.output_text.done", text=self.text, logprobs=own or []))
        else:
            done, part = call_item(item["id"], item["call_id"], item["name"], self.text, status), None
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                     output_index=len(self.output), arguments=self.text))
        if part is not None:
            events.append(self._part_event("response.content_part.done", part=part))
        events.append(self.event("response.output_item.done", output_index=len(self.output), item=done))
        self.output.append(done)
        self.open = None
        return events
