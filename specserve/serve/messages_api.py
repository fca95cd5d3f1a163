"""Anthropic's Messages API output: one chat generation (responses.py's ResponseFormat and its
pieces) as a message, whole, or as Anthropic's stream of server-sent events.

    content block   from the chat answer's                     streamed delta
    thinking        reasoning (config `reasoning`)             thinking_delta
    text            content                                    text_delta
    tool_use        each tool call (its arguments as `input`)  input_json_delta

    stop_reason     end_turn (EOS), stop_sequence (with `stop_sequence`), max_tokens, tool_use

A stream is message_start, then per block content_block_start, its deltas and content_block_stop,
then message_delta (stop_reason, output tokens) and message_stop; an engine failure after it began
is an `error` event. A thinking block's `signature` is empty: this server signs nothing.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from .responses import ResponseFormat, StreamFailed, sse_event, usage, whole_body


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


@dataclass
class MessageShape:
    mid: str
    model: str
    field: str | None  # the chat answer's reasoning field (None: not a reasoning model)

    def envelope(self, content: list[dict], stop_reason: str | None, stop_sequence: str | None,
                 formats: list[ResponseFormat], output_tokens: int | None = None) -> dict:
        chat_usage, speculation = usage(formats)
        cached = chat_usage["prompt_tokens_details"]["cached_tokens"]
        return {"id": self.mid, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": {"input_tokens": chat_usage["prompt_tokens"] - cached, "cache_creation_input_tokens": 0,
                          "cache_read_input_tokens": cached,
                          "output_tokens": chat_usage["completion_tokens"] if output_tokens is None else output_tokens},
                "speculation": speculation}


def stop_reason(finish: str | None, stop_string: str | None) -> str:
    if finish == "tool_calls":
        return "tool_use"
    if finish == "length":
        return "max_tokens"
    return "stop_sequence" if stop_string is not None else "end_turn"


def tool_block(call: dict) -> dict:
    """A chat tool call as a tool_use block (arguments that are not a JSON object, as a cut answer's
    may be: a text block of them)."""
    try:
        arguments = json.loads(call["function"]["arguments"])
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        return {"type": "text", "text": call["function"]["arguments"]}
    return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": arguments}


async def whole_message(shape: MessageShape, fmt: ResponseFormat, pieces) -> dict:
    """The whole message of one generation (an engine failure is its error, raised)."""
    whole = await whole_body([(fmt, pieces)])
    choice = whole["choices"][0]
    message = choice["message"]
    content = []
    if shape.field is not None and message.get(shape.field):
        content.append({"type": "thinking", "thinking": message[shape.field], "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    content.extend(tool_block(call) for call in message.get("tool_calls") or [])
    hit = fmt.last.stop_string if fmt.last is not None else None
    return shape.envelope(content, stop_reason(choice["finish_reason"], hit), hit, [fmt])


class MessageEvents:
    """One generation's chat chunks -> Anthropic's stream events."""

    def __init__(self, shape: MessageShape) -> None:
        self.shape = shape
        self.index = -1  # the open block's index (-1: none yet)
        self.open: str | None = None  # its type

    async def stream(self, fmt: ResponseFormat, pieces) -> AsyncIterator[str]:
        start = self.shape.envelope([], None, None, [fmt], output_tokens=0)
        yield event("message_start", message=start)
        finish = None
        try:
            async for chunk in fmt.chunks(pieces):
                choice = chunk["choices"][0]
                for out in self._delta(choice["delta"]):
                    yield out
                finish = choice["finish_reason"] or finish
        except StreamFailed as err:
            yield "event: error\n" + sse_event(err.error.anthropic_body())
            return
        for out in self._close():
            yield out
        hit = fmt.last.stop_string if fmt.last is not None else None
        done = self.shape.envelope([], stop_reason(finish, hit), hit, [fmt])
        yield event("message_delta", delta={"stop_reason": done["stop_reason"], "stop_sequence": hit},
                    usage={"output_tokens": done["usage"]["output_tokens"]}, speculation=done["speculation"])
        yield event("message_stop")

    def _delta(self, delta: dict) -> list[str]:
        out = []
        thinking = delta.get(self.shape.field) if self.shape.field else None
        if thinking:
            out += self._begin("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._block_delta({"type": "thinking_delta", "thinking": thinking}))
        if delta.get("content"):
            out += self._begin("text", {"type": "text", "text": ""})
            out.append(self._block_delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or []:
            if call.get("id"):  # a call begins
                block = {"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": {}}
                out += self._begin("tool_use", block, new=True)
            arguments = call["function"].get("arguments") or ""
            if arguments:
                out.append(self._block_delta({"type": "input_json_delta", "partial_json": arguments}))
        return out

    def _begin(self, kind: str, block: dict, new: bool = False) -> list[str]:
        if self.open == kind and not new:
            return []
        out = self._close()
        self.index += 1
        self.open = kind
        return out + [event("content_block_start", index=self.index, content_block=block)]

    def _block_delta(self, delta: dict) -> str:
        return event("content_block_delta", index=self.index, delta=delta)

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":
            out.append(self._block_delta({"type": "signature_delta", "signature": ""}))
        self.open = None
        return out + [event("content_block_stop", index=self.index)]


def event(kind: str, **payload) -> str:
    return f"event: {kind}\n" + sse_event({"type": kind, **payload})
