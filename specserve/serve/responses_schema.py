"""The Responses API's request (`POST /v1/responses`, OpenAI's newer API): its input items, tools
and options, and the chat request it becomes (the ingress then runs it as a chat, so everything
chat does, from tool calls to reasoning and structured output, holds for it unchanged).

    Responses                                   chat
    instructions                                a system message first
    input: text, or items:                      messages:
      message (user / system / developer)         the same role
      reasoning, message (assistant),             one assistant message: reasoning, content,
        function_call, ...                          tool_calls (consecutive items, as one turn)
      function_call_output                        a tool message
    tools [{type: function, name, ...}]         tools [{type: function, function: {...}}]
    tool_choice {type: function, name}          {type: function, function: {name}}
    text.format                                 response_format
    reasoning.effort                            reasoning_effort
    max_output_tokens                           max_completion_tokens
    top_logprobs / include logprobs             logprobs, top_logprobs

`truncation: "auto"` drops the conversation's first turns until the prompt fits the context
(`cuts`; the ingress finds how many); `background: true` returns at once and generates in the
background, streamed too where asked, and resumable (serve/background.py); an `item_reference`
is the stored item it names; `conversation` goes on from a conversation's items and adds the
response's to it (conversation_store.py); a `compaction` item (`/v1/responses/compact`'s, or
`context_management`'s) is the summary it holds, as a user message, and stands for every item
before it but the user's messages. Images, files and audio, hosted tools, prompt
templates and `conversation` with `previous_response_id` are refused with a 400 naming the
parameter: this server runs one text model and keeps nothing but its stores' responses and
conversations.
"""
from __future__ import annotations

import base64
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, StrictBool, TypeAdapter

from specserve.engine.sampling import MAX_LOGPROBS

from .checks import as_chat
from .front_door import OpenAIError
from .schema import (FUNCTION_NAME, ChatCompletionRequest, JsonObjectFormat, SamplingOptions, Strict, TextFormat,
                     metadata_problems)

Status = Literal["in_progress", "completed", "incomplete"]


# -- input items -----------------------------------------------------------------------------------
class TextContent(Strict):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # (an earlier output's; not rendered)
    logprobs: list[Any] | None = None


class RefusalContent(Strict):
    type: Literal["refusal"]
    refusal: str


class MediaContent(BaseModel):
    """An image, a file or audio: refused (this server's model takes text)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["input_image", "input_file", "input_audio"]


Content = Annotated[Union[TextContent, RefusalContent, MediaContent], Field(discriminator="type")]


class MessageItem(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Content]
    id: str | None = None
    status: Status | None = None


class FunctionCallItem(Strict):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str  # JSON text
    id: str | None = None
    status: Status | None = None


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[Content]
    id: str | None = None
    status: Status | None = None


class SummaryText(Strict):
    type: Literal["summary_text"]
    text: str


class ReasoningText(Strict):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(Strict):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryText] = []
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None  # (another server's; nothing here can read it)
    status: Status | None = None

    def text(self) -> str:
        parts = self.content or self.summary
        return "".join(p.text for p in parts)


class CompactionItem(Strict):
    """A conversation compacted (by `POST /v1/responses/compact`, or first in a request with
    `context_management`): the model's summary of it, encoded (not encrypted: opaque to clients,
    read back by this server only)."""

    type: Literal["compaction"]
    id: str | None = None
    encrypted_content: str
    created_by: str | None = None

    def summary(self) -> str:
        head, _, body = self.encrypted_content.partition(":")
        try:
            if head != COMPACTION_HEAD:
                raise ValueError(head)
            return base64.b64decode(body, validate=True).decode()
        except ValueError:
            raise OpenAIError(400, "input: a compaction item's encrypted_content must come from this server's "
                                   "/v1/responses/compact (another server's cannot be read here)", "input",
                              "invalid_compaction") from None


COMPACTION_HEAD = "specserve-compaction-v1"  # (what a compaction item's content begins with)
SUMMARY_INTRO = "A summary of the conversation before this point:\n\n"  # (a compaction, as the model reads it)


def compaction_content(summary: str) -> str:
    return f"{COMPACTION_HEAD}:{base64.b64encode(summary.encode()).decode()}"


class ConversationRef(Strict):
    id: str


class ItemReference(Strict):
    type: Literal["item_reference"]
    id: str


def _item_type(value: Any) -> str:
    """An item's type (an easy input message has none: a message)."""
    return value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")


