"""The OpenAI request bodies the ingress accepts (pydantic): completions and chat, with the
extensions of docs/serving.md ("API"), and what each refuses with a 400 naming the parameter."""
from __future__ import annotations

import functools
import json
import types
import typing
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, StrictBool, model_validator

from specserve.engine.grammar import Grammar
from specserve.engine.sampling import GREEDY_BELOW, MAX_LOGPROBS

from .text import TextRules

# -- request schemas -----------------------------------------------------------------------------
class Strict(BaseModel):
    """A request object: unknown fields refused, and a null given for an optional field whose
    type has no null taken as not given (its default), as OpenAI's nullable parameters are
    (`"temperature": null`). A required field stays required."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        defaulted = _defaulted_without_null(cls)
        if any(value is None and key in defaulted for key, value in data.items()):
            data = {key: value for key, value in data.items() if value is not None or key not in defaulted}
        return data


@functools.cache
def _defaulted_without_null(model: type[BaseModel]) -> frozenset[str]:
    """The names (and aliases) of a model's fields that have a default and whose type admits no None."""
    return frozenset(name for field_name, field in model.model_fields.items()
                     if not field.is_required() and not _admits_none(field.annotation)
                     for name in (field_name, field.alias) if name)


def _admits_none(annotation: Any) -> bool:
    if annotation in (None, type(None), Any):
        return True
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType, Annotated):
        return any(_admits_none(arg) for arg in typing.get_args(annotation))
    return False


class StreamOptions(Strict):
    include_usage: StrictBool = False  # a last chunk with the usage
    continuous_usage_stats: StrictBool = False  # vLLM's: every chunk carries the usage so far


class JsonSchemaSpec(Strict):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict | bool | None = Field(None, alias="schema")  # None: any JSON object
    strict: StrictBool | None = None  # (the schema is always enforced)


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["json_object"]


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


class RegexFormat(BaseModel):  # extension: the whole output matches the pattern
    model_config = ConfigDict(extra="forbid")
    type: Literal["regex"]
    regex: str = Field(min_length=1)


class LarkFormat(BaseModel):  # extension: a Lark grammar (llguidance's dialect)
    model_config = ConfigDict(extra="forbid")
    type: Literal["lark"]
    lark: str = Field(min_length=1)


OutputFormat = Annotated[Union[TextFormat, JsonObjectFormat, JsonSchemaFormat, RegexFormat, LarkFormat],
                           Field(discriminator="type")]

MAX_CHOICES = 1024  # structured_outputs.choice: the most alternatives


class StructuredOutputs(Strict):
    """vLLM's `structured_outputs` (its successor to `guided_json` and friends): exactly one of
    a JSON schema (or its text), a regex, a list of choices, a Lark grammar, or any JSON object."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: dict | bool | str | None = Field(None, alias="json")
    regex: str | None = Field(None, min_length=1)
    choice: list[Annotated[str, Field(min_length=1)]] | None = Field(None, min_length=1, max_length=MAX_CHOICES)
    grammar: str | None = Field(None, min_length=1)  # Lark (llguidance's dialect)
    json_object: StrictBool | None = None

    def chosen(self) -> list[str]:
        """The constraints set (valid: exactly one)."""
        set_ = {"json": self.json_ is not None, "regex": self.regex is not None, "choice": self.choice is not None,
                "grammar": self.grammar is not None, "json_object": bool(self.json_object)}
        return [name for name, on in set_.items() if on]

    def grammar_of(self) -> Grammar:
        """The one constraint as a grammar. Raises ValueError for JSON text that does not parse."""
        if self.json_ is not None:
            schema = self.json_
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as err:
                    raise ValueError(f"json is not valid JSON: {err}") from err
            return Grammar.json_schema(schema)
        if self.regex is not None:
            return Grammar("regex", self.regex)
        if self.choice is not None:  # one Lark literal per choice (JSON's string escapes are Lark's)
            return Grammar("lark", "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice))
        if self.grammar is not None:
            return Grammar("lark", self.grammar)
        return Grammar("json_object")


def format_grammar(fmt: BaseModel | None) -> Grammar | None:
    """The grammar a response_format (or structured_outputs) asks for (None: free text). Raises
    ValueError for a schema that is not a JSON object."""
    if fmt is None or isinstance(fmt, TextFormat):
        return None
    if isinstance(fmt, StructuredOutputs):
        return fmt.grammar_of()
    if isinstance(fmt, JsonObjectFormat):
        return Grammar("json_object")
    if isinstance(fmt, JsonSchemaFormat):
        schema = fmt.json_schema.schema_
        return Grammar("json_object") if schema is None else Grammar.json_schema(schema)
    if isinstance(fmt, RegexFormat):
        return Grammar("regex", fmt.regex)
    return Grammar("lark", fmt.lark)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class PredictedOutput(Strict):
    """OpenAI's Predicted Outputs: text the answer is expected to mostly repeat (a file with a few
    edits). It is drafted where the output follows it (specserve.engine.prediction) and changes no
    token: the target verifies every draft."""

    type: Literal["content"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class PredictedTokens(Strict):
    """Extension: a prediction as token ids (a client that works in ids, such as one sending back
    an earlier answer's `return_token_ids`: no text round trip to split or merge tokens)."""

    type: Literal["token_ids"]
    token_ids: list[Annotated[int, Field(ge=0)]]


class SamplingOptions(Strict):
    """The sampling and scheduling options every generating route takes (chat, completions, responses)."""

    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1, le=2**31 - 1)  # extension
    min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)  # extension (vLLM's)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    user: str | None = None
    # applied to the target's logits at every position, drafts included (specserve.engine.processing)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]] | None = None
    # extensions
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0, allow_inf_nan=False)  # HF's / vLLM's
    ignore_eos: StrictBool = False
    min_tokens: int = Field(0, ge=0)  # vLLM's: no EOS, stop_token_ids or stop string before this many tokens
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None  # vLLM's: ids that end the output (text not shown)
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, min_length=1)  # vLLM's: only these
    bad_words: list[str] | None = None  # vLLM's: words never generated (at the start of the text or after a space)
    skip_special_tokens: StrictBool = True  # vLLM's: false shows special tokens' text
    num_speculative_tokens: int | None = Field(None, ge=0)
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1)  # vLLM's: a lower value is admitted first


