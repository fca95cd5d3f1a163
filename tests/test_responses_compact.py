"""`POST /v1/responses/compact` (the openai client's `responses.compact`): a conversation's user
messages, then one compaction item holding the model's summary of it, which a later request sends
back in their place; what the model was asked and shown, and what a compaction item cannot be."""
from __future__ import annotations

import json

import pytest
from ray import serve

from specserve.serve.responses_schema import COMPACT_ASK, SUMMARY_INTRO
from test_reasoning import said
from test_responses_api import app_client, oai, prompt_text
from test_serve_api import MODEL, FakeCoordinator, _error

TURNS = [{"role": "user", "content": "Plan a trip to Oslo."}, {"role": "assistant", "content": "Go in June."},
         {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
         {"type": "function_call_output", "call_id": "c1", "output": "cold"},
         {"role": "user", "content": "Hotels?"}, {"role": "assistant", "content": "Try the Grand."}]


@pytest.fixture()
def fake():
    return FakeCoordinator(max_model_len=4096)


def test_a_compaction_is_the_user_messages_and_the_model_s_summary(fake, monkeypatch):
    with app_client(fake, monkeypatch) as client:
        fake.script = said(b"User plans an Oslo trip in June; weather cold; hotel: the Grand.")
        compacted = oai(client).responses.compact(model=MODEL, input=TURNS, instructions="Be brief.")
        assert compacted.object == "response.compaction" and compacted.id.startswith("resp_")
        sent = prompt_text(fake)  # (the conversation, then the ask, greedy)
        assert sent.index("Be brief.") < sent.index("Plan a trip") < sent.index("Try the Grand.") < sent.index(
            COMPACT_ASK)
        assert fake.requests[-1].params.temperature == 0
        users = [item for item in compacted.output if item.type == "message"]
        assert [u.content[0].text for u in users] == ["Plan a trip to Oslo.", "Hotels?"]
        assert all(u.role == "user" and u.id.startswith("msg_") for u in users)
        (compaction,) = [item for item in compacted.output if item.type == "compaction"]
        assert compacted.output[-1] is compaction and compaction.id.startswith("cmp_")
        assert compacted.usage.output_tokens == len(fake.script) and compacted.usage.input_tokens > 0
        # the next turn sends the compacted window back: the model reads the summary, not the old turns
        fake.script = said(b"Booked.")
        window = [item.model_dump(exclude_none=True) for item in compacted.output]
        later = oai(client).responses.create(model=MODEL, input=window + [{"role": "user", "content": "Book it."}])
        sent = prompt_text(fake)
        assert SUMMARY_INTRO + "User plans an Oslo trip in June; weather cold; hotel: the Grand." in sent
        assert "Try the Grand." not in sent and "Hotels?" in sent and later.output_text == "Booked."
        fake.script = said(b"SECOND-SUMMARY")
        again = oai(client).responses.compact(model=MODEL, input=window + [{"role": "user", "content": "More?"}])
        assert [i.type for i in again.output] == ["message", "compaction"]  # (the users since the last one)
        assert "User plans an Oslo trip" in prompt_text(fake)  # (the new summary covers the old one's)
        fake.script = said(b"ok")
        appended = window + [{"role": "user", "content": "More?"}] + [
            item.model_dump(exclude_none=True) for item in again.output if item.type == "compaction"]
        oai(client).responses.create(model=MODEL, input=appended + [{"role": "user", "content": "Go?"}])
        sent = prompt_text(fake)  # (before the latest compaction, only the user messages since the one before)
        assert "SECOND-SUMMARY" in sent and "More?" in sent and "Go?" in sent
        assert "Hotels?" not in sent and "User plans an Oslo trip" not in sent


def test_a_compaction_goes_on_from_a_previous_response_and_fits_the_context(monkeypatch):
    fake = FakeCoordinator(max_model_len=1200)  # (the byte tokenizer: a token a character)
    with app_client(fake, monkeypatch) as client:
        fake.script = said(b"A" * 40)
        previous = None
        for k in range(12):  # (~100 tokens a turn: together, over the context)
            previous = oai(client).responses.create(model=MODEL, input=f"question {k} " + "q" * 40,
                                                    previous_response_id=previous, truncation="auto").id
        fake.script = said(b"the summary")
        compacted = oai(client).responses.compact(model=MODEL, previous_response_id=previous)
        sent = prompt_text(fake)
        assert COMPACT_ASK in sent and "question 11" in sent and "question 0 " not in sent  # (first turns dropped)
        assert len(fake.requests[-1].prompt_token_ids) + 1200 // 4 <= 1200  # (room for the summary)
        users = [i.content[0].text for i in compacted.output if i.type == "message"]
        assert users == [f"question {k} " + "q" * 40 for k in range(12)]  # (every user message, dropped or not)


BOTH, COMPACT = ("/v1/responses/compact", "/v1/responses"), ("/v1/responses/compact",)


@pytest.mark.parametrize("body,status,param,routes", [
    ({"input": [{"type": "compaction", "encrypted_content": "gAAAAABo-elsewhere"}]}, 400, "input", BOTH),
    ({"input": [{"type": "compaction", "encrypted_content": "specserve-compaction-v1:!!"}]}, 400, "input", BOTH),
    ({"input": "x", "previous_response_id": "resp_nope"}, 400, "previous_response_id", BOTH),
    ({"input": "x", "model": "other"}, 404, "model", BOTH),
    ({"input": "x", "stream": True}, 400, None, COMPACT),  # (not a parameter of compact)
])
def test_what_a_compaction_cannot_be_is_an_error(fake, monkeypatch, body, status, param, routes):
    with app_client(fake, monkeypatch) as client:
        for route in routes:
            error = _error(client.post(route, json={"model": MODEL, **body}), status)
            assert param is None or error["param"] == param, (route, error)
        assert not fake.requests


def test_truncation_keeps_a_compaction_while_the_turns_after_it_go(monkeypatch):
    from specserve.serve.responses_schema import compaction_content

    fake = FakeCoordinator(max_model_len=600)
    with app_client(fake, monkeypatch) as client:
        fake.script = said(b"ok")
        window = [{"role": "user", "content": "first"},
                  {"type": "compaction", "encrypted_content": compaction_content("SUMMARY-OF-EARLIER")}]
        turns = [m for k in range(8) for m in ({"role": "user", "content": f"question {k} " + "q" * 40},
                                               {"role": "assistant", "content": "A" * 40})]
        r = client.post("/v1/responses", json={"model": MODEL, "input": window + turns + [
            {"role": "user", "content": "last"}], "truncation": "auto", "max_output_tokens": 8})
        assert r.status_code == 200, r.text
        sent = prompt_text(fake)
        assert "SUMMARY-OF-EARLIER" in sent and "question 0 " not in sent and "last" in sent
        assert "first" not in sent  # (the user message before it went)


# -- server-side compaction (context_management) ---------------------------------------------------------
class Scripted(FakeCoordinator):
    """A fake engine whose generations answer with the next of `scripts` (the last one again after)."""

    def __init__(self, *scripts: bytes) -> None:
        super().__init__(max_model_len=4096)
        self.scripts = [said(text) for text in scripts]

    @property
    def script(self):
        return self.scripts.pop(0) if len(self.scripts) > 1 else self.scripts[0]

    @script.setter
    def script(self, value) -> None:  # (the base class sets None)
        pass


def sent(fake, k: int) -> str:
    return bytes(t for t in fake.requests[k].prompt_token_ids if t < 256).decode()


LONG = [m for k in range(4) for m in ({"role": "user", "content": f"ask {k} " + "u" * 30},
                                       {"role": "assistant", "content": f"said {k} " + "a" * 30})]


@pytest.mark.parametrize("stream", [False, True])
def test_past_its_threshold_a_response_is_compacted_first(monkeypatch, stream):
    fake = Scripted(b"SUMMARY-TEXT", b"The answer.")
    with app_client(fake, monkeypatch) as client:
        body = {"model": MODEL, "input": LONG + [{"role": "user", "content": "now?"}],
                "context_management": [{"type": "compaction", "compact_threshold": 200}]}
        if stream:
            with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
                events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
            assert [e["type"] for e in events[2:4]] == ["response.output_item.added", "response.output_item.done"]
            assert events[2]["item"]["type"] == "compaction" and events[2]["output_index"] == 0
            assert {e["output_index"] for e in events[4:-1] if "output_index" in e} == {1}
            response = events[-1]["response"]
        else:
            response = client.post("/v1/responses", json=body).json()
        assert len(fake.requests) == 2 and COMPACT_ASK in sent(fake, 0)  # (the summary first, then the answer)
        answer_prompt = sent(fake, 1)
        assert SUMMARY_INTRO + "SUMMARY-TEXT" in answer_prompt and "ask 0" in answer_prompt and "now?" in answer_prompt
        assert "said 0" not in answer_prompt and COMPACT_ASK not in answer_prompt
        assert [i["type"] for i in response["output"]] == ["compaction", "message"]
        assert response["output"][1]["content"][0]["text"] == "The answer."
        prompts = len(fake.requests[0].prompt_token_ids) + len(fake.requests[1].prompt_token_ids)
        assert response["usage"]["input_tokens"] == prompts
        assert response["usage"]["output_tokens"] == len(said(b"SUMMARY-TEXT")) + len(said(b"The answer."))
        # chained: the next turn goes on from the compacted window (the old assistant turns stay out)
        fake.scripts = [said(b"Next.")]
        later = client.post("/v1/responses", json={"model": MODEL, "input": "and then?",
                                                   "previous_response_id": response["id"]}).json()
        assert later["status"] == "completed" and len(fake.requests) == 3
        window = sent(fake, 2)
        assert "SUMMARY-TEXT" in window and "The answer." in window and "ask 3" in window and "said 3" not in window


def test_a_background_response_past_its_threshold_returns_at_once_and_compacts_in_its_task(monkeypatch):
    from specserve.serve import response_store
    from test_responses_api import read_until

    monkeypatch.setattr(response_store, "POLL_S", 0.02)
    fake = Scripted(b"SUMMARY-TEXT", b"The answer.")
    fake.step_delay = 0.05  # (the summary alone takes ~0.7 s)
    with app_client(fake, monkeypatch) as client:
        body = {"model": MODEL, "input": LONG + [{"role": "user", "content": "now?"}], "background": True,
                "context_management": [{"type": "compaction", "compact_threshold": 200}]}
        created = client.post("/v1/responses", json=body).json()
        assert created["status"] == "in_progress" and created["output"] == []
        assert len(fake.requests) <= 1  # (the summary not waited for: the answer not yet asked)
        fake.step_delay = 0.0
        done = read_until(client, created["id"], lambda r: r["status"] not in ("queued", "in_progress"))
        assert done["status"] == "completed" and [i["type"] for i in done["output"]] == ["compaction", "message"]
        assert COMPACT_ASK in sent(fake, 0) and SUMMARY_INTRO + "SUMMARY-TEXT" in sent(fake, 1)
        assert done["usage"]["output_tokens"] == len(said(b"SUMMARY-TEXT")) + len(said(b"The answer."))


@pytest.mark.parametrize("background", [False, True])
def test_a_streamed_response_past_its_threshold_sends_its_id_before_the_summary(monkeypatch, background):
    """Its first events (which carry the id a client resumes with) come at once; the summary,
    then the answer, after them."""
    from specserve.serve import background as background_runs, response_store

    monkeypatch.setattr(response_store, "POLL_S", 0.02)
    monkeypatch.setattr(background_runs, "FLUSH_S", 0.02)
    fake = Scripted(b"SUMMARY-TEXT", b"The answer.")
    fake.step_delay = 0.05  # (the summary alone takes ~0.7 s)
    body = {"model": MODEL, "input": LONG + [{"role": "user", "content": "now?"}], "stream": True,
            "background": background, "context_management": [{"type": "compaction", "compact_threshold": 200}]}
    with app_client(fake, monkeypatch) as client:
        with client.stream("POST", "/v1/responses", json=body) as r:
            lines = r.iter_lines()
            first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
            assert first["type"] == "response.created" and len(fake.requests) <= 1  # (the answer not asked yet)
            rest = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert rest[-1]["type"] == "response.completed" and rest[-1]["response"]["id"] == first["response"]["id"]
    assert [i["type"] for i in rest[-1]["response"]["output"]] == ["compaction", "message"]
    assert len(fake.requests) == 2 and COMPACT_ASK in sent(fake, 0)


class RefusesTheAnswer(Scripted):
    """The summary is generated; the answer after it is refused, as by a full queue."""

    async def _generate(self, request):
        if self.requests:
            self.mode = "queue_full"
        async for out in super()._generate(request):
            yield out


def test_an_answer_refused_after_its_summary_ends_the_stream_in_response_failed(monkeypatch):
    fake = RefusesTheAnswer(b"SUMMARY-TEXT", b"The answer.")
    body = {"model": MODEL, "input": LONG + [{"role": "user", "content": "now?"}], "stream": True,
            "context_management": [{"type": "compaction", "compact_threshold": 200}]}
    with app_client(fake, monkeypatch) as client:
        with client.stream("POST", "/v1/responses", json=body) as r:
            assert r.status_code == 200  # (the stream had begun)
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
        assert [e["type"] for e in events] == ["response.created", "response.in_progress", "response.failed"]
        failed = events[-1]["response"]
        assert failed["status"] == "failed" and failed["error"]["code"] == "queue_full"
        assert client.get(f"/v1/responses/{failed['id']}").json()["status"] == "failed"  # (kept as it ended)


def test_under_its_threshold_a_response_is_not_compacted(monkeypatch):
    fake = Scripted(b"Short.")
    with app_client(fake, monkeypatch) as client:
        server = serve.get_replica_context().servable_object  # (the routes' `self`)
        renders = []
        render = server._chat.render
        monkeypatch.setattr(server._chat, "render", lambda *a: renders.append(1) or render(*a))
        r = client.post("/v1/responses", json={"model": MODEL, "input": "hi",
                                               "context_management": [{"type": "compaction"}]})  # (80% of 4096)
        assert [i["type"] for i in r.json()["output"]] == ["message"] and len(fake.requests) == 1
        assert len(renders) == 1  # (rendered and tokenized once: to tell, and then to answer)
        bad = {"model": MODEL, "input": "hi", "context_management": [{"type": "other"}]}
        assert _error(client.post("/v1/responses", json=bad), 400)
        assert len(fake.requests) == 1


def test_a_conversation_compacted_by_a_response_goes_on_from_its_window(monkeypatch):
    fake = Scripted(b"SUMMARY-TEXT", b"The answer.", b"Next.")
    with app_client(fake, monkeypatch) as client:
        cid = client.post("/v1/conversations", json={"items": LONG}).json()["id"]
        body = {"model": MODEL, "input": "now?", "conversation": cid,
                "context_management": [{"type": "compaction", "compact_threshold": 200}]}
        first = client.post("/v1/responses", json=body).json()
        assert [i["type"] for i in first["output"]] == ["compaction", "message"]
        items = client.get(f"/v1/conversations/{cid}/items", params={"order": "asc", "limit": 100}).json()["data"]
        assert [i["type"] for i in items[-3:]] == ["message", "compaction", "message"] and len(items) == 11
        client.post("/v1/responses", json={"model": MODEL, "input": "and then?", "conversation": cid})
        assert len(fake.requests) == 3
        window = sent(fake, 2)
        assert "SUMMARY-TEXT" in window and "ask 0" in window and "said 0" not in window and "and then?" in window
