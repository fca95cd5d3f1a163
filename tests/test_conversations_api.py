"""The Conversations API (`/v1/conversations`) in process, read back with the openai client: a
conversation's and its items' create, read, update, delete and pages, per API key; a response
with `conversation` going on from its items and adding its own (whole, streamed, background);
the store's bounds and every refusal."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from specserve.serve import response_store
from specserve.serve.conversation_store import NO_CONVERSATION, TOO_LARGE, ConversationStore
from test_reasoning import said
from test_responses_api import ENDED, app_client, events_of, eventually, oai, prompt_text, read_until
from test_serve_api import MODEL, FakeCoordinator, _error


@pytest.fixture()
def fake():
    return FakeCoordinator(max_model_len=4096)


@pytest.fixture()
def client(fake, monkeypatch):
    with app_client(fake, monkeypatch) as c:
        yield c


@pytest.fixture()
def quick_polls(monkeypatch):
    monkeypatch.setattr(response_store, "POLL_S", 0.02)


def texts(items) -> list[str]:
    """Each item's first text (a message's, by its content parts)."""
    return [item["content"][0]["text"] for item in items]


def listed(client, cid: str, **params) -> list[dict]:
    r = client.get(f"/v1/conversations/{cid}/items", params=params)
    assert r.status_code == 200, r.text
    return r.json()["data"]


# -- conversations and their items ---------------------------------------------------------------------
def test_a_conversation_is_created_read_updated_and_deleted(client):
    conversations = oai(client).conversations
    made = conversations.create(items=[{"type": "message", "role": "user", "content": "Hello"}],
                                metadata={"topic": "greeting"})
    assert made.id.startswith("conv_") and made.object == "conversation" and made.created_at > 0
    assert made.metadata == {"topic": "greeting"}
    got = conversations.retrieve(made.id)
    assert got.id == made.id and got.metadata == {"topic": "greeting"} and got.created_at == made.created_at
    updated = conversations.update(made.id, metadata={"topic": "weather"})
    assert updated.metadata == {"topic": "weather"} and conversations.retrieve(made.id).metadata == {"topic": "weather"}
    assert _error(client.post(f"/v1/conversations/{made.id}", json={}), 400)["param"] == "metadata"  # (required)
    deleted = conversations.delete(made.id)
    assert deleted.id == made.id and deleted.deleted is True and deleted.object == "conversation.deleted"
    for r in (client.get(f"/v1/conversations/{made.id}"), client.delete(f"/v1/conversations/{made.id}"),
              client.get(f"/v1/conversations/{made.id}/items")):
        assert _error(r, 404)["param"] == "conversation_id"
    empty = conversations.create()
    assert empty.metadata == {} and listed(client, empty.id) == []


def test_items_are_added_listed_read_and_deleted(client):
    items = oai(client).conversations.items
    cid = oai(client).conversations.create(items=[{"role": "user", "content": "first"}]).id
    added = items.create(cid, items=[
        {"type": "message", "role": "assistant", "content": "second"},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "ok"}])
    assert [i.type for i in added.data] == ["message", "function_call", "function_call_output"]
    ids = [i.id for i in added.data]
    assert ids[0].startswith("msg_") and ids[1].startswith("fc_") and ids[2].startswith("fco_")
    assert added.first_id == ids[0] and added.last_id == ids[2] and added.has_more is False
    message = added.data[0]  # (as OpenAI gives them back: text as content parts, and a status)
    assert message.status == "completed" and message.content[0].type == "output_text"
    assert message.content[0].text == "second"
    everything = listed(client, cid, order="asc")
    assert [i["type"] for i in everything] == ["message", "message", "function_call", "function_call_output"]
    assert everything[0]["content"] == [{"type": "input_text", "text": "first"}] and everything[1:] == \
        [i.model_dump(exclude_none=True) for i in added.data][:1] + everything[2:]
    assert [i["id"] for i in listed(client, cid)] == [i["id"] for i in everything][::-1]  # (desc: the default)
    assert items.retrieve(ids[1], conversation_id=cid).name == "f"
    left = items.delete(ids[1], conversation_id=cid)
    assert left.id == cid and left.object == "conversation"
    assert _error(client.get(f"/v1/conversations/{cid}/items/{ids[1]}"), 404)["param"] == "item_id"
    assert _error(client.delete(f"/v1/conversations/{cid}/items/{ids[1]}"), 404)["param"] == "item_id"
    assert [i["id"] for i in listed(client, cid, order="asc")] == [everything[0]["id"], ids[0], ids[2]]


def test_items_come_in_pages(client):
    cid = client.post("/v1/conversations", json={"items": [{"role": "user", "content": str(k)} for k in range(5)]}
                      ).json()["id"]
    page = client.get(f"/v1/conversations/{cid}/items", params={"limit": 2, "order": "asc"}).json()
    assert texts(page["data"]) == ["0", "1"] and page["has_more"] and page["object"] == "list"
    rest = client.get(f"/v1/conversations/{cid}/items", params={"limit": 2, "order": "asc",
                                                                "after": page["last_id"]}).json()
    assert texts(rest["data"]) == ["2", "3"] and rest["has_more"] and rest["first_id"] == rest["data"][0]["id"]
    last = client.get(f"/v1/conversations/{cid}/items", params={"limit": 2, "order": "asc",
                                                                "after": rest["last_id"]}).json()
    assert texts(last["data"]) == ["4"] and not last["has_more"]
    assert texts(client.get(f"/v1/conversations/{cid}/items", params={"limit": 2}).json()["data"]) == ["4", "3"]
    walked = [i.content[0].text for i in oai(client).conversations.items.list(cid, limit=2, order="asc")]
    assert walked == ["0", "1", "2", "3", "4"]  # (the client's auto-paging follows `after`)
    r = client.get(f"/v1/conversations/{cid}/items", params={"after": "msg_nope"})
    assert _error(r, 400)["param"] == "after"
    for limit in (0, 101):
        assert _error(client.get(f"/v1/conversations/{cid}/items", params={"limit": limit}), 400)["param"] == "limit"


def test_a_conversation_is_found_only_with_the_key_that_made_it(fake, monkeypatch):
    with app_client(fake, monkeypatch, api_key=["key-a", "key-b"]) as client:
        a, b = {"authorization": "Bearer key-a"}, {"authorization": "Bearer key-b"}
        cid = client.post("/v1/conversations", json={"items": [{"role": "user", "content": "x"}]},
                          headers=a).json()["id"]
        item = client.get(f"/v1/conversations/{cid}/items", headers=a).json()["data"][0]["id"]
        for method, path, body in (("GET", "", None), ("POST", "", {"metadata": {}}), ("GET", "/items", None),
                                   ("POST", "/items", {"items": [{"role": "user", "content": "y"}]}),
                                   ("GET", f"/items/{item}", None), ("DELETE", f"/items/{item}", None),
                                   ("DELETE", "", None)):
            r = client.request(method, f"/v1/conversations/{cid}{path}", json=body, headers=b)
            assert _error(r, 404)["param"] == "conversation_id", (method, path)
        r = client.post("/v1/responses", json={"model": MODEL, "input": "y", "conversation": cid}, headers=b)
        assert _error(r, 404)["param"] == "conversation"
        assert len(client.get(f"/v1/conversations/{cid}/items", headers=a).json()["data"]) == 1
        assert client.delete(f"/v1/conversations/{cid}", headers=a).status_code == 200


# -- responses in a conversation ----------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_a_response_goes_on_from_its_conversation_and_adds_its_items(client, fake, stream):
    api = oai(client)
    cid = api.conversations.create(items=[{"role": "user", "content": "Tell me about Oslo."},
                                          {"role": "assistant", "content": "Oslo is cold."}]).id
    fake.script = said(b"Yes, very.")
    body = {"model": MODEL, "input": "Really?", "conversation": cid}
    if stream:
        events = events_of(client, body)
        assert events[0]["response"]["conversation"] == {"id": cid}
        response = events[-1]["response"]
    else:
        response = api.responses.create(**{**body, "conversation": {"id": cid}}).model_dump()
    assert response["conversation"] == {"id": cid} and response["status"] == "completed"
    text = prompt_text(fake)
    assert text.index("Tell me about Oslo.") < text.index("Oslo is cold.") < text.index("Really?")
    items = listed(client, cid, order="asc")
    assert texts(items) == ["Tell me about Oslo.", "Oslo is cold.", "Really?", "Yes, very."]
    assert items[-1]["id"] == response["output"][0]["id"] and items[2]["role"] == "user"
    stored = client.get(f"/v1/responses/{response['id']}/input_items").json()["data"]
    assert stored[0]["id"] == items[2]["id"]  # (one id for the input, in the response and the conversation)
    fake.script = said(b"Third.")
    api.responses.create(model=MODEL, input="And?", conversation=cid)
    assert "Yes, very." in prompt_text(fake) and texts(listed(client, cid, order="asc"))[-2:] == ["And?", "Third."]
    plain = api.responses.create(model=MODEL, input="x")
    assert "conversation" not in plain.model_dump(exclude_none=True)


def test_a_response_cut_short_adds_what_it_gave_and_a_failed_one_nothing(fake, monkeypatch):
    with app_client(fake, monkeypatch, max_resumes=0) as client:
        cid = client.post("/v1/conversations", json={}).json()["id"]
        fake.script = said(b"A long answer that goes on")
        r = client.post("/v1/responses", json={"model": MODEL, "input": "Talk", "max_output_tokens": 6,
                                               "conversation": cid})
        assert r.json()["status"] == "incomplete"
        items = listed(client, cid, order="asc")
        assert texts(items) == ["Talk", "A long"] and items[-1]["status"] == "incomplete"
        fake.mode, fake.lost_after = "lost", 1
        events = events_of(client, {"model": MODEL, "input": "Hello there", "max_output_tokens": 50,
                                    "conversation": cid})
        assert events[-1]["type"] == "response.failed" and len(listed(client, cid)) == 2


def test_an_item_reference_finds_the_conversation_s_item(client, fake):
    cid = client.post("/v1/conversations", json={"items": [{"role": "user", "content": "Remember PLUM."}]}).json()["id"]
    item = listed(client, cid)[0]["id"]
    fake.script = said(b"Ok.")
    r = client.post("/v1/responses", json={"model": MODEL, "conversation": cid,
                                           "input": [{"type": "item_reference", "id": item}]})
    assert r.status_code == 200, r.text
    assert prompt_text(fake).count("Remember PLUM.") == 2
    added = listed(client, cid, order="asc")
    assert len(added) == 3 and len({i["id"] for i in added}) == 3  # (the repeated item under an id of its own)


def test_a_background_response_adds_its_items_when_it_ends(fake, monkeypatch, quick_polls):
    fake.script, fake.step_delay = said(b"Paris is the capital."), 0.01
    with app_client(fake, monkeypatch) as client:
        cid = client.post("/v1/conversations", json={"items": [{"role": "user", "content": "Hi"}]}).json()["id"]
        response = oai(client).responses.create(model=MODEL, input="Capital?", background=True, conversation=cid)
        assert response.status == "in_progress" and response.conversation.id == cid
        done = read_until(client, response.id, lambda r: r["status"] in ENDED)
        assert done["status"] == "completed" and done["conversation"] == {"id": cid}
        assert texts(listed(client, cid, order="asc")) == ["Hi", "Capital?", "Paris is the capital."]
        fake.script, fake.step_delay = said(b"x" * 300), 0.05
        cancelled = oai(client).responses.create(model=MODEL, input="Long", background=True, conversation=cid)
        assert client.post(f"/v1/responses/{cancelled.id}/cancel").json()["status"] == "cancelled"
        read_until(client, cancelled.id, lambda r: r["status"] == "cancelled")
        assert len(listed(client, cid)) == 3
        fake.script, fake.step_delay = said(b"Lyon is not."), 0.01
        with client.stream("POST", "/v1/responses", json={"model": MODEL, "input": "Lyon?", "background": True,
                                                         "stream": True, "conversation": cid}) as r:
            assert r.status_code == 200 and "response.completed" in r.read().decode()
        assert eventually(lambda: len(listed(client, cid)) == 5)  # (a streamed one too, once stored)
        assert texts(listed(client, cid, order="asc"))[3:] == ["Lyon?", "Lyon is not."]


def test_a_count_of_input_tokens_goes_on_from_the_conversation(client, fake):
    cid = client.post("/v1/conversations", json={"items": [{"role": "user", "content": "Hi " * 20}]}).json()["id"]
    counted = oai(client).responses.input_tokens.count(input="Capital?", conversation=cid)
    oai(client).responses.create(model=MODEL, input="Capital?", conversation=cid, max_output_tokens=4)
    assert counted.input_tokens == len(fake.requests[-1].prompt_token_ids) > 60
    assert len(listed(client, cid)) == 3  # (the count added nothing; the response its two)
    r = client.post("/v1/responses/input_tokens", json={"input": "x", "conversation": "conv_nope"})
    assert _error(r, 404)["param"] == "conversation"


def test_truncation_auto_drops_a_long_conversation_s_first_turns(monkeypatch):
    fake = FakeCoordinator(max_model_len=600)  # (the byte tokenizer: a token a character)
    with app_client(fake, monkeypatch) as client:
        turns = [m for k in range(10) for m in ({"role": "user", "content": f"question {k} " + "q" * 40},
                                                {"role": "assistant", "content": "A" * 40})]
        cid = client.post("/v1/conversations", json={"items": turns[:20]}).json()["id"]
        fake.script = said(b"A" * 40)
        body = {"model": MODEL, "input": "last question", "conversation": cid, "max_output_tokens": 40}
        assert _error(client.post("/v1/responses", json=body), 400)["code"] == "context_length_exceeded"
        assert len(listed(client, cid, limit=100)) == 20  # (a refused request adds nothing)
        r = client.post("/v1/responses", json={**body, "truncation": "auto"})
        assert r.status_code == 200, r.text
        sent = prompt_text(fake)
        kept = [k for k in range(10) if f"question {k} " in sent]
        assert kept and kept == list(range(kept[0], 10)) and kept[0] > 0 and "last question" in sent
        assert len(fake.requests[-1].prompt_token_ids) + 40 <= 600
        assert len(listed(client, cid, limit=100)) == 22  # (the conversation itself keeps every item)


# -- refusals ------------------------------------------------------------------------------------------
def test_what_a_conversation_cannot_be_is_a_4xx_naming_it(client):
    cid = client.post("/v1/conversations", json={}).json()["id"]
    many = [{"role": "user", "content": str(k)} for k in range(21)]
    assert _error(client.post("/v1/conversations", json={"items": many}), 400)["param"] == "items"
    assert _error(client.post(f"/v1/conversations/{cid}/items", json={"items": many}), 400)["param"] == "items"
    assert _error(client.post(f"/v1/conversations/{cid}/items", json={"items": []}), 400)["param"] == "items"
    assert client.post(f"/v1/conversations/{cid}/items", json={"items": many[:20]}).status_code == 200
    image = [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]
    assert _error(client.post(f"/v1/conversations/{cid}/items", json={"items": image}), 400)["param"] == "items"
    metadata = {f"k{i}": "v" for i in range(17)}
    assert _error(client.post("/v1/conversations", json={"metadata": metadata}), 400)["param"] == "metadata"
    assert _error(client.post(f"/v1/conversations/{cid}", json={"metadata": metadata}), 400)["param"] == "metadata"
    unknown = {"items": [{"type": "item_reference", "id": "msg_nope"}]}
    assert _error(client.post(f"/v1/conversations/{cid}/items", json=unknown), 400)["param"] == "input"
    assert len(listed(client, cid, limit=100)) == 20


def test_items_that_would_put_a_conversation_over_the_byte_bound_are_a_400(fake, monkeypatch):
    with app_client(fake, monkeypatch, responses={"max_conversation_bytes": 1 << 16}) as client:
        big = [{"role": "user", "content": "x" * 4000} for _ in range(10)]  # (~40 KB)
        cid = client.post("/v1/conversations", json={"items": big}).json()["id"]
        r = client.post(f"/v1/conversations/{cid}/items", json={"items": big})
        assert _error(r, 400)["code"] == "conversation_too_large" and r.json()["error"]["param"] == "items"
        assert len(listed(client, cid, limit=100)) == 10  # (nothing added)
        r = client.post("/v1/conversations", json={"items": big + big})
        assert _error(r, 400)["code"] == "conversation_too_large"
        assert client.post(f"/v1/conversations/{cid}/items", json={"items": big[:2]}).status_code == 200


def test_a_response_s_conversation_must_be_there_and_alone(client, fake):
    fake.script = said(b"Ok.")
    r = client.post("/v1/responses", json={"model": MODEL, "input": "x", "conversation": "conv_nope"})
    assert _error(r, 404)["param"] == "conversation" and not fake.requests
    first = client.post("/v1/responses", json={"model": MODEL, "input": "x"}).json()["id"]
    cid = client.post("/v1/conversations", json={}).json()["id"]
    r = client.post("/v1/responses", json={"model": MODEL, "input": "x", "conversation": cid,
                                           "previous_response_id": first})
    assert _error(r, 400)["param"] == "conversation" and len(fake.requests) == 1
    r = client.post("/v1/responses", json={"model": MODEL, "input": "x", "conversation": {"name": cid}})
    assert _error(r, 400)["param"] == "conversation"


def test_without_a_store_there_are_no_conversations(fake, monkeypatch):
    with app_client(fake, monkeypatch, responses={"store": False}) as client:
        for method, path, body in (("POST", "/v1/conversations", {}), ("GET", "/v1/conversations/conv_1", None),
                                   ("POST", "/v1/conversations/conv_1/items",
                                    {"items": [{"role": "user", "content": "x"}]}),
                                   ("GET", "/v1/conversations/conv_1/items", None)):
            r = client.request(method, path, json=body)
            assert _error(r, 400)["param"] == "conversation_id" and "responses.store" in r.json()["error"]["message"]
        r = client.post("/v1/responses", json={"model": MODEL, "input": "x", "conversation": "conv_1"})
        assert _error(r, 400)["param"] == "conversation" and not fake.requests


# -- the store's bounds ---------------------------------------------------------------------------------
def _message(text: str) -> dict:
    return {"role": "user", "content": text}


def test_the_least_recently_used_conversation_goes_first_by_count():
    store = ConversationStore(max_conversations=2, max_bytes=1 << 16)
    a = store.create([_message("a")], {})["id"]
    b = store.create([_message("b")], {})["id"]
    assert store.get(a)["id"] == a  # (a is now the most recently used)
    c = store.create([], {})["id"]
    assert store.get(b) == NO_CONVERSATION and store.get(a)["id"] == a and store.get(c)["id"] == c
    assert len(store) == 2 and store.get(a, owner=3) == NO_CONVERSATION  # (another key's: not there)


def test_the_least_recently_used_conversation_goes_first_by_bytes():
    store = ConversationStore(max_conversations=100, max_bytes=1 << 16)
    big = "x" * 20000
    first, second, third = (store.create([_message(big)], {})["id"] for _ in range(3))
    assert store.items(first) != NO_CONVERSATION  # (first: the most recently used)
    fourth = store.create([_message(big)], {})["id"]
    assert store.items(second) == NO_CONVERSATION and len(store) == 3 and store._bytes <= 1 << 16
    assert all(store.get(c) != NO_CONVERSATION for c in (first, third, fourth))
    assert store.append(first, [_message("x" * (1 << 16))]) == TOO_LARGE  # (over the bound alone: nothing added)
    assert len(store.items(first)) == 1 and len(store) == 3
    assert store.create([_message("y" * (1 << 16))], {}) == TOO_LARGE and len(store) == 3
    assert store.delete(first) and not store.delete(first) and store._bytes == sum(
        c.size for c in store._conversations.values())


def test_adding_items_encodes_only_the_new_ones(monkeypatch):
    from specserve.serve import conversation_store

    store = ConversationStore(max_conversations=10, max_bytes=1 << 24)
    cid = store.create([_message(str(k)) for k in range(20)], {})["id"]
    encoded = []
    counting = SimpleNamespace(loads=json.loads, dumps=lambda value: encoded.append(value) or json.dumps(value))
    monkeypatch.setattr(conversation_store, "json", counting)
    added = store.append(cid, [_message("new"), _message("newer")])
    assert [i["content"][0]["text"] for i in added] == ["new", "newer"] and len(encoded) == 2
    size = store._conversations[cid].size
    assert store.delete_item(cid, added[0]["id"])["id"] == cid and store._conversations[cid].size < size
    assert store.item(cid, added[0]["id"]) == "no_item" and store.item(cid, added[1]["id"])["id"] == added[1]["id"]


def test_a_store_deployment_that_cannot_be_reached_is_a_503():
    import asyncio

    from specserve.config import ResponsesConfig
    from specserve.serve.conversation_store import ConversationClient
    from specserve.serve.front_door import OpenAIError
    from specserve.serve.response_store import StoreClient

    class Lost:  # (a handle whose replica is gone: every call raises)
        def __getattr__(self, method):
            return SimpleNamespace(remote=lambda *args: (_ for _ in ()).throw(RuntimeError("actor died")))

    for client, method in ((StoreClient(Lost(), ResponsesConfig()), "get"),
                           (ConversationClient(Lost(), ResponsesConfig()), "get")):
        with pytest.raises(OpenAIError) as err:
            asyncio.run(client.call(method, "x", -1))
        assert err.value.status == 503 and err.value.code == "store_unavailable"
        assert err.value.headers == {"Retry-After": "1"}


def test_a_read_that_meets_a_lost_store_replica_waits_for_the_new_one_and_a_change_does_not(monkeypatch):
    """While Serve replaces a store replica, a read (safe to ask twice) is asked again until the
    new one answers, within STORE_RETRY_S; a change is a 503 at once (the lost replica may have
    made it); a read still unanswered at the bound is a 503 too."""
    import asyncio

    from ray.exceptions import ActorDiedError

    from specserve.config import ResponsesConfig
    from specserve.serve import response_store
    from specserve.serve.conversation_store import ConversationClient
    from specserve.serve.front_door import OpenAIError
    from specserve.serve.response_store import StoreClient

    monkeypatch.setattr(response_store, "STORE_RETRY_POLL_S", 0.01)

    class Replaced:  # (the first `lost` calls meet the lost replica, the rest the new one)
        def __init__(self, lost: int):
            self.lost, self.calls = lost, []

        def __getattr__(self, method):
            async def remote(*args):
                self.calls.append(method)
                if len(self.calls) <= self.lost:
                    raise ActorDiedError()
                return {"asked": method}
            return SimpleNamespace(remote=remote)

    for client, read, change in ((StoreClient, "conversation", "put"), (ConversationClient, "items", "append")):
        handle = Replaced(lost=3)
        assert asyncio.run(client(handle, ResponsesConfig()).call(read, "x", -1)) == {"asked": read}
        assert handle.calls == [read] * 4
        handle = Replaced(lost=1)
        with pytest.raises(OpenAIError) as err:
            asyncio.run(client(handle, ResponsesConfig()).call(change, "x", -1))
        assert err.value.status == 503 and handle.calls == [change]
    monkeypatch.setattr(response_store, "STORE_RETRY_S", 0.05)
    handle = Replaced(lost=10 ** 6)
    with pytest.raises(OpenAIError) as err:
        asyncio.run(StoreClient(handle, ResponsesConfig()).call("get", "x", -1))
    assert err.value.status == 503 and "ActorDiedError" in err.value.message and 2 <= len(handle.calls) < 100
