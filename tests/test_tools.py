"""Tool calling: the prompt a request's tools make, the grammar tool_choice asks for, the calls read
back (whole and streamed), and the HTTP layer in process (test_serve_api's fake coordinator), read
with the openai client. Over a real Ray app: test_serve.py."""
from __future__ import annotations

import copy
import json

import pytest

from specserve.models.tiny import EOS_TOKEN_IDS, byte_tokenizer
from specserve.serve.schema import ChatCompletionRequest
from specserve.serve.tools import OPEN, ToolPlan, prompt_messages, renders_tools
from test_serve_api import MODEL, FakeCoordinator, _error, _server

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
USER = {"role": "user", "content": "Weather in Paris?"}


def said(text: bytes) -> list[int]:
    """A scripted output (the byte tokenizer's ids), ended by EOS as the engine ends one."""
    return list(text) + [EOS_TOKEN_IDS[0]]


def request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(model=MODEL, messages=kw.pop("messages", [USER]), **kw)


def plan(**kw) -> ToolPlan:
    return ToolPlan.of(request(tools=[WEATHER, TIME], **kw))


# -- reading the output back ---------------------------------------------------------------------
def test_auto_reads_calls_and_leaves_the_rest_as_content():
    p = plan()
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "parameters": {"zone": "CET"}}</tool_call>')
    content, calls = p.read(text)
    assert content == "Let me look."
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        (0, "get_weather", {"city": "Paris"}), (1, "get_time", {"zone": "CET"})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    assert p.read("Sunny.") == ("Sunny.", [])
    # parallel_tool_calls false: the first call only
    assert [c["function"]["name"] for c in plan(parallel_tool_calls=False).read(text)[1]] == ["get_weather"]
    # a whole output that is a bare JSON call, or a list of them (Llama 3.1's "parameters" too)
    bare = ' {"name": "get_time", "parameters": {"zone": "UTC"}}'
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in p.read(bare)[1]] == [
        ("get_time", '{"zone":"UTC"}')] and p.read(bare)[0] is None
    assert len(p.read(f"[{bare}, {bare}]")[1]) == 2
    # cut short (max_tokens) after a complete object: the call still reads
    assert plan().read('<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}')[1][0]["function"]["name"] \
        == "get_time"


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Par',  # cut short inside the JSON
    '{"name": "Ada", "arguments": {}}',  # JSON that is no call of an offered function
    '{"name": "get_time", "arguments": {"zone": "UTC"}} and more',  # a call and then text
    '{"name": ["get_time"], "arguments": {}}',  # a name that is not a string
    "[" * 100_000 + "]" * 100_000,  # deeper than the JSON parser goes
    '<tool_call>{"name": "launch", "arguments": {}}</tool_call>',  # a function not offered
    '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>',  # arguments not an object
    '<tool_call>[{"name": "get_time", "arguments": {}}, {"name": "get_time", "arguments": {}}]</tool_call>',
    'ok <tool_call>{"name": "get_time", "arguments": {}}</tool_call> <tool_call>nonsense</tool_call>',
])
def test_auto_leaves_an_output_that_is_not_a_call_as_content(text):
    assert plan().read(text) == (text, [])


def test_required_and_named_read_what_their_grammar_made():
    content, calls = plan(tool_choice="required").read('[{"name": "get_time", "arguments": {"zone": "UTC"}}]')
    assert content is None and calls[0]["function"] == {"name": "get_time", "arguments": '{"zone":"UTC"}'}
    one = plan(tool_choice="required", parallel_tool_calls=False)
    assert one.read('{"name": "get_weather", "arguments": {"city": "Oslo"}}')[1][0]["function"]["name"] == \
        "get_weather"
    assert one.read('{"name": "get_weather", "argu') == ('{"name": "get_weather", "argu', [])  # cut short
    named = plan(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    content, calls = named.read('{"city": "Oslo"}')
    assert content is None and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}


