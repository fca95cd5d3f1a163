"""The Responses API (`/v1/responses`) in process: the real routes with the fake coordinator of
test_serve_api, read back with the openai client (whose typed models and stream helper check every
event): text and items in, the chat they become, whole and streamed output, tools, structured
output, a reasoning model's reasoning items and logprobs, the store (previous_response_id, GET,
DELETE, input items) and every refusal."""
from __future__ import annotations

import json
import time

import pytest

from specserve.serve import reasoning, response_store
from specserve.serve.response_store import ResponseStore
from specserve.serve.responses_api import input_page
from test_reasoning import said
from test_serve_api import MODEL, FakeCoordinator, _error, _server

WEATHER = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture()
def fake():
    return FakeCoordinator(max_model_len=4096)


def app_client(fake, monkeypatch, **config):
    from starlette.testclient import TestClient

    from specserve.serve.openai_api import app

    _server(fake, monkeypatch, **config)
    return TestClient(app, raise_server_exceptions=False)


@pytest.fixture()
def client(fake, monkeypatch):
    with app_client(fake, monkeypatch) as c:
        yield c


def oai(client):
    from openai import OpenAI

    return OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)


def prompt_text(fake) -> str:
    """The prompt the engine got last (the byte tokenizer's text)."""
    return bytes(t for t in fake.requests[-1].prompt_token_ids if t < 256).decode()


def events_of(client, body: dict) -> list[dict]:
    """A streamed response's events (type, payload), as sent."""
    with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = list(r.iter_lines())
    kinds = [line[7:] for line in lines if line.startswith("event: ")]
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert kinds == [e["type"] for e in events] and [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


# -- text in, text out ------------------------------------------------------------------------------
def test_text_in_text_out_whole_and_streamed(client, fake):
    fake.script = said(b"Paris is the capital.")
    response = oai(client).responses.create(model=MODEL, input="Capital of France?", instructions="Be brief.",
                                            max_output_tokens=100, temperature=0)
    assert response.status == "completed" and response.output_text == "Paris is the capital."
    assert response.id.startswith("resp_") and response.output[0].type == "message"
    assert response.usage.output_tokens == len(fake.script) and response.usage.input_tokens > 0
    assert response.usage.output_tokens_details.reasoning_tokens == 0
    assert "num_draft_tokens" in response.model_extra["speculation"]
    text = prompt_text(fake)
    assert text.index("system\nBe brief.") < text.index("user\nCapital of France?")
    assert fake.requests[-1].params.temperature == 0 and fake.requests[-1].params.max_tokens == 100
    with oai(client).responses.stream(model=MODEL, input="Capital of France?", max_output_tokens=100) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == "Paris is the capital." and final.status == "completed"
    kinds = [e["type"] for e in events_of(client, {"model": MODEL, "input": "Hi"})]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds[2:5] == ["response.output_item.added", "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


def test_a_cut_answer_is_incomplete(client, fake):
    fake.script = said(b"A long answer that goes on and on")
    response = oai(client).responses.create(model=MODEL, input="Talk", max_output_tokens=6)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == "A long" and response.output[-1].status == "incomplete"
    events = events_of(client, {"model": MODEL, "input": "Talk", "max_output_tokens": 6})
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["output"][-1]["status"] == "incomplete"


def test_a_call_cut_by_max_output_tokens_is_incomplete(client, fake):
    """The function call max_output_tokens cut is `incomplete`, its arguments as far as they went
    (it was `completed`, with arguments that do not parse)."""
    fake.script = said(b'{"city": "Rome", "detail": "every hour of the day"}')
    body = {"model": MODEL, "input": "Weather in Rome?", "tools": [WEATHER], "max_output_tokens": 12,
            "tool_choice": {"type": "function", "name": "get_weather"}}
    whole = client.post("/v1/responses", json=body).json()
    events = events_of(client, body)
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    for response in (whole, events[-1]["response"]):
        assert response["status"] == "incomplete"
        (call,) = response["output"]
        assert call["type"] == "function_call" and call["status"] == "incomplete"
        assert '{"city": "Rome", "detail": "every hour of the day"}'.startswith(call["arguments"])
    assert done[-1]["status"] == "incomplete"
    fake.script = said(b'{"city": "Rome"}')
    assert client.post("/v1/responses", json={**body, "max_output_tokens": 64}).json()["output"][0]["status"] == \
        "completed"


def test_a_null_optional_parameter_is_its_default(client, fake):
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 4}
    first = client.post("/v1/responses", json=body).json()
    plain = fake.requests[-1]
    nulls = dict.fromkeys(["temperature", "top_p", "stream", "store", "parallel_tool_calls", "tools", "tool_choice",
                           "text", "reasoning", "instructions", "metadata", "truncation", "background", "include"])
    r = client.post("/v1/responses", json={**body, **nulls})
    assert r.status_code == 200, r.text
    assert fake.requests[-1].params == plain.params and fake.requests[-1].prompt_token_ids == plain.prompt_token_ids
    assert r.json()["store"] is True and client.get(f"/v1/responses/{r.json()['id']}").status_code == 200
    assert first["store"] is True


def test_items_in_are_the_conversation_the_chat_template_renders(client, fake):
    fake.script = said(b"It is sunny.")
    items = [{"role": "developer", "content": "Answer from the tool."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C"},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Noted.", "annotations": []}]},
             {"role": "user", "content": "And now?"}]
    response = oai(client).responses.create(model=MODEL, input=items, tools=[WEATHER])
    assert response.output_text == "It is sunny."
    text = prompt_text(fake)
    for part in ("Answer from the tool.", "Weather in Oslo?", '"arguments": {"city": "Oslo"}',
                 "<tool_response>\nSunny, 21 C\n</tool_response>", "Noted.", "And now?"):
        assert part in text, part
    assert text.index("Weather in Oslo?") < text.index("Sunny, 21 C") < text.index("And now?")


