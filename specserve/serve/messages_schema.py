"""Anthropic's Messages API request (`POST /v1/messages`, what Anthropic's SDKs and the coding
agents built on them send), and the chat request it becomes: the ingress then runs it as a chat,
so speculation, tool calls, reasoning and the sampling options hold for it unchanged.

    Messages                                    chat
    system (text or text blocks)                a system message first
    user: text, tool_result blocks              tool messages (one per result), then the user's text
    assistant: thinking, text, tool_use         one assistant message: reasoning, content, tool_calls
    the last turn the assistant's text          continue_final_message: the answer continues it
    tools [{name, description, input_schema}]   tools [{type: function, function: {..., parameters}}]
    tool_choice auto / any / tool / none        auto / required / a named function / none
                (disable_parallel_tool_use)     (parallel_tool_calls: false)
    thinking enabled / disabled                 chat_template_kwargs.enable_thinking true / false
    stop_sequences, max_tokens                  stop, max_completion_tokens
    metadata.user_id                            user

Images, documents, server tools (web search, code execution, ...), MCP servers and containers are
refused with a 400 naming the parameter: this server runs one text model.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from .checks import as_chat
from .front_door import OpenAIError
from .schema import FUNCTION_NAME, ChatCompletionRequest, SamplingOptions, Strict


# -- content blocks --------------------------------------------------------------------------------
class TextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # (prefix caching is automatic here)
    citations: list[Any] | None = None


class MediaBlock(BaseModel):
    """An image, a document or another non-text block: refused (this server's model takes text)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["image", "document", "search_result", "container_upload", "server_tool_use",
                  "web_search_tool_result"]


class ToolUseBlock(Strict):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[Annotated[Union[TextBlock, MediaBlock], Field(discriminator="type")]] | None = None
    is_error: StrictBool | None = None
    cache_control: dict[str, Any] | None = None


class ThinkingBlock(Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None  # (another server's; not checked here)


class RedactedThinkingBlock(Strict):
    type: Literal["redacted_thinking"]
    data: str  # (unreadable here: dropped)


Block = Annotated[Union[TextBlock, MediaBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock],
                  Field(discriminator="type")]


class Message(Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]


# -- tools and options -------------------------------------------------------------------------------
class CustomTool(Strict):
    type: Literal["custom"] | None = None
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ServerTool(BaseModel):
    """A tool Anthropic's servers run (bash, text editor, web search, ...): refused."""

    model_config = ConfigDict(extra="allow")
    type: str


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: StrictBool | None = None


class Thinking(Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1)  # (the model thinks as long as it does; max_tokens bounds it)


class Metadata(Strict):
    user_id: str | None = None


class MessagesRequest(SamplingOptions):
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: StrictBool = False
    tools: list[CustomTool | ServerTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    metadata: Metadata | None = None
    service_tier: str | None = None
    container: Any = None
    mcp_servers: list[Any] | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        bad = []
        if any(isinstance(t, ServerTool) for t in self.tools or []):
            bad.append(("tools", "only custom tools (name, description, input_schema) are supported"))
        if self.mcp_servers:
            bad.append(("mcp_servers", "MCP servers are not supported: give the tools themselves"))
        if self.container is not None:
            bad.append(("container", "containers are not supported"))
        if self.tool_choice is not None and self.tool_choice.type == "tool" and not self.tool_choice.name:
            bad.append(("tool_choice", "tool_choice of type tool needs the tool's name"))
        return bad

    def chat(self) -> ChatCompletionRequest:
        """The chat request this is. Raises OpenAIError (400) for what a chat cannot say."""
        turns = messages(self.system, self.messages)
        body = {"model": self.model, "messages": turns, **prefill(turns),
                **self.model_dump(include=set(SamplingOptions.model_fields), exclude_unset=True),
                "max_completion_tokens": self.max_tokens}
        if self.stop_sequences:
            body["stop"] = self.stop_sequences
        if self.metadata is not None and self.metadata.user_id is not None:
            body["user"] = self.metadata.user_id
        if self.tools:
            body["tools"] = [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                                                               **({"description": t.description}
                                                                  if t.description else {})}} for t in self.tools]
        choice = self.tool_choice
        if choice is not None:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
                {"type": "function", "function": {"name": choice.name}}
            body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        if self.thinking is not None and self.thinking.type != "adaptive":
            body["chat_template_kwargs"] = {"enable_thinking": self.thinking.type == "enabled"}
        return as_chat(body, CHAT_TO_MESSAGES, "messages")


CHAT_TO_MESSAGES = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences", "chat_template_kwargs": "thinking"}


class CountTokensRequest(Strict):
    """`POST /v1/messages/count_tokens`: the prompt a request would render to, counted."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[CustomTool | ServerTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    def request(self) -> MessagesRequest:
        return MessagesRequest(max_tokens=1, **self.model_dump(exclude_unset=True))


def messages(system: str | list[TextBlock] | None, turns: list[Message]) -> list[dict]:
    """The conversation as chat messages."""
    out: list[dict] = []
    if system:
        out.append({"role": "system", "content": system if isinstance(system, str) else
                    "".join(b.text for b in system)})
    for turn in turns:
        if isinstance(turn.content, str):
            out.append({"role": turn.role, "content": turn.content})
        elif turn.role == "user":
            out.extend(_user(turn.content))
        else:
            out.append(_assistant(turn.content))
    return out


def prefill(turns: list[dict]) -> dict:
    """How the chat template renders a conversation whose last turn is the assistant's text (a
    prefill): left open, so that the answer continues it (and gives only what follows). Raises
    OpenAIError (400) where that text ends in whitespace, as Anthropic's API does."""
    last = turns[-1]
    if last["role"] != "assistant" or last.get("tool_calls"):
        return {}
    if last["content"] != last["content"].rstrip():
        raise OpenAIError(400, "messages: final assistant content cannot end with trailing whitespace",
                          "messages", "invalid_prefill")
    return {"add_generation_prompt": False, "continue_final_message": True}


def _user(blocks: list) -> list[dict]:
    """A user turn: each tool result a tool message, then the text."""
    out, text = [], []
    for block in blocks:
        if isinstance(block, ToolResultBlock):
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _result(block)})
        elif isinstance(block, TextBlock):
            text.append(block.text)
        else:
            _refuse(block, "a user message holds text and tool_result blocks")
    if text or not out:
        out.append({"role": "user", "content": "".join(text)})
    return out


def _assistant(blocks: list) -> dict:
    message: dict = {"role": "assistant", "content": ""}
    for block in blocks:
        if isinstance(block, TextBlock):
            message["content"] += block.text
        elif isinstance(block, ToolUseBlock):
            message.setdefault("tool_calls", []).append({"id": block.id, "type": "function", "function": {
                "name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif isinstance(block, ThinkingBlock):
            message["reasoning"] = message.get("reasoning", "") + block.thinking
        elif not isinstance(block, RedactedThinkingBlock):
            _refuse(block, "an assistant message holds text, tool_use and thinking blocks")
    return message


def _result(block: ToolResultBlock) -> str:
    if block.content is None or isinstance(block.content, str):
        return block.content or ""
    for part in block.content:
        if isinstance(part, MediaBlock):
            _refuse(part, "a tool result holds text")
    return "".join(part.text for part in block.content)


def _refuse(block, why: str) -> None:
    kind = getattr(block, "type", "block")
    what = f"{kind} blocks are not supported: this model takes text" if isinstance(block, MediaBlock) else why
    raise OpenAIError(400, f"messages: {what}", "messages", "unsupported_content")