@pytest.mark.parametrize("cut", [1, 2, 5, 11])
@pytest.mark.parametrize("choice,text", [
    (None, 'Checking the clock <tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'),
    ("required", '[{"name": "get_time", "arguments": {"zone": "UTC"}}]'),
    (None, '\n [{"name": "get_time", "arguments": {"zone": "UTC"}}]'),
    ({"type": "function", "function": {"name": "get_time"}}, '{"zone": "UTC"}'),
])
def test_a_stream_says_what_the_whole_output_says(cut, choice, text):
    """Whatever chunks the text arrives in: the content streamed is the whole read's (up to the
    spaces the whole read strips), no piece of a <tool_call> tag leaks out, and the calls agree."""
    p = plan(tool_choice=choice)
    stream = p.stream()
    content, deltas = "", []
    pieces = [text[i:i + cut] for i in range(0, len(text), cut)]
    for k, piece in enumerate(pieces):
        out, calls = stream.feed(piece, k == len(pieces) - 1)
        assert "<" not in out
        content += out
        deltas += calls
    whole_content, whole_calls = p.read(text)
    assert content.strip() == (whole_content or "") and stream.called
    arguments = "".join(d["function"].get("arguments", "") for d in deltas)
    assert arguments == "".join(c["function"]["arguments"] for c in whole_calls)
    assert [d["function"]["name"] for d in deltas if "name" in d["function"]] == ["get_time"]


def test_a_stream_without_a_call_sends_all_of_its_text():
    stream = plan().stream()
    sent = [stream.feed(t, final)[0] for t, final in (("It is <tool", False), ("s> time", False), (" <tool", True))]
    assert sent == ["It is ", "<tools> time", " <tool"] and not stream.called
    stream = plan().stream()  # JSON first: held whole, then sent as content when it is no call
    sent = [stream.feed(t, final)[0] for t, final in ((" ", False), ('{"a": ', False), ("1}", True))]
    assert sent == ["", "", ' {"a": 1}'] and not stream.called


# -- the grammar ---------------------------------------------------------------------------------
def matches(grammar, text: str) -> bool:
    import llguidance

    from specserve.engine.grammar import tokenizer_view

    tok = byte_tokenizer()
    matcher = llguidance.LLMatcher(tokenizer_view(tok, 260, ()), grammar.text(), log_level=0)
    ids = tok(text, add_special_tokens=False).input_ids
    return matcher.consume_tokens(ids) and matcher.is_accepting()


def test_required_and_named_grammars_take_exactly_the_calls_the_tools_allow():
    required = plan(tool_choice="required").grammar()
    assert matches(required, '[{"name":"get_weather","arguments":{"city":"Paris","days":3}}]')
    assert matches(required, '[{"name":"get_time","arguments":{"zone":"UTC"}},{"name":"get_weather",'
                             '"arguments":{"city":"Oslo"}}]')
    for bad in ('[]', '[{"name":"get_time","arguments":{"zone":"PST"}}]', '[{"name":"launch","arguments":{}}]',
                '[{"arguments":{"zone":"UTC"},"name":"get_time"}]', '{"name":"get_time","arguments":{"zone":"UTC"}}',
                '[{"name":"get_weather","arguments":{"city":"Paris","days":9}}]'):
        assert not matches(required, bad), bad
    single = plan(tool_choice="required", parallel_tool_calls=False).grammar()
    assert matches(single, '{"name":"get_time","arguments":{"zone":"CET"}}')
    assert not matches(single, '[{"name":"get_time","arguments":{"zone":"CET"}}]')
    named = plan(tool_choice={"type": "function", "function": {"name": "get_weather"}}).grammar()
    assert matches(named, '{"city":"Rome"}') and not matches(named, '{"zone":"UTC"}')
    assert plan().grammar() is None and ToolPlan.of(request(tools=[WEATHER], tool_choice="none")) is None


def test_parameters_with_their_own_defs_keep_them_inside_the_required_grammar():
    """A parameters schema that refers to its own $defs (as pydantic writes them) still constrains
    the call when it sits inside the "required" grammar's list of calls."""
    place = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
             "additionalProperties": False}
    trip = {"type": "function", "function": {"name": "plan_trip", "parameters": {
        "type": "object", "$defs": {"Place": place},
        "properties": {"to": {"$ref": "#/$defs/Place"}, "via": {"type": "array", "items": {"$ref": "#/$defs/Place"}}},
        "required": ["to"], "additionalProperties": False}}}
    grammar = ToolPlan.of(request(tools=[trip, TIME], tool_choice="required")).grammar()
    assert json.loads(grammar.source)["$defs"] == {"plan_trip__Place": place}
    assert matches(grammar, '[{"name":"plan_trip","arguments":{"to":{"city":"Oslo"},"via":[{"city":"Bergen"}]}}]')
    assert not matches(grammar, '[{"name":"plan_trip","arguments":{"to":{"town":"Oslo"}}}]')
    named = ToolPlan.of(request(tools=[trip], tool_choice={"type": "function", "function": {"name": "plan_trip"}}))
    assert matches(named.grammar(), '{"to":{"city":"Oslo"}}')