# -- tools and formats -------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_function_calls_come_back_as_items(client, fake, stream):
    fake.script = said(b'{"city": "Rome"}')
    body = {"model": MODEL, "input": "Weather in Rome?", "tools": [WEATHER],
            "tool_choice": {"type": "function", "name": "get_weather"}}
    if stream:
        events = events_of(client, body)
        response = events[-1]["response"]
        arguments = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
        assert arguments == '{"city": "Rome"}'
        assert any(e["type"] == "response.function_call_arguments.done" for e in events)
    else:
        response = client.post("/v1/responses", json=body).json()
    (call,) = [item for item in response["output"] if item["type"] == "function_call"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Rome"}
    assert call["call_id"].startswith("call_") and call["id"].startswith("fc_")
    grammar = fake.requests[-1].params.grammar
    assert json.loads(grammar.source) == WEATHER["parameters"]
    fake.script = said(b'I will check. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    auto = oai(client).responses.create(model=MODEL, input="Weather in Oslo?", tools=[WEATHER], stream=False)
    assert [item.type for item in auto.output] == ["message", "function_call"]
    assert auto.output[0].content[0].text == "I will check." and auto.output[1].name == "get_weather"


def test_text_format_is_the_chat_s_response_format(client, fake):
    fake.script = said(b'{"a": 1}')
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    response = oai(client).responses.create(model=MODEL, input="JSON please", text={
        "format": {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}})
    assert json.loads(response.output_text) == {"a": 1} and response.text.format.type == "json_schema"
    grammar = fake.requests[-1].params.grammar
    assert grammar.kind == "json_schema" and json.loads(grammar.source) == schema
    oai(client).responses.create(model=MODEL, input="JSON please", text={"format": {"type": "json_object"}})
    assert fake.requests[-1].params.grammar.kind == "json_object"


# -- a reasoning model ------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_a_reasoning_model_gives_a_reasoning_item_and_its_text_s_own_logprobs(fake, monkeypatch, stream):
    fake.script = said(b"<think>Easy one.</think>Paris.")
    thought = len(b"<think>Easy one.</think>")
    body = {"model": MODEL, "input": "Capital?", "include": ["message.output_text.logprobs"], "top_logprobs": 1,
            "reasoning": {"effort": "low"}}
    counts = []  # (the search for the end tag, run once although the stream splits logprobs and counts usage)
    real = reasoning.reasoning_tokens
    monkeypatch.setattr(reasoning, "reasoning_tokens", lambda *args: counts.append(real(*args)) or counts[-1])
    with app_client(fake, monkeypatch, reasoning={}) as client:
        if stream:
            events = events_of(client, body)
            response = events[-1]["response"]
            kinds = [e["type"] for e in events]
            assert kinds.index("response.reasoning_text.delta") < kinds.index("response.output_text.delta")
            streamed = [lp for e in events if e["type"] == "response.output_text.delta" for lp in e["logprobs"]]
            (done,) = [e for e in events if e["type"] == "response.output_text.done"]
            # the deltas carry the text's tokens; the stop token, which has no text, only the whole text's
            assert streamed == done["logprobs"][:-1] and len(done["logprobs"]) == len(fake.script) - thought
        else:
            response = client.post("/v1/responses", json=body).json()
    thinking, message = response["output"]
    assert thinking["type"] == "reasoning"
    assert thinking["content"] == [{"type": "reasoning_text", "text": "Easy one."}]
    assert message["content"][0]["text"] == "Paris."
    assert len(message["content"][0]["logprobs"]) == len(fake.script) - thought  # (the stop token's own too)
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == thought and counts == [thought]
    assert response["reasoning"]["effort"] == "low"


def test_a_reasoning_item_sent_back_is_the_assistant_s_reasoning(fake, monkeypatch):
    fake.script = said(b"Fine.")
    items = [{"role": "user", "content": "Hi"},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Hm."}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
             {"role": "user", "content": "Bye"}]
    with app_client(fake, monkeypatch, reasoning={}) as client:
        assert oai(client).responses.create(model=MODEL, input=items).output_text == "Fine."
    from specserve.serve.responses_schema import ITEMS, messages

    assert messages(None, ITEMS.validate_python(items))[1] == {"role": "assistant", "content": "Hello.",
                                                               "reasoning": "Hm."}


# -- the store -------------------------------------------------------------------------------------
def test_previous_response_id_goes_on_from_the_stored_conversation(client, fake):
    fake.script = said(b"Oslo is cold.")
    first = oai(client).responses.create(model=MODEL, input="Tell me about Oslo.", instructions="Be terse.")
    assert first.store is True
    fake.script = said(b"Yes.")
    second = oai(client).responses.create(model=MODEL, input="Really?", previous_response_id=first.id)
    text = prompt_text(fake)
    assert text.index("Tell me about Oslo.") < text.index("Oslo is cold.") < text.index("Really?")
    assert "Be terse." not in text  # (instructions are not carried over, as OpenAI's are not)
    assert second.previous_response_id == first.id
    got = client.get(f"/v1/responses/{second.id}").json()
    assert got["output"] == second.model_dump()["output"] or got["id"] == second.id
    items = client.get(f"/v1/responses/{second.id}/input_items", params={"order": "asc"}).json()
    texts = [i.get("content") if isinstance(i.get("content"), str) else i["content"][0]["text"] for i in items["data"]]
    assert texts == ["Tell me about Oslo.", "Oslo is cold.", "Really?"] and not items["has_more"]
    assert all(i["id"] for i in items["data"])
    assert client.delete(f"/v1/responses/{first.id}").json() == {"id": first.id, "object": "response", "deleted": True}
    assert _error(client.get(f"/v1/responses/{first.id}"), 404)["param"] == "response_id"
    r = client.post("/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": first.id})
    assert _error(r, 400)["param"] == "previous_response_id"
    unstored = oai(client).responses.create(model=MODEL, input="x", store=False)
    assert unstored.store is False and client.get(f"/v1/responses/{unstored.id}").status_code == 404


def test_a_streamed_response_is_stored_too(client, fake):
    fake.script = said(b"Streamed.")
    events = events_of(client, {"model": MODEL, "input": "Go"})
    rid = events[-1]["response"]["id"]
    assert client.get(f"/v1/responses/{rid}").json()["output"] == events[-1]["response"]["output"]


def test_a_stored_response_is_found_only_with_the_key_that_made_it(fake, monkeypatch):
    fake.script = said(b"Mine.")
    with app_client(fake, monkeypatch, api_key=["key-a", "key-b"]) as client:
        a = {"authorization": "Bearer key-a"}
        b = {"authorization": "Bearer key-b"}
        rid = client.post("/v1/responses", json={"model": MODEL, "input": "x"}, headers=a).json()["id"]
        assert client.get(f"/v1/responses/{rid}", headers=a).status_code == 200
        for path in (f"/v1/responses/{rid}", f"/v1/responses/{rid}/input_items"):
            assert _error(client.get(path, headers=b), 404)["param"] == "response_id"
        assert client.delete(f"/v1/responses/{rid}", headers=b).status_code == 404
        later = {"model": MODEL, "input": "y", "previous_response_id": rid}
        assert _error(client.post("/v1/responses", json=later, headers=b), 400)["param"] == "previous_response_id"
        assert client.post("/v1/responses", json=later, headers=a).status_code == 200
        assert client.delete(f"/v1/responses/{rid}", headers=a).status_code == 200


def test_without_a_store(fake, monkeypatch):
    fake.script = said(b"Ok.")
    with app_client(fake, monkeypatch, responses={"store": False}) as client:
        response = oai(client).responses.create(model=MODEL, input="x")
        assert response.store is False and client.get(f"/v1/responses/{response.id}").status_code == 404
        r = client.post("/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": response.id})
        assert _error(r, 400)["param"] == "previous_response_id"


