"""Streamed background responses (`background` and `stream` both true) in process: the request's
answer is the event stream, the events are kept in the store, and `GET /v1/responses/{id}?stream=true
&starting_after=n` gives every event after the n-th and follows the rest, through the replica that
generates (its own events, as they come) or another one (the store's, asked every FOLLOW_S). A client
that goes away stops nothing; a cancel ends every follower's stream; a lost replica's response ends
in response.failed."""
from __future__ import annotations

import json
import time

import pytest
from ray import serve

from specserve.serve import background, response_store
from specserve.serve.response_store import ResponseStore
from test_reasoning import said
from test_responses_api import ENDED, eventually, oai, read_until
from test_serve_api import MODEL, FakeCoordinator, _error, _server

BODY = {"model": MODEL, "input": "Tell me", "background": True, "stream": True}


@pytest.fixture()
def fake():
    return FakeCoordinator(max_model_len=4096)


@pytest.fixture()
def quick_follow(monkeypatch):
    monkeypatch.setattr(response_store, "POLL_S", 0.02)
    monkeypatch.setattr(background, "FOLLOW_S", 0.02)
    monkeypatch.setattr(background, "FLUSH_S", 0.02)


def replicas(fake, monkeypatch, n: int = 2, **config):
    """n ingress replicas' servers on one store and one engine, and a client whose requests go to
    `route[0]` (set it to pick the replica)."""
    from starlette.testclient import TestClient

    from specserve.serve.openai_api import app

    servers = [_server(fake, monkeypatch, **config) for _ in range(n)]
    for server in servers[1:]:
        server._store._local = servers[0]._store._local  # (the app's one store deployment)
    context = type(serve.get_replica_context())
    route = [servers[0]]
    monkeypatch.setattr(context, "servable_object", property(lambda self: route[0]))
    return servers, route, TestClient(app, raise_server_exceptions=False)


def read_events(r) -> list[dict]:
    lines = list(r.iter_lines())
    kinds = [line[7:] for line in lines if line.startswith("event: ")]
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert kinds == [e["type"] for e in events]
    return events


def get_events(client, rid: str, after: int | None = None) -> list[dict]:
    query = "" if after is None else f"&starting_after={after}"
    with client.stream("GET", f"/v1/responses/{rid}?stream=true{query}") as r:
        assert r.status_code == 200, r.read()
        return read_events(r)