# -- the prompt ----------------------------------------------------------------------------------
HISTORY = [
    {"role": "system", "content": "Be brief."}, USER,
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
]


def test_a_template_without_tools_gets_them_in_the_system_message():
    tok = byte_tokenizer()
    assert not renders_tools(tok)
    body = request(messages=HISTORY, tools=[WEATHER, TIME])
    messages = prompt_messages(body.messages, ToolPlan.of(body), native=False)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith("Be brief.\n\n# Tools") and '"get_weather"' in messages[0]["content"]
    assert messages[2]["content"] == (f'{OPEN}\n{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}\n'
                                      f'</tool_call>\n{OPEN}\n{{"name": "get_time", "arguments": {{"zone": "CET"}}}}'
                                      '\n</tool_call>')
    assert messages[3]["content"] == ("<tool_response>\nSunny, 21 C\n</tool_response>\n"
                                      "<tool_response>\n14:05\n</tool_response>")
    # tool_choice none: the history still renders, the tools are not offered
    quiet = request(messages=HISTORY, tools=[WEATHER], tool_choice="none")
    assert "# Tools" not in prompt_messages(quiet.messages, ToolPlan.of(quiet), native=False)[0]["content"]
    # no system message of its own: the tools make one
    alone = request(tools=[WEATHER])
    assert prompt_messages(alone.messages, ToolPlan.of(alone), native=False)[0]["role"] == "system"


NATIVE_TEMPLATE = (
    "{% if tools %}<|im_start|>tools\n{% for t in tools %}{{ t.function.name }};{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}"
    "[{{ c.function.name }} {{ c.function.arguments.city or c.function.arguments.zone }}]"
    "{% endfor %}{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_that_renders_tools_gets_them_and_the_history_in_transformers_shape():
    tok = copy.deepcopy(byte_tokenizer())  # (the cached one keeps its own template)
    tok.chat_template = NATIVE_TEMPLATE
    assert renders_tools(tok)
    body = request(messages=HISTORY, tools=[WEATHER, TIME])
    p = ToolPlan.of(body)
    text = tok.apply_chat_template(prompt_messages(body.messages, p, native=True), tools=p.specs(),
                                   add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>tools\nget_weather;get_time;<|im_end|>\n"
                           "<|im_start|>system\nBe brief.<|im_end|>")
    assert "[get_weather Paris][get_time CET]" in text and "<|im_start|>tool\nSunny, 21 C(call_1)" in text


# -- over HTTP, in process -------------------------------------------------------------------------
@pytest.fixture()
def fake():
    return FakeCoordinator(max_model_len=4096)  # (the tools' text is long in the byte tokenizer's tokens)


@pytest.fixture()
def client(fake, monkeypatch):
    from starlette.testclient import TestClient

    from specserve.serve.openai_api import app

    _server(fake, monkeypatch)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def openai_client(client):
    from openai import OpenAI

    return OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)


def ask(client, stream: bool, **kw):
    """(message content, [(name, arguments)], finish_reason) of one chat request, whole or streamed
    (the deltas put together as a client does)."""
    oai = openai_client(client)
    if not stream:
        choice = oai.chat.completions.create(model=MODEL, messages=[USER], max_tokens=200, **kw).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls or [])
        return choice.message.content, calls, choice.finish_reason
    content, calls, finish = None, {}, None
    for chunk in oai.chat.completions.create(model=MODEL, messages=[USER], max_tokens=200, stream=True, **kw):
        delta = chunk.choices[0].delta
        if delta.content:
            content = (content or "") + delta.content
        for c in delta.tool_calls or []:
            if c.index not in calls:
                assert c.id.startswith("call_") and c.function.name
                calls[c.index] = [c.function.name, ""]
            calls[c.index][1] += c.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("stream", [False, True])
