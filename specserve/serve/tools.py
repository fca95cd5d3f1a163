"""Tool calling (chat completions): the tools a request offers, put into its prompt; the grammar its
tool_choice asks for; and the calls read back out of what the model wrote.

    tool_choice        the prompt has                  the output is                  read back as
    "none"             no tools                        free text                      content
    "auto" (default)   the tools and the call format   free text                      <tool_call> blocks: calls,
                                                                                      the rest: content; or a
                                                                                      whole output that is a
                                                                                      JSON call or list of them
    "required"         ... and "call one or more"      grammar: [call, ...]           the calls
                                                       (parallel_tool_calls false: one call)
    {function: f}      ... and "call f"                grammar: f's parameters        one call of f

A call in the output is `{"name": ..., "arguments": {...}}`. A chat template that renders tools
itself (its source mentions `tools`) gets them through `apply_chat_template(tools=...)`, and the
history's calls and results in transformers' shape. Any other template gets them in the system
message, the history's calls as <tool_call> blocks in the assistant's text and their results as a
user turn of <tool_response> blocks: the Hermes convention (Qwen's and Hermes' own templates
render tools this way), which is also what "auto" reads back, beside an output that is nothing but a
JSON call or list of calls (what Llama 3.1's template asks for, its `parameters` read as
`arguments`). "required" and a named function are
constrained by a grammar, so their calls always parse and always match the schema; "auto" is read
back as written: a block that does not parse, or names no offered tool, leaves the whole output
as content.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from specserve.engine.grammar import Grammar

from .schema import AssistantMessage, ChatCompletionRequest, ChatMessage, Tool, ToolMessage
from .text import tag_prefix

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.S)
ANY_OBJECT = {"type": "object"}


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def renders_tools(tokenizer, template: str | None = None) -> bool:
    """Whether the chat template (`template`, else the tokenizer's) renders `tools` itself."""
    template = tokenizer.chat_template if template is None else template
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    return isinstance(template, str) and "tools" in template


# -- the prompt ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolPlan:
    """What one chat request does with tools: mode is "auto", "required" or "named" (a request
    with tool_choice "none", or without tools, has no plan)."""

    tools: tuple[Tool, ...]
    mode: str
    named: str | None = None  # mode "named": the function
    parallel: bool = True

    @staticmethod
    def of(body: ChatCompletionRequest) -> "ToolPlan | None":
        mode = body.tool_mode()
        if mode == "none":
            return None
        named = body.tool_choice.function.name if mode == "named" else None
        return ToolPlan(tuple(body.tools), mode, named, body.parallel_tool_calls)

    def names(self) -> set[str]:
        return {t.function.name for t in self.tools}

    def specs(self) -> list[dict]:
        """The tools as OpenAI sends them (what chat templates that render tools expect)."""
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def instructions(self) -> str:
        """The system message's tool section, for a template that does not render tools."""
        lines = ["# Tools", "", "You may call the following functions. Their signatures:", "<tools>"]
        lines += [json.dumps(spec, ensure_ascii=False) for spec in self.specs()]
        lines += ["</tools>", ""]
        if self.mode == "named":
            lines.append(f"Call the function {self.named} now: reply with its arguments alone, as one JSON object.")
        elif self.mode == "required":
            many = "a JSON list of calls, each" if self.parallel else "one call,"
            lines.append(f"Call a function now: reply with {many} "
                         '{"name": <function name>, "arguments": <arguments object>}.')
        else:
            lines += ["To call a function, reply with one block per call:", OPEN,
                      '{"name": <function name>, "arguments": <arguments object>}', CLOSE]
        return "\n".join(lines)

    # -- the output --------------------------------------------------------------------------------
    def grammar(self) -> Grammar | None:
        """The output's grammar ("auto": None, free text). Keys keep their order: a call's name
        comes before its arguments."""
        if self.mode == "auto":
            return None
        if self.mode == "named":
            return Grammar("json_schema", json.dumps(self._parameters(self.named)))
        defs: dict = {}
        calls = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                   "arguments": _hoisted(self._parameters(t.function.name),
                                                                         t.function.name, defs)},
                  "required": ["name", "arguments"], "additionalProperties": False} for t in self.tools]
        one = calls[0] if len(calls) == 1 else {"anyOf": calls}
        root = {"type": "array", "items": one, "minItems": 1} if self.parallel else one
        return Grammar("json_schema", json.dumps({**root, "$defs": defs} if defs else root))

    def _parameters(self, name: str) -> dict:
        schema = next(t.function.parameters for t in self.tools if t.function.name == name)
        return schema or ANY_OBJECT

    def read(self, text: str) -> tuple[str | None, list[dict]]:
        """A whole output -> (content, its calls as a streamed delta lists them: index, id, type,
        function)."""
        if self.mode == "named":
            return None, [_call(0, self.named, text)]
        if self.mode == "required":
            found = self._parsed(text)
            return (text, []) if found is None else (None, _calls(found))
        if OPEN not in text:
            bare = self._parsed(text.strip()) if text.lstrip()[:1] in ("{", "[") else None
            return (text, []) if bare is None else (None, _calls(bare if self.parallel else bare[:1]))
        found = []
        for match in _BLOCK.finditer(text):
            calls = self._parsed(match.group(1))
            if calls is None or len(calls) != 1:
                return text, []
            found.extend(calls)
        return _BLOCK.sub("", text).strip() or None, _calls(found if self.parallel else found[:1])

    def _parsed(self, text: str) -> list[tuple[str, str]] | None:
        """A JSON call or list of calls -> [(name, arguments as compact JSON text, as a named call's
        grammar writes them)], or None when the text is not that (bad JSON, a function not offered,
        arguments that are not an object)."""
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):  # (a model may nest brackets past the parser's depth)
            return None
        out = []
        for call in value if isinstance(value, list) else [value]:
            if not isinstance(call, dict) or not isinstance(call.get("name"), str) or call["name"] not in self.names():
                return None
            arguments = call.get("arguments", call.get("parameters", {}))
            if isinstance(arguments, str):
                arguments = _arguments(arguments)
            if not isinstance(arguments, dict):
                return None
            out.append((call["name"], json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))))
        return out or None

    def stream(self) -> "ToolStream":
        return ToolStream(self)