def test_the_store_keeps_the_most_recently_used_within_its_bounds():
    store = ResponseStore(max_stored=2, max_stored_bytes=1 << 16)
    store.put({"id": "other", "output": []}, [], owner=1)
    assert store.get("other") is None and not store.delete("other") and store.get("other", owner=1)
    for k in range(3):
        assert store.put({"id": f"r{k}", "output": []}, [{"role": "user", "content": str(k)}])
        if k == 1:
            store.get("r0")  # r0 now the most recently used: r1 goes next
    assert store.get("r1") is None and store.get("r0") is not None and len(store) == 2
    assert store.input_items("r2")[0]["id"].startswith("msg_")
    assert store.put({"id": "big", "output": [], "x": "y" * (1 << 16)}, []) == "too_large"
    small = ResponseStore(max_stored=100, max_stored_bytes=1 << 16)
    for k in range(40):
        small.put({"id": f"r{k}", "output": [], "pad": "z" * 4000}, [])
    assert 10 < len(small) < 17 and small.get("r39") is not None and small.get("r0") is None


def _turn(store, k: int, previous: str | None, pad: int = 1000, owner: int = -1) -> str:
    """Store turn k (its own input and output item, `pad` bytes each) after `previous`."""
    said_ = {"type": "message", "id": f"out{k}", "role": "assistant", "content": "a" * pad}
    store.put({"id": f"r{k}", "output": [said_]}, [{"role": "user", "content": "q" * pad}], owner, previous)
    return f"r{k}"


