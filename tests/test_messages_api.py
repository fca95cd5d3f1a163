"""Anthropic's Messages API (`/v1/messages`) in process: the real routes with the fake coordinator
of test_serve_api, read back with the anthropic client (its typed models and its stream helper
check every event): the chat a request becomes, text, thinking and tool_use blocks whole and
streamed, stop reasons, token counting, x-api-key, and errors in Anthropic's shape."""
from __future__ import annotations

import json

import pytest

import test_responses_api
from test_reasoning import said
from test_serve_api import MODEL

# the Responses API tests' app in process, and its fixtures
app_client, fake, client = test_responses_api.app_client, test_responses_api.fake, test_responses_api.client

WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
USER = {"role": "user", "content": "Weather in Oslo?"}


def claude(client, key: str = "unused"):
    from anthropic import Anthropic

    return Anthropic(base_url="http://testserver", api_key=key, http_client=client, max_retries=0)


def prompt_text(fake) -> str:
    return bytes(t for t in fake.requests[-1].prompt_token_ids if t < 256).decode()


def anthropic_error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"} and body["error"]["message"]
    return body["error"]


def test_text_whole_and_streamed(client, fake):
    fake.script = said(b"Cold and clear.")
    message = claude(client).messages.create(model=MODEL, max_tokens=100, system="Be brief.", messages=[USER],
                                             extra_body={"temperature": 0})  # (this client has no temperature)
    assert [b.type for b in message.content] == ["text"] and message.content[0].text == "Cold and clear."
    assert message.stop_reason == "end_turn" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.usage.output_tokens == len(fake.script) and message.usage.input_tokens > 0
    text = prompt_text(fake)
    assert text.index("system\nBe brief.") < text.index("user\nWeather in Oslo?")
    assert fake.requests[-1].params.max_tokens == 100 and fake.requests[-1].params.temperature == 0
    with claude(client).messages.stream(model=MODEL, max_tokens=100, messages=[USER]) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == final.content[0].text == "Cold and clear." and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == len(fake.script)


def test_stop_reasons(client, fake):
    fake.script = said(b"One. Two. Three.")
    cut = claude(client).messages.create(model=MODEL, max_tokens=4, messages=[USER])
    assert cut.stop_reason == "max_tokens" and cut.content[0].text == "One."
    stopped = claude(client).messages.create(model=MODEL, max_tokens=50, messages=[USER], stop_sequences=["Two"])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "Two"
    assert stopped.content[0].text == "One. "
    with claude(client).messages.stream(model=MODEL, max_tokens=50, messages=[USER], stop_sequences=["Two"]) as s:
        final = s.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "Two"


@pytest.mark.parametrize("stream", [False, True])
def test_tools_come_back_as_tool_use_blocks(client, fake, stream):
    fake.script = said(b'{"city": "Oslo"}')
    kw = dict(model=MODEL, max_tokens=100, messages=[USER], tools=[WEATHER],
              tool_choice={"type": "tool", "name": "get_weather"})
    if stream:
        with claude(client).messages.stream(**kw) as s:
            message = s.get_final_message()
    else:
        message = claude(client).messages.create(**kw)
    (block,) = message.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.input == {"city": "Oslo"}
    assert message.stop_reason == "tool_use"
    assert json.loads(fake.requests[-1].params.grammar.source) == WEATHER["input_schema"]
    fake.script = said(b'Let me look. <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')
    auto = claude(client).messages.create(model=MODEL, max_tokens=100, messages=[USER], tools=[WEATHER])
    assert [b.type for b in auto.content] == ["text", "tool_use"] and auto.content[1].input == {"city": "Rome"}


def test_a_conversation_with_tool_results_and_thinking_is_the_chat_it_says(client, fake):
    fake.script = said(b"It is sunny.")
    turns = [USER,
             {"role": "assistant", "content": [
                 {"type": "thinking", "thinking": "I should call it.", "signature": "sig"},
                 {"type": "text", "text": "Checking."},
                 {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}]},
             {"role": "user", "content": [
                 {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "Sunny"}]},
                 {"type": "text", "text": "So?"}]}]
    message = claude(client).messages.create(model=MODEL, max_tokens=50, messages=turns, tools=[WEATHER])
    assert message.content[0].text == "It is sunny."
    text = prompt_text(fake)
    for part in ("Weather in Oslo?", "Checking.", '"arguments": {"city": "Oslo"}',
                 "<tool_response>\nSunny\n</tool_response>", "So?"):
        assert part in text, part
    from specserve.serve.messages_schema import MessagesRequest

    chat = MessagesRequest(model=MODEL, max_tokens=5, messages=turns).chat()
    assert chat.messages[1].thinking() == "I should call it." and chat.messages[2].role == "tool"