InputItem = Annotated[Union[Annotated[MessageItem, Tag("message")],
                            Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                            Annotated[ReasoningItem, Tag("reasoning")],
                            Annotated[CompactionItem, Tag("compaction")],
                            Annotated[ItemReference, Tag("item_reference")]], Discriminator(_item_type)]
ITEMS = TypeAdapter(list[InputItem])
ITEM = TypeAdapter(InputItem)


# -- tools, formats, options -----------------------------------------------------------------------
class FunctionTool(Strict):
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments (None: any object)
    strict: StrictBool | None = None  # (the schema is always enforced where the output is constrained)


class HostedTool(BaseModel):
    """A tool OpenAI's servers run (web search, file search, ...): refused."""

    model_config = ConfigDict(extra="allow")
    type: str


class FunctionChoice(Strict):
    type: Literal["function"]
    name: str


class JsonSchemaText(Strict):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["json_schema"]
    name: str = Field("response", max_length=64)
    schema_: dict | bool = Field(alias="schema")
    description: str | None = None
    strict: StrictBool | None = None  # (the schema is always enforced)


class TextOptions(Strict):
    format: Annotated[Union[TextFormat, JsonObjectFormat, JsonSchemaText], Field(discriminator="type")] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # (for models that read it; not rendered)


class ReasoningOptions(Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # (the reasoning comes whole, not summarised)
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # (the older name)


class ResponsesStreamOptions(Strict):
    include_obfuscation: StrictBool = True  # (no obfuscation padding is sent: the server is not a browser's peer)


INCLUDABLE = Literal["message.output_text.logprobs", "reasoning.encrypted_content", "message.input_image.image_url",
                     "computer_call_output.output.image_url", "file_search_call.results",
                     "web_search_call.action.sources", "web_search_call.results", "code_interpreter_call.outputs"]


class ContextManagement(Strict):
    type: Literal["compaction"]
    compact_threshold: int | None = Field(None, ge=1)  # (None: 80% of the context)


class ResponsesRequest(SamplingOptions):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[FunctionTool | HostedTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: StrictBool = True
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    stream: StrictBool = False
    stream_options: ResponsesStreamOptions | None = None
    store: StrictBool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    include: list[INCLUDABLE] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    service_tier: str | None = None
    background: StrictBool | None = None
    max_tool_calls: int | None = Field(None, ge=1)  # (built-in tool calls: there are none here)
    prompt_cache_key: str | None = None  # (prefix caching needs no key)
    safety_identifier: str | None = None
    prompt: dict[str, Any] | None = None
    conversation: str | ConversationRef | None = None
    context_management: list[ContextManagement] | None = Field(None, max_length=1)

    def unsupported(self) -> list[tuple[str, str]]:
        """(param, why) for every option set to something this server does not do."""
        bad = []
        if self.background and not self.store:
            bad.append(("background", "background responses are kept in the store: they need store: true"))
        if self.prompt is not None:
            bad.append(("prompt", "prompt templates are not supported: send the input itself"))
        if self.conversation is not None and self.previous_response_id is not None:
            bad.append(("conversation", "conversation and previous_response_id cannot both be given: "
                                        "a response goes on from one or the other"))
        if any(isinstance(t, HostedTool) for t in self.tools or []):
            bad.append(("tools", "only function tools are supported"))
        if self.stream_options is not None and not self.stream:
            bad.append(("stream_options", "stream_options needs stream=true"))
        return bad + metadata_problems(self.metadata)

    def conversation_id(self) -> str | None:
        return self.conversation.id if isinstance(self.conversation, ConversationRef) else self.conversation

    def references(self) -> list[str]:
        """The ids the input's `item_reference` items name."""
        return [item.id for item in self.items() if isinstance(item, ItemReference)]

    def resolved(self, stored: dict[str, dict]) -> "ResponsesRequest":
        """This request with each `item_reference` replaced by the stored item it names (`stored`: by id)."""
        items = [ITEM.validate_python(stored[item.id]) if isinstance(item, ItemReference) else item
                 for item in self.items()]
        return self.model_copy(update={"input": items})

    def cuts(self, history: list) -> list[int]:
        """The numbers of first items that truncation "auto" may drop, fewest first: none, or all
        before a user message (where a turn begins, so that no call loses its output or a turn its
        start), the latest user message always kept."""
        items = history + self.items()
        return [0] + [k for k, item in enumerate(items) if k and isinstance(item, MessageItem) and item.role == "user"]

    def compact_threshold(self, context: int) -> int | None:
        """The prompt tokens past which this request is compacted first (None: never)."""
        for entry in self.context_management or []:
            return entry.compact_threshold or int(0.8 * context)
        return None

    def logprobs_wanted(self) -> bool:
        return self.top_logprobs is not None or "message.output_text.logprobs" in (self.include or [])

    def items(self) -> list:
        """The input as items (a text input: one user message)."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    def chat(self, history: list, drop: int = 0) -> ChatCompletionRequest:
        """The chat request this is, after the items of `history` (a previous response's input and
        output); `drop`: how many of the conversation's first items it leaves out (`cuts`; system
        and developer messages stay). Raises OpenAIError (400) for what a chat cannot say."""
        items = [item for k, item in enumerate(history + self.items()) if k >= drop or _standing(item)]
        items = _window(items)
        body = {"model": self.model, "messages": messages(self.instructions, items),
                **self.model_dump(include=set(SamplingOptions.model_fields), exclude_unset=True),
                "max_completion_tokens": self.max_output_tokens, "parallel_tool_calls": self.parallel_tool_calls}
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in self.tools]
        if isinstance(self.tool_choice, FunctionChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text is not None else None
        if isinstance(fmt, JsonSchemaText):
            body["response_format"] = {"type": "json_schema", "json_schema": fmt.model_dump(
                by_alias=True, exclude={"type"}, exclude_none=True)}
        elif fmt is not None:
            body["response_format"] = fmt.model_dump()
        effort = self.reasoning.effort if self.reasoning is not None else None
        if effort is not None:
            body["reasoning_effort"] = effort
        if self.logprobs_wanted():
            body.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        return as_chat(body, CHAT_TO_RESPONSES, "input")


class InputTokensRequest(Strict):
    """`POST /v1/responses/input_tokens`: the input a Responses request with these fields would
    give the model, counted (what it would generate from does not change the count)."""

    model: str | None = None
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    tools: list[FunctionTool | HostedTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    previous_response_id: str | None = None
    conversation: str | ConversationRef | None = None
    truncation: Literal["disabled", "auto"] | None = None

    def request(self, served_model: str) -> ResponsesRequest:
        """The Responses request counted (no input: an empty one, as after a previous response)."""
        given = {name: getattr(self, name) for name in self.model_fields_set - {"model", "input"}}
        if given.get("parallel_tool_calls") is None:
            given.pop("parallel_tool_calls", None)
        return ResponsesRequest(model=self.model or served_model, input=[] if self.input is None else self.input,
                                **given)


COMPACT_ASK = ("Write a summary of our conversation so far for whoever continues it without seeing it. "
               "Keep every goal and request of the user, what has been done and found (with names, numbers "
               "and results), the decisions taken, what is still open, and anything else needed to go on. "
               "Be complete and concise; answer with the summary only.")


class CompactRequest(Strict):
    """`POST /v1/responses/compact`: a conversation (`input`, after `previous_response_id`'s) to
    compact: its user messages, then the model's summary of it as one compaction item."""

    model: str | None = None
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    prompt_cache_key: str | None = None  # (prefix caching needs no key)
    prompt_cache_options: dict[str, Any] | None = None  # (nor options)
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    image: dict[str, Any] | None = None  # (image context options: this model takes no images)

    def items(self) -> list:
        """The input as items (a text input: one user message)."""
        return [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else list(self.input or [])

    def summary_request(self, served_model: str, max_tokens: int) -> ResponsesRequest:
        return summary_request(self.model or served_model, self.items(), self.instructions, max_tokens,
                               self.previous_response_id)


def summary_request(model: str, items: list, instructions: str | None, max_tokens: int,
                    previous_response_id: str | None = None) -> ResponsesRequest:
    """The Responses request whose answer is a conversation's summary: its items (after
    `previous_response_id`'s), then the ask; greedy, with as many first turns dropped as it takes
    to fit (they are being summarised)."""
    ask = MessageItem(role="user", content=COMPACT_ASK)
    return ResponsesRequest(model=model, input=list(items) + [ask], instructions=instructions,
                            previous_response_id=previous_response_id, max_output_tokens=max_tokens,
                            temperature=0, truncation="auto", store=False)


CHAT_TO_RESPONSES = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text",
                     "reasoning_effort": "reasoning", "top_logprobs": "top_logprobs"}


def messages(instructions: str | None, items: list) -> list[dict]:
    """Input items -> chat messages: consecutive reasoning, assistant message and function_call
    items are one assistant turn (as one response gave them)."""
    out: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    turn: dict | None = None
    for item in items:
        if isinstance(item, ReasoningItem):
            if turn is not None and (turn.get("content") is not None or turn.get("tool_calls")):
                out.append(turn)  # a reasoning item begins the next turn
                turn = None
            if item.text():
                turn = turn or {"role": "assistant", "content": None}
                turn["reasoning"] = (turn.get("reasoning") or "") + item.text()
        elif isinstance(item, MessageItem) and item.role == "assistant":
            turn = turn or {"role": "assistant", "content": None}
            turn["content"] = (turn["content"] or "") + _text(item.content)
        elif isinstance(item, FunctionCallItem):
            turn = turn or {"role": "assistant", "content": None}
            turn.setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}})
        else:
            if turn is not None:
                out.append(turn)
                turn = None
            if isinstance(item, FunctionCallOutputItem):
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
            elif isinstance(item, CompactionItem):  # (as a user message: every chat template takes one anywhere)
                out.append({"role": "user", "content": SUMMARY_INTRO + item.summary()})
            else:
                out.append({"role": item.role, "content": _text(item.content)})
    return out + ([turn] if turn is not None else [])