def test_auto_calls_come_back_as_tool_calls(client, fake, stream):
    fake.requests.clear()
    fake.script = said(b'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    content, calls, finish = ask(client, stream, tools=[WEATHER, TIME])
    assert calls == [("get_weather", '{"city":"Paris"}')] and finish == "tool_calls"
    assert content.strip() == "Sure."
    prompt = bytes(t for t in fake.requests[0].prompt_token_ids if t < 256).decode()
    assert "# Tools" in prompt and '"name": "get_time"' in prompt and fake.requests[0].params.grammar is None
    fake.script = said(b"Sunny, I think.")  # no call: content, as without tools
    assert ask(client, stream, tools=[WEATHER]) == ("Sunny, I think.", [], "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_is_called_through_its_parameters_grammar(client, fake, stream):
    fake.requests.clear()
    fake.script = said(b'{"city": "Oslo", "days": 2}')
    content, calls, finish = ask(client, stream, tools=[WEATHER, TIME],
                                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert (content, calls, finish) == (None, [("get_weather", '{"city": "Oslo", "days": 2}')], "tool_calls")
    grammar = fake.requests[0].params.grammar
    assert grammar.kind == "json_schema" and json.loads(grammar.source) == WEATHER["function"]["parameters"]


@pytest.mark.parametrize("stream", [False, True])
def test_required_calls_follow_a_grammar_of_every_tool(client, fake, stream):
    fake.requests.clear()
    fake.script = said(b'[{"name": "get_time", "arguments": {"zone": "UTC"}}, '
                       b'{"name": "get_weather", "arguments": {"city": "Rome"}}]')
    content, calls, finish = ask(client, stream, tools=[WEATHER, TIME], tool_choice="required")
    assert calls == [("get_time", '{"zone":"UTC"}'), ("get_weather", '{"city":"Rome"}')]
    assert content is None and finish == "tool_calls"
    schema = json.loads(fake.requests[0].params.grammar.source)
    assert schema["type"] == "array" and [c["properties"]["name"]["const"] for c in schema["items"]["anyOf"]] == \
        ["get_weather", "get_time"]


def test_a_conversation_goes_on_with_the_calls_and_their_results(client, fake):
    """The assistant message a response carried, sent back as a client does, and the tool results."""
    fake.script = said(b'<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>')
    oai = openai_client(client)
    first = oai.chat.completions.create(model=MODEL, messages=[USER], tools=[WEATHER, TIME], max_tokens=100)
    message = first.choices[0].message
    fake.requests.clear()
    fake.script = said(b"It is 14:05.")
    history = [USER, message, {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "14:05"}]
    second = oai.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER, TIME], max_tokens=100)
    # arguments nested past the JSON parser's depth: rendered as the text they are
    deep = {"id": "call_9", "type": "function", "function": {"name": "get_time", "arguments": "[" * 3000}}
    odd = [USER, {"role": "assistant", "tool_calls": [deep]},
           {"role": "tool", "tool_call_id": "call_9", "content": "?"}]
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": odd, "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert second.choices[0].message.content == "It is 14:05." and second.choices[0].finish_reason == "stop"
    prompt = bytes(t for t in fake.requests[0].prompt_token_ids if t < 256).decode()
    assert '"arguments": {"zone": "CET"}}\n</tool_call>' in prompt
    assert "<tool_response>\n14:05\n</tool_response>" in prompt


DEEP: dict = {"type": "object"}
for _ in range(400):  # (within what the body's JSON parser takes, past what a schema should need)
    DEEP = {"type": "object", "properties": {"x": DEEP}}


@pytest.mark.parametrize("change,param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frobnicated"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "tools"),
    ({"messages": [USER, {"role": "tool", "content": "14:05"}]}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages"),
    ({"messages": [{**USER, "tool_calls": []}]}, "messages"),
    ({"functions": [WEATHER["function"]]}, "functions"),
    ({"tools": [{"type": "function", "function": {"name": "deep", "parameters": DEEP}}],
      "tool_choice": "required"}, "tools"),
])
def test_a_bad_tool_request_is_a_400_naming_its_parameter(client, change, param):
    body = {"model": MODEL, "messages": [USER], "max_tokens": 3, **change}
    assert _error(client.post("/v1/chat/completions", json=body), 400)["param"] == param


def test_each_choice_reads_its_own_calls(client, fake):
    """n = 2: both choices carry the call, each with an id of its own, whole and streamed."""
    fake.script = said(b'<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>')
    body = {"model": MODEL, "messages": [USER], "tools": [TIME], "n": 2, "max_tokens": 100}
    choices = client.post("/v1/chat/completions", json=body).json()["choices"]
    ids = [c["message"]["tool_calls"][0]["id"] for c in choices]
    assert [c["finish_reason"] for c in choices] == ["tool_calls"] * 2 and len(set(ids)) == 2
    streamed = openai_client(client).chat.completions.create(**body, stream=True)
    starts = [(chunk.choices[0].index, d.id) for chunk in streamed for d in chunk.choices[0].delta.tool_calls or []]
    assert sorted(i for i, _ in starts) == [0, 1] and len({d for _, d in starts}) == 2