def test_a_last_assistant_turn_is_a_prefill_the_answer_continues(client, fake):
    """Anthropic's prefill: the last turn the assistant's text is left open, and the answer is what
    follows it (it was rendered as a closed turn, and the model began a new one)."""
    fake.script = said(b'Mara"}')
    turns = [{"role": "user", "content": "A JSON object with a name."},
             {"role": "assistant", "content": [{"type": "text", "text": '{"name": "'}]}]
    message = claude(client).messages.create(model=MODEL, max_tokens=20, messages=turns)
    assert message.content[0].text == 'Mara"}'
    prefilled = prompt_text(fake)
    assert prefilled.endswith('{"name": "')
    chat = {"model": MODEL, "max_tokens": 20, "add_generation_prompt": False, "continue_final_message": True,
            "messages": [turns[0], {"role": "assistant", "content": '{"name": "'}]}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    assert prompt_text(fake) == prefilled
    counted = client.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": turns}).json()
    assert counted["input_tokens"] == len(fake.requests[-1].prompt_token_ids)
    spaced = [turns[0], {"role": "assistant", "content": '{"name": '}]
    r = client.post("/v1/messages", json={"model": MODEL, "max_tokens": 5, "messages": spaced})
    assert "trailing whitespace" in anthropic_error(r, 400)["message"]


def test_a_null_optional_parameter_is_its_default(client, fake):
    body = {"model": MODEL, "max_tokens": 5, "messages": [USER]}
    assert client.post("/v1/messages", json=body).status_code == 200
    plain = fake.requests[-1]
    nulls = dict.fromkeys(["temperature", "top_p", "top_k", "stream", "stop_sequences", "system", "tools",
                           "tool_choice", "thinking", "metadata"])
    r = client.post("/v1/messages", json={**body, **nulls})
    assert r.status_code == 200, r.text
    assert fake.requests[-1].params == plain.params and fake.requests[-1].prompt_token_ids == plain.prompt_token_ids


@pytest.mark.parametrize("stream", [False, True])
def test_a_reasoning_model_gives_a_thinking_block(fake, monkeypatch, stream):
    fake.script = said(b"<think>Oslo is north.</think>Cold.")
    with app_client(fake, monkeypatch, reasoning={}) as client:
        kw = dict(model=MODEL, max_tokens=100, messages=[USER], thinking={"type": "enabled", "budget_tokens": 2048})
        if stream:
            with claude(client).messages.stream(**kw) as s:
                message = s.get_final_message()
        else:
            message = claude(client).messages.create(**kw)
    thinking, text = message.content
    assert thinking.type == "thinking" and thinking.thinking == "Oslo is north." and text.text == "Cold."
    assert fake.requests[-1].params is not None


def test_thinking_reaches_the_template_as_enable_thinking():
    from specserve.serve.messages_schema import MessagesRequest

    for kind, enabled in (("enabled", True), ("disabled", False)):
        chat = MessagesRequest(model=MODEL, max_tokens=5, messages=[USER], thinking={"type": kind}).chat()
        assert chat.template_options()["enable_thinking"] is enabled


def test_count_tokens_is_what_the_prompt_renders_to(client, fake):
    fake.script = said(b"x")
    counted = claude(client).messages.count_tokens(model=MODEL, messages=[USER], system="Be brief.")
    claude(client).messages.create(model=MODEL, max_tokens=2, messages=[USER], system="Be brief.")
    assert counted.input_tokens == len(fake.requests[-1].prompt_token_ids)


def test_x_api_key_and_anthropic_shaped_errors(fake, monkeypatch):
    import anthropic

    fake.script = said(b"ok")
    with app_client(fake, monkeypatch, api_key="secret") as client:
        assert claude(client, "secret").messages.create(model=MODEL, max_tokens=5, messages=[USER]).content
        with pytest.raises(anthropic.AuthenticationError):
            claude(client, "wrong").messages.create(model=MODEL, max_tokens=5, messages=[USER])
        r = client.post("/v1/messages", json={"model": MODEL, "messages": [USER]}, headers={"x-api-key": "secret"})
        assert anthropic_error(r, 400)["type"] == "invalid_request_error"  # (no max_tokens)
        r = client.post("/v1/messages", json={"model": "claude-9", "max_tokens": 5, "messages": [USER]},
                        headers={"x-api-key": "secret"})
        assert anthropic_error(r, 404)["type"] == "not_found_error"
        r = client.post("/v1/messages", json={"model": MODEL, "max_tokens": 5, "messages": [USER]})
        assert anthropic_error(r, 401)["type"] == "authentication_error"
        r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [USER]})
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}  # (other routes: OpenAI's shape)


@pytest.mark.parametrize("extra", [
    {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
    {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}]},
    {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
    {"mcp_servers": [{"type": "url", "url": "http://x", "name": "m"}]},
    {"tool_choice": {"type": "tool"}},
    {"tool_choice": {"type": "any"}},  # (no tools)
    {"max_tokens": 100000},
    {"temperature": 3},
])
def test_what_cannot_be_served_is_a_4xx_in_anthropic_s_shape(client, extra):
    r = client.post("/v1/messages", json={"model": MODEL, "max_tokens": 5, "messages": [USER], **extra})
    assert anthropic_error(r, 400)["type"] == "invalid_request_error"


def test_an_engine_lost_mid_stream_is_an_error_event(fake, monkeypatch):
    fake.mode, fake.lost_after = "lost", 1
    with app_client(fake, monkeypatch, max_resumes=0) as client:
        body = {"model": MODEL, "max_tokens": 50, "messages": [USER], "stream": True}
        with client.stream("POST", "/v1/messages", json=body) as r:
            lines = list(r.iter_lines())
    kinds = [line[7:] for line in lines if line.startswith("event: ")]
    assert kinds[0] == "message_start" and kinds[-1] == "error"
    assert json.loads([line for line in lines if line.startswith("data: ")][-1][6:])["error"]["message"]
    fake.mode = "ok"