def _window(items: list) -> list:
    """The items a conversation's prompt renders: before its latest compaction only the user
    messages since the compaction before it (and system and developer messages), since the
    compactions hold the rest."""
    marks = [k for k, item in enumerate(items) if isinstance(item, CompactionItem)]
    last, since = (marks[-1] if marks else 0), (marks[-2] if len(marks) > 1 else -1)
    return [item for k, item in enumerate(items)
            if k >= last or _instructing(item) or k > since and _said_by_user(item)]


def since_compaction(items: list[dict]) -> list[dict]:
    """The items after a conversation's latest compaction (all where it has none): what a new
    compaction of it gives back the user messages of."""
    marks = [k for k, item in enumerate(items) if item.get("type") == "compaction"]
    return items[marks[-1] + 1:] if marks else items


def _said_by_user(item) -> bool:
    return isinstance(item, MessageItem) and item.role == "user"


def _standing(item) -> bool:
    """Whether an item stays when truncation drops the conversation's first items: a system or
    developer message, which speaks for the whole conversation, or a compaction, which holds
    what came before it."""
    return isinstance(item, CompactionItem) or _instructing(item)


def _instructing(item) -> bool:
    return isinstance(item, MessageItem) and item.role in ("system", "developer")


def _text(content: str | list) -> str:
    if isinstance(content, str):
        return content
    for part in content:
        if isinstance(part, MediaContent):
            raise OpenAIError(400, f"input: {part.type} is not supported: this model takes text", "input",
                              "unsupported_content")
    return "".join(p.text if isinstance(p, TextContent) else p.refusal for p in content)