def _hoisted(schema: dict, tool: str, defs: dict) -> dict:
    """A function's parameters schema for a place inside a larger schema: its own `$defs` (or
    `definitions`) move into `defs` (the larger one's root `$defs`) named `{tool}__{name}`, and
    its references to them follow."""
    local = {name: sub for key in ("definitions", "$defs") if isinstance(schema.get(key), dict)
             for name, sub in schema[key].items()}

    def moved(node, top: bool = False):
        if isinstance(node, list):
            return [moved(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {k: moved(v) for k, v in node.items() if not (top and k in ("$defs", "definitions"))}
        ref = out.get("$ref")
        for prefix in ("#/$defs/", "#/definitions/"):
            if isinstance(ref, str) and ref.startswith(prefix) and ref[len(prefix):] in local:
                out["$ref"] = f"#/$defs/{tool}__{ref[len(prefix):]}"
        return out

    for name, sub in local.items():
        defs[f"{tool}__{name}"] = moved(sub)
    return moved(schema, top=True)


def _call(index: int, name: str, arguments: str) -> dict:
    """One of a message's tool_calls (index: its place in a streamed delta's list)."""
    return {"index": index, "id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def _calls(found: list[tuple[str, str]]) -> list[dict]:
    return [_call(i, name, arguments) for i, (name, arguments) in enumerate(found)]


def without_index(calls: list[dict]) -> list[dict]:
    """A whole message's tool_calls carry no index (only streamed deltas do)."""
    return [{k: v for k, v in c.items() if k != "index"} for c in calls]


@dataclass
class ToolStream:
    """One streamed choice's text -> (content to send, tool-call deltas to send). A named call
    streams its arguments as they come; "required" sends its calls whole at the end; "auto" streams
    content until a <tool_call> may begin, then holds the rest until the end and reads it back (an
    output that begins with `{` or `[` is held whole: it may be a bare JSON call)."""

    plan: ToolPlan
    held: str = ""
    in_call: bool = False
    started: bool = False  # the output has begun with something other than whitespace
    called: bool = False  # some call went out (finish_reason "tool_calls")

    def feed(self, text: str, final: bool) -> tuple[str, list[dict]]:
        if self.plan.mode == "named":
            return "", self._named(text)
        if self.plan.mode == "required":
            return self._at_end(text, final)
        return self._auto(text, final)

    def _named(self, text: str) -> list[dict]:
        if not self.called:  # the first delta: the call's id, type and name
            self.called = True
            return [_call(0, self.plan.named, text)]
        return [{"index": 0, "function": {"arguments": text}}] if text else []

    def _at_end(self, text: str, final: bool) -> tuple[str, list[dict]]:
        self.held += text
        if not final:
            return "", []
        content, calls = self.plan.read(self.held)
        self.called = bool(calls)
        return content or "", calls

    def _auto(self, text: str, final: bool) -> tuple[str, list[dict]]:
        if self.in_call:
            return self._at_end(text, final)
        self.held += text
        if not self.started:
            lead = self.held.lstrip()
            if not lead and not final:
                return "", []
            self.started = True
            if lead[:1] in ("{", "["):  # maybe a bare JSON call: held to the end and read back whole
                self.in_call = True
                return self._at_end("", final)
        start = self.held.find(OPEN)
        if start >= 0:
            out, rest = self.held[:start], self.held[start:]
            self.held, self.in_call = "", True
            more, calls = self._at_end(rest, final)
            return out + more, calls
        keep = 0 if final else tag_prefix(self.held, OPEN)
        out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return out, []


# -- the history ---------------------------------------------------------------------------------
def prompt_messages(messages: list[ChatMessage], plan: ToolPlan | None, native: bool) -> list[dict]:
    """The request's messages as the chat template takes them: with a template that renders tools,
    in transformers' shape; otherwise in the Hermes convention, the plan's tools in the system
    message."""
    if native:
        return [_native(m) for m in messages]
    out: list[dict] = []
    for m in messages:
        if isinstance(m, ToolMessage):
            block = f"<tool_response>\n{m.text()}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
        elif isinstance(m, AssistantMessage) and m.tool_calls:
            calls = [{"name": c.function.name, "arguments": _arguments(c.function.arguments)} for c in m.tool_calls]
            blocks = [f"{OPEN}\n{json.dumps(call, ensure_ascii=False)}\n{CLOSE}" for call in calls]
            out.append(_thinking(m, {"role": m.role, "content": "\n".join(([m.text()] if m.text() else []) + blocks)}))
        else:
            out.append(_thinking(m, {"role": m.role, "content": m.text()}))
    for m in out:
        m.pop("tool_results", None)
    if plan is not None:
        if out and out[0]["role"] in ("system", "developer"):
            out[0]["content"] += "\n\n" + plan.instructions()
        else:
            out.insert(0, {"role": "system", "content": plan.instructions()})
    return out


def _native(m: ChatMessage) -> dict:
    out = {"role": m.role, "content": m.text()}
    if isinstance(m, AssistantMessage) and m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                             for c in m.tool_calls]
    if isinstance(m, ToolMessage):
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    return _thinking(m, out)


def _thinking(m: ChatMessage, out: dict) -> dict:
    """An assistant message's reasoning, where it has one, under both names templates read."""
    thinking = m.thinking() if isinstance(m, AssistantMessage) else None
    if thinking is not None:
        out["reasoning_content"] = out["reasoning"] = thinking
    return out


def _arguments(text: str):
    """A call's arguments as templates render them: the JSON object, or the text when it is not one."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return text
    return value if isinstance(value, dict) else text