def test_a_conversation_costs_its_turns_once():
    store = ResponseStore(max_stored=1000, max_stored_bytes=1 << 20)
    previous = None
    for k in range(60):
        previous = _turn(store, k, previous)
    one = store._links["r0"].size
    assert store._bytes == sum(link.size for link in store._links.values()) < 60 * (one + 200)  # (not 60² / 2)
    items = store.conversation("r59")
    assert len(items) == 120 and [i["id"] for i in items[1::2]] == [f"out{k}" for k in range(60)]
    assert store.input_items("r59") == items[:-1]
    assert store.put({"id": "x", "output": []}, [], -1, "gone") == "no_previous"
    assert store.put({"id": "x", "output": []}, [], 7, "r59") == "no_previous"  # (another key's)
    assert "x" not in store._links


def test_a_link_that_went_stays_as_the_history_of_the_turns_after_it():
    store = ResponseStore(max_stored=1000, max_stored_bytes=1 << 20)
    for k, previous in enumerate([None, "r0", "r1", "r1"]):  # r2 and r3: two branches from r1
        _turn(store, k, previous)
    whole = store.conversation("r3")
    assert store.delete("r1") and store.get("r1") is None and store.conversation("r1") is None
    assert not store.delete("r1") and store.conversation("r3") == whole and len(store) == 3
    _turn(store, 4, "r1")  # (a turn in flight while r1 went: the ingress read r1 while it was there)
    assert store.input_items("r4") == whole[:4] + [json.loads(store._links["r4"].inputs)[0]]
    store.delete("r0")
    assert store.input_items("r3") == whole[:-1] and set(store._links) == {"r0", "r1", "r2", "r3", "r4"}
    for rid in ("r2", "r3", "r4"):
        store.delete(rid)
    assert store._links == {} and store._bytes == 0 and len(store) == 0


