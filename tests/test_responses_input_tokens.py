"""`POST /v1/responses/input_tokens` (the openai client's `responses.input_tokens.count`): the
tokens a Responses request's input renders to, exactly the prompt `POST /v1/responses` sends."""
from __future__ import annotations

import pytest

from test_responses_api import WEATHER, app_client, oai
from test_serve_api import MODEL, FakeCoordinator, _error


@pytest.fixture()
def fake():
    return FakeCoordinator(max_model_len=4096)


def sent_tokens(fake) -> int:
    return len(fake.requests[-1].prompt_token_ids)


@pytest.mark.parametrize("request_", [
    {"input": "What is the capital of France?"},
    {"input": "Weather?", "instructions": "Be brief.", "tools": [WEATHER], "tool_choice": "auto"},
    {"input": [{"role": "developer", "content": "Terse."}, {"role": "user", "content": "Hi"},
               {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
               {"type": "function_call_output", "call_id": "c1", "output": "sunny"}], "tools": [WEATHER]},
])
def test_the_count_is_the_prompt_a_response_sends(fake, monkeypatch, request_):
    with app_client(fake, monkeypatch) as client:
        counted = oai(client).responses.input_tokens.count(model=MODEL, **request_)
        assert counted.object == "response.input_tokens"
        oai(client).responses.create(model=MODEL, max_output_tokens=4, **request_)
        assert counted.input_tokens == sent_tokens(fake) > 0


def test_a_count_goes_on_from_a_previous_response_and_may_pass_the_context(fake, monkeypatch):
    with app_client(fake, monkeypatch) as client:
        first = oai(client).responses.create(model=MODEL, input="Capital?", max_output_tokens=8)
        counted = oai(client).responses.input_tokens.count(input="And?", previous_response_id=first.id)
        oai(client).responses.create(model=MODEL, input="And?", previous_response_id=first.id, max_output_tokens=4)
        assert counted.input_tokens == sent_tokens(fake)
        alone = oai(client).responses.input_tokens.count(input="And?").input_tokens
        assert alone < counted.input_tokens
        r = client.post("/v1/responses/input_tokens", json={"input": "z" * 5000})  # (over the context: counted)
        assert r.status_code == 200 and r.json()["input_tokens"] > 4096
        r = client.post("/v1/responses/input_tokens", json={"input": "z" * 5000, "truncation": "auto"})
        assert _error(r, 400)["code"] == "context_length_exceeded"  # (its latest turn alone does not fit)


def test_what_a_count_cannot_be_is_an_error(fake, monkeypatch):
    with app_client(fake, monkeypatch) as client:
        assert _error(client.post("/v1/responses/input_tokens", json={"input": "x", "model": "other"}), 404)
        r = client.post("/v1/responses/input_tokens", json={"input": "x", "previous_response_id": "resp_nope"})
        assert _error(r, 400)["param"] == "previous_response_id"
        r = client.post("/v1/responses/input_tokens", json={"input": "x", "tools": [{"type": "web_search"}]})
        assert _error(r, 400)["param"] == "tools"
        assert _error(client.post("/v1/responses/input_tokens", json={"input": "x", "stream": True}), 400)
        assert not fake.requests  # (nothing generated)


def test_with_truncation_auto_the_count_is_of_the_turns_kept(monkeypatch):
    from test_reasoning import said

    fake = FakeCoordinator(max_model_len=600)  # (the byte tokenizer: a token a character)
    with app_client(fake, monkeypatch) as client:
        fake.script = said(b"A" * 40)
        previous = None
        for k in range(8):  # (~100 tokens a turn: the 9th does not fit 600 with all of them)
            r = client.post("/v1/responses", json={"model": MODEL, "input": f"question {k} " + "q" * 40,
                                                   "previous_response_id": previous, "truncation": "auto"})
            previous = r.json()["id"]
        body = {"input": "last question", "previous_response_id": previous}
        whole = client.post("/v1/responses/input_tokens", json=body).json()["input_tokens"]
        cut = client.post("/v1/responses/input_tokens", json={**body, "truncation": "auto"}).json()["input_tokens"]
        client.post("/v1/responses", json={"model": MODEL, **body, "truncation": "auto"})
        assert whole > 600 > cut == sent_tokens(fake)