class SamplingRequest(SamplingOptions):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)  # choices per prompt, each its own generation (seeded: seed + its index)
    include_stop_str_in_output: StrictBool = False  # vLLM's: the stop string, or the ending stop token's text, stays in
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # vLLM's: keep the prompt's last k tokens (-1: context)
    # the generated token ids ride along in the choice (streaming: the ids new since the last chunk)
    return_token_ids: StrictBool = False
    # structured output (chat, and completions as an extension): json_object / json_schema, or the
    # extensions regex / lark; every generated token follows it (specserve.engine.grammar)
    response_format: OutputFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's extension, the same engine path
    # OpenAI's (chat; completions as an extension), or token ids (an extension)
    prediction: Annotated[PredictedOutput | PredictedTokens, Field(discriminator="type")] | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        """(param, why) for every option set to something this server does not do."""
        bad = []
        if self.stream_options is not None and not self.stream:
            bad.append(("stream_options", "stream_options needs stream=true"))
        if self.structured_outputs is not None:
            chosen = self.structured_outputs.chosen()
            if len(chosen) != 1:
                bad.append(("structured_outputs", "structured_outputs takes exactly one of json, regex, choice, "
                                                  f"grammar, json_object (got {', '.join(chosen) or 'none'})"))
            if self.response_format is not None and not isinstance(self.response_format, TextFormat):
                bad.append(("structured_outputs", "structured_outputs cannot be combined with response_format"))
        return bad

    def output_format(self) -> tuple[BaseModel | None, str]:
        """The format that constrains the output and the parameter that asked for it."""
        if self.structured_outputs is not None:
            return self.structured_outputs, "structured_outputs"
        return self.response_format, "response_format"

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def text_rules(self) -> TextRules:
        return TextRules(tuple(self.stop_list()), self.min_tokens, self.include_stop_str_in_output,
                         self.skip_special_tokens)

    def logprobs_wanted(self) -> int | None:
        """None: no log-probabilities; k: each token's, with k alternatives."""
        if isinstance(self, ChatCompletionRequest):
            return (self.top_logprobs or 0) if self.logprobs else None
        return self.logprobs

    def candidates(self) -> int:
        """Generations per prompt (a completion's best_of may run more than it returns)."""
        return self.n

    def ranked(self) -> bool:
        return False


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # 0: only with echo (the prompt, scored, nothing generated)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # alternatives per token (0: the token's own)
    echo: StrictBool = False
    # candidates generated per prompt, of which the n with the highest log-probability per token
    # are returned (OpenAI's legacy option; not streamed; greedy: the candidates would be equal, n run)
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None  # fill in the middle (a code model's, config `fim`): the text after the cursor

    def unsupported(self) -> list[tuple[str, str]]:
        bad = super().unsupported()
        if self.max_tokens == 0 and not self.echo:
            bad.append(("max_tokens", "max_tokens 0 needs echo: true (the prompt and its logprobs, nothing generated)"))
        if self.best_of is not None and self.best_of < self.n:
            bad.append(("best_of", f"best_of ({self.best_of}) must be at least n ({self.n})"))
        elif self.stream and self.ranked():
            bad.append(("best_of", "best_of > n cannot be streamed (the best are known once all have finished)"))
        if self.suffix and (self.echo or self.truncate_prompt_tokens is not None):
            bad.append(("suffix", "suffix (fill in the middle) cannot be combined with echo or truncate_prompt_tokens"))
        return bad

    def candidates(self) -> int:
        """Generations per prompt: best_of, or n where nothing is ranked (`ranked`)."""
        return self.best_of if self.ranked() else self.n

    def ranked(self) -> bool:
        """Whether more candidates run than are returned: best_of > n, sampled, and something generated."""
        return (self.best_of or 1) > self.n and self.temperature >= GREEDY_BELOW and self.max_tokens != 0

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request: one text or token-id list, or a list of them (a batch)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            return list(prompt)
        return [prompt]