def test_dropping_the_least_recently_used_frees_whole_conversations():
    store = ResponseStore(max_stored=1000, max_stored_bytes=30_000)  # (a turn: ~2.1 kB)
    for k in range(60):  # 20 conversations of 3 turns, their turns interleaved two at a time
        conversation, turn = divmod(k, 6)[0] * 2 + k % 2, (k % 6) // 2
        previous = None if turn == 0 else f"c{conversation}t{turn - 1}"
        store.put({"id": f"c{conversation}t{turn}", "output": [{"content": "a" * 1000}]},
                  [{"content": "q" * 1000}], -1, previous)
        assert store._bytes <= 30_000
        assert all(link.shown or link.later for link in store._links.values())  # (nothing hidden for nothing)
    assert store.conversation("c19t2") is not None and store.conversation("c0t2") is None
    assert len(store.conversation("c19t2")) == 6 and len(store) < 15
    assert store.put({"id": "big", "output": []}, [{"content": "z" * 40_000}]) == "too_large"
    long = None  # a conversation whose turns together pass the bound: its last turns are not kept
    for k in range(20):
        done = store.put({"id": f"long{k}", "output": [{"content": "a" * 1000}]}, [{"content": "q" * 1000}],
                         -1, long)
        if done != "stored":
            break
        long = f"long{k}"
    assert done == "too_large" and 10 < k < 15 and len(store.conversation(long)) == 2 * k


def test_a_turn_whose_previous_response_went_meanwhile_is_kept_with_its_history():
    import asyncio

    from specserve.config import ResponsesConfig
    from specserve.serve.response_store import StoreClient

    client = StoreClient(None, ResponsesConfig())
    store = client._local
    _turn(store, 0, None)
    history = asyncio.run(client.history("r0", -1))
    assert store.delete("r0") and store._links == {}  # (gone while the next turn was generated)
    response = {"id": "r1", "previous_response_id": "r0", "output": [{"type": "message", "id": "m1"}]}
    assert asyncio.run(client.keep(response, history, [{"type": "message", "content": "next"}], -1))
    assert store.conversation("r1")[:2] == history and store._links["r1"].previous is None
    big = {**response, "id": "r2", "previous_response_id": "r1", "pad": "x" * (64 << 20)}
    assert not asyncio.run(client.keep(big, history, [], -1)) and "r2" not in store._links


def test_input_items_come_in_pages():
    items = [{"id": f"i{k}"} for k in range(5)]
    page = input_page(items, 2, "desc", None)
    assert [i["id"] for i in page["data"]] == ["i4", "i3"] and page["has_more"] and page["last_id"] == "i3"
    page = input_page(items, 2, "desc", "i3")
    assert [i["id"] for i in page["data"]] == ["i2", "i1"]
    assert input_page(items, 10, "asc", "i3") == {"object": "list", "data": [{"id": "i4"}], "first_id": "i4",
                                                   "last_id": "i4", "has_more": False}