def text_of(events: list[dict]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


def test_a_streamed_background_response_is_streamed_kept_and_streamed_again(fake, monkeypatch, quick_follow):
    fake.script, fake.step_delay = said(b"Paris is the capital of France."), 0.005
    servers, route, client = replicas(fake, monkeypatch)
    with client:
        with client.stream("POST", "/v1/responses", json=BODY) as r:
            assert r.status_code == 200, r.read()
            live = read_events(r)
        assert [e["sequence_number"] for e in live] == list(range(len(live)))
        assert live[0]["type"] == "response.created" and live[0]["response"]["background"] is True
        assert live[-1]["type"] == "response.completed" and text_of(live) == "Paris is the capital of France."
        rid = live[0]["response"]["id"]
        done = read_until(client, rid, lambda r: r["status"] in ENDED)
        assert done["output"] == live[-1]["response"]["output"] and done["store"] is True
        for replica in servers:  # (ended: both read the store)
            route[0] = replica
            assert get_events(client, rid) == live
            assert get_events(client, rid, 5) == live[6:]
            assert get_events(client, rid, len(live) - 1) == []
        typed = list(oai(client).responses.retrieve(rid, stream=True, starting_after=2))
        assert [e.sequence_number for e in typed] == list(range(3, len(live)))
        assert typed[-1].response.output_text == "Paris is the capital of France."


def test_a_follower_anywhere_gets_every_event_while_it_generates(fake, monkeypatch, quick_follow):
    """A client that goes away mid-stream stops nothing; it takes the stream up again, from the last
    event it saw, through the replica that generates and through another, while the rest comes."""
    fake.script, fake.step_delay = said(b"y" * 60), 0.02  # (60 deltas: about 1.2 s)
    servers, route, client = replicas(fake, monkeypatch)
    with client:
        seen = []
        with client.stream("POST", "/v1/responses", json=BODY) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    seen.append(json.loads(line[6:]))
                if len(seen) == 8:
                    break  # (the client goes away)
        rid = seen[0]["response"]["id"]
        assert not fake.streams[-1].cancelled
        rest = {}
        for replica in servers[::-1]:  # (the other one first, while it generates)
            route[0] = replica
            rest[replica] = get_events(client, rid, seen[-1]["sequence_number"])
            assert rest[replica][-1]["type"] == "response.completed"
        assert rest[servers[0]] == rest[servers[1]]
        whole = seen + rest[servers[0]]
        assert [e["sequence_number"] for e in whole] == list(range(len(whole))) and text_of(whole) == "y" * 60
        assert read_until(client, rid, lambda r: r["status"] in ENDED)["status"] == "completed"


def test_a_cancel_ends_every_follower_s_stream(fake, monkeypatch, quick_follow):
    fake.script, fake.step_delay = said(b"z" * 300), 0.05  # (5 s unless cancelled)
    servers, route, client = replicas(fake, monkeypatch)
    with client:
        import openai

        rid = client.post("/v1/responses", json={**BODY, "stream": False}).json()["id"]
        with pytest.raises(openai.BadRequestError):  # (a stream created without `stream` cannot be followed)
            oai(client).responses.retrieve(rid, stream=True)
        assert client.post(f"/v1/responses/{rid}/cancel").status_code == 200
        response = oai(client).responses.create(model=MODEL, input="Tell me", background=True, stream=True)
        first = next(iter(response))
        rid = first.response.id
        route[0] = servers[1]
        started = time.monotonic()
        assert client.post(f"/v1/responses/{rid}/cancel").json()["status"] == "cancelled"
        for replica in servers:
            route[0] = replica
            events = get_events(client, rid)
            assert events[0]["type"] == "response.created"
            assert not any(e["type"] in ("response.completed", "response.failed") for e in events)
        assert time.monotonic() - started < 3 and eventually(lambda: fake.streams[-1].cancelled, 3)
        response.close()


def test_what_cannot_be_streamed_again(fake, monkeypatch, quick_follow):
    fake.script = said(b"ok")
    _, _, client = replicas(fake, monkeypatch, n=1)
    with client:
        plain = oai(client).responses.create(model=MODEL, input="x")
        r = client.get(f"/v1/responses/{plain.id}?stream=true")
        assert _error(r, 400)["param"] == "stream"
        rid = client.post("/v1/responses", json={**BODY, "stream": False}).json()["id"]
        read_until(client, rid, lambda r: r["status"] in ENDED)
        assert _error(client.get(f"/v1/responses/{rid}?stream=true"), 400)["param"] == "stream"
        assert _error(client.get(f"/v1/responses/{rid}?starting_after=2"), 400)["param"] == "starting_after"
        assert _error(client.get("/v1/responses/resp_nope?stream=true"), 404)
        assert client.get(f"/v1/responses/{plain.id}?stream=true&starting_after=-1").status_code == 400


def test_an_engine_failure_ends_the_kept_stream_in_response_failed(fake, monkeypatch, quick_follow):
    fake.mode = "lost"  # (every continuation lost too)
    servers, route, client = replicas(fake, monkeypatch)
    with client:
        with client.stream("POST", "/v1/responses", json={**BODY, "max_output_tokens": 30}) as r:
            live = read_events(r)
        assert live[-1]["type"] == "response.failed"
        rid = live[0]["response"]["id"]
        route[0] = servers[1]
        assert get_events(client, rid) == live
        assert read_until(client, rid, lambda r: r["status"] in ENDED)["error"]["code"] == "engine_unavailable"


# -- the store's side ---------------------------------------------------------------------------------
RUNNING = {"id": "r0", "status": "in_progress", "background": True, "output": []}


def _event(k: int, pad: int = 0) -> str:
    return f"event: e\ndata: {json.dumps({'type': 'e', 'sequence_number': k, 'pad': 'x' * pad})}\n\n"


def holds_its_bytes(store: ResponseStore) -> bool:
    return store._bytes == sum(link.size for link in store._links.values())


def test_an_ended_response_s_events_are_packed():
    store = ResponseStore(max_stored=10, max_stored_bytes=1 << 24)
    assert store.put(RUNNING, [], streamed=True) == "stored"
    deltas = [_event(k).replace('"pad": ""', f'"delta": "w{k % 7}", "item_id": "msg_0123456789abcdef"')
              for k in range(500)]
    assert store.append("r0", -1, deltas) and store.finish({**RUNNING, "status": "completed"})
    raw = sum(len(event) for event in deltas)
    assert store._links["r0"].events.size < raw / 5 and holds_its_bytes(store)
    assert store.events("r0", -1, 99)["events"] == deltas[100:]


def test_the_store_keeps_a_streamed_response_s_events_in_its_bytes():
    store = ResponseStore(max_stored=10, max_stored_bytes=1 << 16)
    assert store.put(RUNNING, [], streamed=True) == "stored" and store.put({**RUNNING, "id": "r1"}, []) == "stored"
    before = store._bytes
    assert store.append("r0", -1, [_event(0), _event(1)]) and store.append("r0", -1, [_event(2)])
    assert store._bytes == before + sum(len(_event(k).encode()) for k in range(3))
    assert store.events("r0", -1, None) == {"events": [_event(k) for k in range(3)], "ended": False}
    assert store.events("r0", -1, 0)["events"] == [_event(1), _event(2)]
    assert store.events("r0", 7) is None and store.events("r1")["events"] is None  # (another key; not streamed)
    assert not store.append("r0", 7, [_event(9)]) and len(store.events("r0")["events"]) == 3  # (another key's)
    store.cancel("r1")
    assert store.finish({**RUNNING, "status": "completed"}, -1, [_event(3)])
    assert store.events("r0") == {"events": [_event(k) for k in range(4)], "ended": True}  # (packed now)
    assert store.events("r0", -1, 2)["events"] == [_event(3)] and holds_its_bytes(store)
    assert not store.append("r0", -1, [_event(4)]) and len(store.events("r0")["events"]) == 4  # (ended)
    assert store.put({**RUNNING, "id": "r2"}, [], streamed=True) == "stored" and store.cancel("r2")
    assert not store.append("r2", -1, [_event(0)]) and store.events("r2")["events"] == [_event(0)]  # (made before
    assert holds_its_bytes(store)  # it knew: unpacked, added, packed again)
    store.delete("r2")
    store.delete("r0")
    assert store._bytes == store._links["r1"].size and len(store._links) == 1  # (their events went with them)
    assert store.put({**RUNNING, "id": "r3"}, [], streamed=True) == "stored"
    grown = store._bytes
    assert store.append("r3", -1, ["data: \u00e9t\u00e9\n\n"]) and store._bytes - grown == 13  # (bytes, not characters)


def test_events_past_the_byte_bound_stop_the_response_and_a_lost_one_ends_failed(monkeypatch):
    store = ResponseStore(max_stored=10, max_stored_bytes=1 << 16)
    assert store.put(RUNNING, [], streamed=True) == "stored"
    assert store.append("r0", -1, [_event(0, 40_000)])
    assert not store.append("r0", -1, [_event(1, 40_000)]) and store.get("r0") is None  # (dropped: it stops)
    assert store.put({**RUNNING, "id": "r1"}, [], streamed=True) == "stored" and store.append("r1", -1, [_event(0)])
    monkeypatch.setattr(response_store, "LEASE_S", 0.0)
    time.sleep(0.01)
    found = store.events("r1")
    assert found["ended"] and [json.loads(e.split("data: ")[1])["type"] for e in found["events"]] == [
        "e", "response.failed"]
    last = json.loads(found["events"][-1].split("data: ")[1])
    assert last["sequence_number"] == 1 and last["response"]["status"] == "failed"
    assert store.events("r1") == found  # (failed once)


def test_a_follower_rides_out_a_store_unavailable_for_a_moment(monkeypatch):
    import asyncio

    from specserve.serve.background import BackgroundRuns
    from specserve.serve.front_door import KeyLimits, OpenAIError

    class Flaky:  # (the store's answers: one event, two failures, then the last event and the end)
        on = True

        def __init__(self) -> None:
            self.answers = [{"events": ["e0"], "ended": False}, OpenAIError(503, "gone", None),
                            OpenAIError(503, "gone", None), {"events": ["e1"], "ended": True}]
            self.asked = []

        async def call(self, method: str, *args):
            asks = {None: args} if method == "events" else args[0]  # (the first ask; then each tick's, batched)
            self.asked += [after for _, _, after in asks.values()]
            answer = self.answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer if method == "events" else {key: answer for key in asks}

    monkeypatch.setattr(background, "FOLLOW_S", 0.001)

    async def read(store) -> list[str]:
        runs = BackgroundRuns(store, KeyLimits(None, None))
        return [event async for event in await runs.follow("r0", -1, None)]

    store = Flaky()
    assert asyncio.run(read(store)) == ["e0", "e1"] and store.asked == [None, 0, 0, 0]
    monkeypatch.setattr(response_store, "LEASE_S", 0.0)  # (unavailable past the lease: the stream ends)
    store = Flaky()
    store.answers[2:] = [OpenAIError(503, "gone", None)] * 3
    assert asyncio.run(read(store)) == ["e0"]


def test_a_response_that_ends_while_the_store_restarts_is_stored_once_it_answers(monkeypatch):
    import asyncio

    from specserve.serve.background import BackgroundRuns
    from specserve.serve.front_door import KeyLimits, OpenAIError

    class Restarting:  # (unavailable for two questions, then back)
        on = True

        def __init__(self, down: int) -> None:
            self.down, self.finished = down, []

        async def call(self, method: str, response: dict, owner: int, events: list[str]):
            if self.down:
                self.down -= 1
                raise OpenAIError(503, "the response store is unavailable", None)
            self.finished.append(response["id"])
            return True

    monkeypatch.setattr(response_store, "POLL_S", 0.001)
    store = Restarting(2)
    runs = BackgroundRuns(store, KeyLimits(None, None))
    assert asyncio.run(runs._finish({"id": "r0"}, -1, [])) and store.finished == ["r0"]
    monkeypatch.setattr(background, "FINISH_S", 0.0)  # (down past it: the error is raised, and logged)
    with pytest.raises(OpenAIError):
        asyncio.run(BackgroundRuns(Restarting(5), KeyLimits(None, None))._finish({"id": "r1"}, -1, []))


def test_a_replica_s_followers_ask_the_store_together_in_one_call_a_tick(monkeypatch):
    """Eight followers of three responses generating on another replica: each tick's questions
    go to the store as one call, and followers at the same place of one response share an ask."""
    import asyncio

    from specserve.serve.background import BackgroundRuns
    from specserve.serve.front_door import KeyLimits

    class Counting:
        on = True

        def __init__(self) -> None:
            self.calls: list[int] = []  # asks per events_many call

        async def call(self, method: str, *args):
            if method == "events":  # (each follower's first question, its request's own)
                return {"events": [], "ended": False}
            self.calls.append(len(args[0]))  # (the next event after each ask's place; five in all)
            return {key: {"events": [f"e{after + 1}"], "ended": after == 3} for key, (_, _, after) in args[0].items()}

    monkeypatch.setattr(background, "FOLLOW_S", 0.02)

    async def follow_all(store) -> list[list[str]]:
        runs = BackgroundRuns(store, KeyLimits(None, None))

        async def one(k: int) -> list[str]:
            return [event async for event in await runs.follow(f"r{k % 3}", -1, None)]

        return await asyncio.gather(*(one(k) for k in range(8)))

    store = Counting()
    streams = asyncio.run(follow_all(store))
    assert all(stream == [f"e{n}" for n in range(5)] for stream in streams), streams
    # 5 ticks, each one call of 3 asks (not 8 calls); a follower that computed its wake-up just past
    # a tick's start asks on the next, alone, so allow a call or two more
    assert len(store.calls) <= 7 and max(store.calls) == 3 and sum(store.calls) <= 17, store.calls


def test_a_replica_s_runs_hand_over_together_in_one_store_call(fake, monkeypatch, quick_follow):
    """Ten streamed background responses at once: their hand-overs fall on the same ticks and go
    to the store as one call each tick, not one call per response."""
    sizes = []
    hand_over = ResponseStore.hand_over

    def counted(self, batch):
        sizes.append(len(batch))
        return hand_over(self, batch)

    monkeypatch.setattr(ResponseStore, "hand_over", counted)
    fake.script, fake.step_delay = said(b"w" * 60), 0.01
    servers, route, client = replicas(fake, monkeypatch, n=1)
    with client:
        rids = []
        for _ in range(10):  # (each client goes away after its first event)
            with client.stream("POST", "/v1/responses", json=BODY) as r:
                first = next(line for line in r.iter_lines() if line.startswith("data: "))
                rids.append(json.loads(first[6:])["response"]["id"])
        for rid in rids:
            assert read_until(client, rid, lambda r: r["status"] in ENDED)["status"] == "completed"
        for rid in rids:
            events = get_events(client, rid)
            assert events[-1]["type"] == "response.completed" and text_of(events) == "w" * 60
    assert sum(sizes) >= 10 and sum(sizes) / len(sizes) >= 3, sizes  # (most calls carry several responses)


def test_a_streamed_background_response_counts_once_against_its_key(fake, monkeypatch, quick_follow):
    """With max_concurrent_requests 2: while its creator streams it, the response takes one slot
    (the request's), not two; when the creator goes, the generation keeps that one slot until it
    ends."""
    fake.script, fake.step_delay = said(b"v" * 120), 0.03  # (about 1.2 s)
    servers, route, client = replicas(fake, monkeypatch, n=1, api_key=["k"],
                                      front_door={"per_key": {"max_concurrent_requests": 2}})
    key = {"authorization": "Bearer k"}
    limits = servers[0].door.limits
    with client:
        with client.stream("POST", "/v1/responses", json=BODY, headers=key) as r:
            lines = r.iter_lines()  # (held: an iterator let go of would close the stream)
            first = next(line for line in lines if line.startswith("data: "))
            rid = json.loads(first[6:])["response"]["id"]
            assert limits.accounts[0].running == 1  # (the open request only)
            assert client.get(f"/v1/responses/{rid}", headers=key).status_code == 200  # (a second slot is free)
            assert limits.accounts[0].running == 1
        assert eventually(lambda: limits.accounts[0].running == 1)  # (the creator went: the generation holds one)
        assert not fake.streams[-1].cancelled
        with client.stream("GET", f"/v1/responses/{rid}?stream=true", headers=key) as r:  # (no slot: a read)
            assert r.status_code == 200 and limits.accounts[0].running == 1
            assert read_events(r)[-1]["type"] == "response.completed"
        assert eventually(lambda: limits.accounts[0].running == 0)