# -- tool calling (chat): the functions offered, the choice among them, the calls made -----------
FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"


class FunctionDef(Strict):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object (None: any object)
    strict: StrictBool | None = None  # (the schema is always enforced where the output is constrained)


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(Strict):
    name: str
    arguments: str  # JSON text, as OpenAI's API sends it


class ToolCall(Strict):  # a call an earlier assistant message made
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class _Message(Strict):
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class InstructionMessage(_Message):
    role: Literal["system", "developer"]


class UserMessage(_Message):
    role: Literal["user"]


class AssistantMessage(_Message):
    role: Literal["assistant"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None  # the calls it made
    refusal: str | None = None  # (sent back by clients that replay a response's message; not rendered)
    # a reasoning model's thinking, as a response gave it (vLLM's name, DeepSeek's): the chat
    # template gets it as `reasoning_content` (and `reasoning`), and renders it or drops it
    reasoning: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _says_something(self) -> "AssistantMessage":
        if self.content is None and not self.tool_calls and self.thinking() is None:
            raise ValueError("an assistant message needs content, tool_calls or reasoning")
        if None not in (self.reasoning, self.reasoning_content) and self.reasoning != self.reasoning_content:
            raise ValueError("an assistant message's reasoning and reasoning_content differ")
        return self

    def thinking(self) -> str | None:
        """Its reasoning text, under either name (None: none)."""
        return self.reasoning if self.reasoning is not None else self.reasoning_content


class ToolMessage(_Message):
    role: Literal["tool"]
    tool_call_id: str  # the call whose result this is


ChatMessage = Annotated[Union[InstructionMessage, UserMessage, AssistantMessage, ToolMessage],
                        Field(discriminator="role")]


MAX_TEMPLATE_KWARGS = 32
# apply_chat_template's own arguments, and what the server sets itself
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs"})


class Conversation(Strict):
    """A chat: the messages, the tools offered, and how the chat template renders them (shared by
    chat completions and /tokenize)."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: auto with tools
    parallel_tool_calls: StrictBool = True
    # extensions (vLLM's): how the chat template renders the conversation
    add_generation_prompt: StrictBool = True  # open an assistant turn after the messages
    continue_final_message: StrictBool = False  # leave the last (assistant) message open: the output continues it
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the template (say, enable_thinking)
    # OpenAI's: how hard a reasoning model thinks; the chat template gets it as `reasoning_effort`
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None

    def tool_mode(self) -> str:
        """"none" (no tools in play), "auto", "required" or "named" (tool_choice names one)."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    def template_options(self) -> dict[str, Any]:
        """The chat template's arguments besides the messages and tools."""
        effort = {} if self.reasoning_effort is None else {"reasoning_effort": self.reasoning_effort}
        return {**(self.chat_template_kwargs or {}), **effort, "add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message}

    def conversation_problems(self) -> list[tuple[str, str]]:
        return self._tool_problems() + self._result_problems() + self._template_problems()

    def _result_problems(self) -> list[tuple[str, str]]:
        """A tool message must answer a call of the assistant message its run of tool messages
        follows (OpenAI's rule: a result without its call would render as a turn the model
        never took)."""
        calls: set[str] | None = None  # ids the tool messages since the last assistant message may answer
        for i, message in enumerate(self.messages):
            if message.role == "tool":
                if calls is None:
                    return [(f"messages.{i}", "a message with role 'tool' must follow an assistant message "
                                              "with tool_calls (it answers one of them)")]
                if message.tool_call_id not in calls:
                    return [(f"messages.{i}.tool_call_id", f"tool_call_id {message.tool_call_id[:64]!r} names no "
                                                           "call of the assistant message before it")]
            else:
                calls = {c.id for c in message.tool_calls or ()} or None if message.role == "assistant" else None
        return []

    def _tool_problems(self) -> list[tuple[str, str]]:
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) < len(names):
            return [("tools", "tool function names must be unique")]
        if self.tool_choice not in (None, "none") and not self.tools:
            return [("tool_choice", "tool_choice needs tools")]
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            return [("tool_choice", f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools")]
        return []

    def _template_problems(self) -> list[tuple[str, str]]:
        if self.continue_final_message and self.add_generation_prompt:
            return [("continue_final_message", "continue_final_message needs add_generation_prompt: false")]
        if self.continue_final_message and self.messages[-1].role != "assistant":
            return [("continue_final_message", "continue_final_message needs an assistant message last")]
        named = list(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None and "reasoning_effort" in named:
            return [("chat_template_kwargs", "give reasoning_effort once: as the parameter or in chat_template_kwargs")]
        if len(named) > MAX_TEMPLATE_KWARGS:
            return [("chat_template_kwargs", f"at most {MAX_TEMPLATE_KWARGS} chat_template_kwargs")]
        for name in named:
            if not name.isidentifier() or name in RESERVED_TEMPLATE_KWARGS:
                return [("chat_template_kwargs", f"chat_template_kwargs may not set {name[:64]!r}")]
        return []


MAX_METADATA = 16  # OpenAI's limits on metadata: pairs, key and value lengths


def metadata_problems(metadata: dict[str, str] | None) -> list[tuple[str, str]]:
    """(param, why) where metadata is over OpenAI's limits (a request's, a response's or a conversation's)."""
    metadata = metadata or {}
    if len(metadata) > MAX_METADATA or any(len(k) > 64 or len(v) > 512 for k, v in metadata.items()):
        return [("metadata", f"metadata holds at most {MAX_METADATA} pairs, keys of at most 64 characters "
                             "and values of at most 512")]
    return []


class ChatCompletionRequest(SamplingRequest, Conversation):
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    include_reasoning: StrictBool = True  # vLLM's: false leaves a reasoning model's thinking out of the answer
    # OpenAI's, taken as they are: tags and hints that change no token here
    metadata: dict[str, str] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: str | None = None  # (prefix caching needs no key)
    prompt_cache_retention: Literal["in-memory", "24h"] | None = None
    safety_identifier: str | None = None
    # OpenAI's, refused where they ask for what this server does not do
    store: StrictBool | None = None  # (stored chat completions: true is refused; the Responses API stores)
    modalities: list[Literal["text", "audio"]] | None = None
    audio: dict[str, Any] | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        bad = super().unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            bad.append(("top_logprobs", "top_logprobs needs logprobs: true"))
        if self.store:
            bad.append(("store", "stored chat completions are not supported: leave store false, or use "
                                 "/v1/responses, which stores responses"))
        if "audio" in (self.modalities or []) or self.audio is not None:
            bad.append(("modalities" if self.audio is None else "audio", "this model outputs text only"))
        bad.extend(metadata_problems(self.metadata))
        bad.extend(self.conversation_problems())
        fmt, param = self.output_format()
        if self.tool_mode() != "none" and fmt is not None and not isinstance(fmt, TextFormat):
            bad.append((param, f"{param} cannot be combined with tools unless tool_choice is none"))
        return bad


# -- /tokenize and /detokenize (vLLM's routes) -----------------------------------------------------
class TokenizeTextRequest(Strict):
    model: str | None = None  # (None: the served model)
    prompt: str
    add_special_tokens: StrictBool = True  # as a completion's prompt is tokenized
    return_token_strs: StrictBool = False


class TokenizeChatRequest(Conversation):
    model: str | None = None
    return_token_strs: StrictBool = False


def _tokenize_kind(body: Any) -> str:
    return "TokenizeChatRequest" if isinstance(body, dict) and "messages" in body else "TokenizeTextRequest"


# /tokenize's body: a chat where it has messages, else a text (so that an error is the one kind's)
TokenizeRequest = Annotated[Union[Annotated[TokenizeTextRequest, Tag("TokenizeTextRequest")],
                                  Annotated[TokenizeChatRequest, Tag("TokenizeChatRequest")]],
                            Discriminator(_tokenize_kind)]


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]