def test_an_item_reference_is_the_stored_item_it_names(client, fake):
    fake.script = said(b"Paris.")
    first = oai(client).responses.create(model=MODEL, input=[{"role": "user", "content": "Capital?", "id": "msg_q"}])
    answer = first.output[0].id
    refs = [{"type": "item_reference", "id": "msg_q"}, {"type": "item_reference", "id": answer},
            {"role": "user", "content": "Sure?"}]
    second = client.post("/v1/responses", json={"model": MODEL, "input": refs})
    assert second.status_code == 200, second.text
    sent = prompt_text(fake)
    assert sent.index("Capital?") < sent.index("Paris.") < sent.index("Sure?")
    items = client.get(f"/v1/responses/{second.json()['id']}/input_items", params={"order": "asc"}).json()["data"]
    assert [i["id"] for i in items[:2]] == ["msg_q", answer] and items[1]["content"][0]["text"] == "Paris."
    for missing in ("msg_nope", answer):
        if missing == answer:  # (held by the second response's input too: it goes with both)
            client.delete(f"/v1/responses/{first.id}")
            again = {"model": MODEL, "input": refs[1:2], "store": False}
            assert client.post("/v1/responses", json=again).status_code == 200
            client.delete(f"/v1/responses/{second.json()['id']}")
        r = client.post("/v1/responses", json={"model": MODEL, "input": [{"type": "item_reference", "id": missing}]})
        assert _error(r, 400)["param"] == "input" and missing in r.json()["error"]["message"]
    store = ResponseStore(max_stored=10, max_stored_bytes=1 << 16)
    store.put({"id": "r0", "output": [{"type": "message", "id": "m0"}]}, [{"id": "i0", "content": "x"}], owner=3)
    assert store.items(["m0", "i0"], 3) == [{"type": "message", "id": "m0"}, {"id": "i0", "content": "x"}]
    assert store.items(["m0"], -1) == [None]  # (another key's)
    store.put({"id": "r1", "output": []}, [{"id": "m0", "type": "message"}], owner=3)  # (held by r1 too)
    assert store.delete("r1", 3) and store.items(["m0"], 3) == [{"type": "message", "id": "m0"}]  # (r0's)
    assert store.delete("r0", 3) and store.items(["m0"], 3) == [None] and store._index == {}


# -- truncation "auto" -------------------------------------------------------------------------------
def test_truncation_auto_drops_the_fewest_first_turns_that_let_it_fit(monkeypatch):
    fake = FakeCoordinator(max_model_len=600)  # (the byte tokenizer: a token a character)
    with app_client(fake, monkeypatch) as client:
        fake.script = said(b"A" * 40)
        base = {"model": MODEL, "instructions": "Be brief.", "max_output_tokens": 40}
        previous = None
        for k in range(8):  # 8 stored turns of ~100 tokens: the 9th does not fit 600 with all of them
            turn = {"role": "user", "content": f"question {k} " + "q" * 40}
            if k == 1:  # (a system message within the conversation stays when its turn goes)
                turn = [{"role": "system", "content": "SYSTEM"}, turn]
            r = client.post("/v1/responses", json={**base, "input": turn if isinstance(turn, list) else [turn],
                                                   "previous_response_id": previous, "truncation": "auto"})
            assert r.status_code == 200, r.text
            previous = r.json()["id"]
        body = {**base, "input": "last question", "previous_response_id": previous}
        r = client.post("/v1/responses", json=body)
        assert _error(r, 400)["code"] == "context_length_exceeded"  # (truncation "disabled": OpenAI's default)
        r = client.post("/v1/responses", json={**body, "truncation": "auto"})
        assert r.status_code == 200 and r.json()["truncation"] == "auto", r.text
        sent = prompt_text(fake)
        kept = [k for k in range(8) if f"question {k} " in sent]
        assert kept and kept == list(range(kept[0], 8)) and kept[0] > 1 and "last question" in sent
        assert "Be brief." in sent and "SYSTEM" in sent and len(fake.requests[-1].prompt_token_ids) + 40 <= 600
        # the fewest: with the turn before the first one kept, it would not fit
        turns = [m for k in range(kept[0] - 1, 8) for m in (
            {"role": "user", "content": f"question {k} " + "q" * 40}, {"role": "assistant", "content": "A" * 40})]
        longer = {**base, "input": [{"role": "system", "content": "SYSTEM"}, *turns, {"role": "user",
                                                                                   "content": "last question"}]}
        assert client.post("/v1/responses", json={**longer, "input": longer["input"][:1] + longer["input"][3:]}) \
            .status_code == 200  # (the kept turns alone: what truncation sent, and it fits)
        assert prompt_text(fake) == sent
        assert _error(client.post("/v1/responses", json=longer), 400)["code"] == "context_length_exceeded"
        huge = {**base, "input": "z" * 700, "truncation": "auto"}  # the latest turn alone: its own 400
        assert _error(client.post("/v1/responses", json=huge), 400)["code"] == "context_length_exceeded"


# -- background responses ------------------------------------------------------------------------------
ENDED = ("completed", "incomplete", "failed", "cancelled")


def eventually(check, timeout: float = 5.0):
    """check()'s first truthy answer, asked every 20 ms (its last answer once `timeout` passed)."""
    deadline = time.monotonic() + timeout
    while not (answer := check()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return answer


def read_until(client, rid: str, check, timeout: float = 10.0) -> dict:
    """GET the response until check(response) holds."""
    def read():
        r = client.get(f"/v1/responses/{rid}")
        assert r.status_code == 200, r.text
        return r.json() if check(r.json()) else None

    done = eventually(read, timeout)
    assert done is not None, client.get(f"/v1/responses/{rid}").json()
    return done


@pytest.fixture()
def quick_polls(monkeypatch):
    monkeypatch.setattr(response_store, "POLL_S", 0.02)


def test_a_background_response_is_stored_in_progress_then_finished(fake, monkeypatch, quick_polls):
    fake.script, fake.step_delay = said(b"Paris is the capital."), 0.01
    with app_client(fake, monkeypatch) as client:
        response = oai(client).responses.create(model=MODEL, input="Capital?", background=True)
        assert response.status == "in_progress" and response.background and response.output == []
        r = client.post("/v1/responses", json={"model": MODEL, "input": "And?", "previous_response_id": response.id})
        assert _error(r, 400)["param"] == "previous_response_id"  # (while it is in progress)
        done = read_until(client, response.id, lambda r: r["status"] in ENDED)
        assert done["status"] == "completed" and done["background"] is True and done["store"] is True
        assert done["output"][0]["content"][0]["text"] == "Paris is the capital."
        assert done["usage"]["output_tokens"] == len(fake.script)
        assert oai(client).responses.create(model=MODEL, input="Capital?").output_text == "Paris is the capital."
        later = oai(client).responses.create(model=MODEL, input="And?", previous_response_id=response.id)
        assert "Paris is the capital." in prompt_text(fake) and later.status == "completed"


def test_a_cancel_or_a_delete_stops_a_background_generation(fake, monkeypatch, quick_polls):
    fake.script, fake.step_delay = said(b"x" * 300), 0.05  # (100 deltas: 5 s)
    with app_client(fake, monkeypatch) as client:
        client_ = oai(client)
        first = client_.responses.create(model=MODEL, input="Long", background=True)
        r = client.post(f"/v1/responses/{first.id}/cancel")
        assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
        assert eventually(lambda: fake.streams[-1].cancelled, 3)  # the engine was told to stop
        assert client.post(f"/v1/responses/{first.id}/cancel").json()["status"] == "cancelled"  # (idempotent)
        time.sleep(0.2)
        assert client.get(f"/v1/responses/{first.id}").json()["status"] == "cancelled"  # (not overwritten)
        second = client_.responses.create(model=MODEL, input="Long", background=True)
        assert client.delete(f"/v1/responses/{second.id}").status_code == 200
        assert eventually(lambda: fake.streams[-1].cancelled, 3)
        assert client.get(f"/v1/responses/{second.id}").status_code == 404
        fake.step_delay = 0.0
        plain = client_.responses.create(model=MODEL, input="x")
        assert _error(client.post(f"/v1/responses/{plain.id}/cancel"), 400)["param"] == "response_id"
        assert _error(client.post("/v1/responses/resp_nope/cancel"), 404)


def test_a_background_response_counts_as_a_running_request_of_its_key(fake, monkeypatch, quick_polls):
    """front_door.per_key.max_concurrent_requests holds while a background response generates
    after its request returned, and frees the slot when it ends; a key at its limit still polls,
    cancels and deletes what it started (those routes start no work: no slot)."""
    fake.script, fake.step_delay = said(b"x" * 300), 0.05
    with app_client(fake, monkeypatch, api_key=["a-key"],
                    front_door={"per_key": {"max_concurrent_requests": 1}}) as client:
        key = {"authorization": "Bearer a-key"}
        body = {"model": MODEL, "input": "Long", "background": True}
        running = client.post("/v1/responses", json=body, headers=key)
        assert running.status_code == 200, running.text
        r = client.post("/v1/responses", json={**body, "background": False}, headers=key)
        assert _error(r, 429)["code"] == "concurrency_limit_exceeded"
        rid = running.json()["id"]
        assert client.get(f"/v1/responses/{rid}", headers=key).json()["status"] == "in_progress"
        assert client.get(f"/v1/responses/{rid}/input_items", headers=key).status_code == 200
        assert client.get("/v1/models", headers=key).status_code == 200
        cancelled = client.post(f"/v1/responses/{rid}/cancel", headers=key)
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"

        def free() -> bool:  # (the task stops at its next poll, and gives its slot up)
            r = client.post("/v1/responses", json={**body, "background": False, "max_output_tokens": 4}, headers=key)
            return r.status_code == 200

        assert eventually(free)
        again = client.post("/v1/responses", json=body, headers=key).json()["id"]
        fake.step_delay = 0.0  # (the rest at once: the task ends, and with it its hold on the slot)
        assert eventually(lambda: client.get(f"/v1/responses/{again}", headers=key).json()["status"] == "completed")
        assert client.delete(f"/v1/responses/{again}", headers=key).status_code == 200


def test_a_background_response_whose_engine_failed_reads_failed(fake, monkeypatch, quick_polls):
    fake.mode = "lost"  # (every continuation lost too)
    with app_client(fake, monkeypatch) as client:
        rid = oai(client).responses.create(model=MODEL, input="x" * 40, max_output_tokens=30, background=True).id
        done = read_until(client, rid, lambda r: r["status"] in ENDED)
        assert done["status"] == "failed" and done["error"]["code"] == "engine_unavailable"


def test_a_background_response_ends_once_and_reads_failed_when_its_ingress_was_lost(monkeypatch):
    store = ResponseStore(max_stored=10, max_stored_bytes=1 << 16)
    running = {"id": "r0", "status": "in_progress", "background": True, "output": []}
    assert store.put(running, []) == "stored" and store.poll("r0") and store.get("r0")["status"] == "in_progress"
    assert store.put({**running, "id": "r1"}, []) == "stored" and store.cancel("r1")["status"] == "cancelled"
    assert not store.poll("r1") and not store.finish({**running, "id": "r1", "status": "completed"})
    assert store.get("r1")["status"] == "cancelled" and store.conversation("r1") == []
    assert store.put({**running, "id": "r2"}, []) == "stored" and store.conversation("r2") is None
    assert store.finish({**running, "id": "r2", "status": "completed"}) and store.get("r2")["status"] == "completed"
    monkeypatch.setattr(response_store, "LEASE_S", 0.0)
    time.sleep(0.01)
    assert store.get("r0")["status"] == "failed" and "lost" in store.get("r0")["error"]["message"]
    assert not store.poll("r0") and not store.finish({**running, "status": "completed"})
    assert store.cancel("r0")["status"] == "failed"  # (an ended response, as it is)


def test_a_background_response_without_the_store_is_a_400(client):
    r = client.post("/v1/responses", json={"model": MODEL, "input": "x", "background": True, "store": False})
    assert _error(r, 400)["param"] == "background"


def test_without_a_store_there_are_no_background_responses(fake, monkeypatch):
    with app_client(fake, monkeypatch, responses={"store": False}) as client:
        r = client.post("/v1/responses", json={"model": MODEL, "input": "x", "background": True})
        assert _error(r, 400)["param"] == "background" and not fake.requests


# -- refusals and failures ----------------------------------------------------------------------------
@pytest.mark.parametrize("extra,param", [
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input"),
    ({"include": ["everything"]}, "include"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"conversation": "conv_1", "previous_response_id": "resp_1"}, "conversation"),
    ({"temperature": 3}, "temperature"),
    ({"max_output_tokens": 100000}, "max_output_tokens"),
    ({"tool_choice": "required"}, "tool_choice"),  # (no tools)
    ({"input": [{"role": "wizard", "content": "x"}]}, "input"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input"),  # (no call_id)
    ({"model": "gpt-9"}, "model"),
])
def test_what_cannot_be_served_is_a_4xx_naming_it(client, extra, param):
    r = client.post("/v1/responses", json={"model": MODEL, "input": "x", **extra})
    err = _error(r, 404 if param == "model" else 400)
    assert err["param"] == param, err


def test_an_engine_lost_mid_stream_fails_the_response(fake, monkeypatch):
    fake.mode, fake.lost_after = "lost", 1
    with app_client(fake, monkeypatch, max_resumes=0) as client:
        events = events_of(client, {"model": MODEL, "input": "Hello there", "max_output_tokens": 50})
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["status"] == "failed" and events[-1]["response"]["error"]["message"]
    fake.mode = "ok"
