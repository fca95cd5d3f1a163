"""`specserve bench mix`'s checks find what they look for (a stand-in server, no Ray); the run over
the real app is in tests/test_serve.py."""
from __future__ import annotations

import json
import random

import httpx

from specserve.bench import mix

CTX = mix.Context("m", ["Hello there", "Name a colour."], [5, 6, 7])


def chat_reply(text: str, tokens: int) -> dict:
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}],
            "usage": {"completion_tokens": tokens}}


def server(speculative: str, alone: str, status: int = 200):
    """A chat route answering `speculative`, or `alone` where num_speculative_tokens is 0."""
    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if status != 200:
            return httpx.Response(status, json={"detail": "boom"})
        text = alone if body.get("num_speculative_tokens") == 0 else speculative
        return httpx.Response(200, json=chat_reply(text, 3))
    return httpx.MockTransport(handle)


def test_a_greedy_answer_unlike_the_target_alone_s_is_a_problem():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
    assert mix.run_one("http://x", "chat", body, 5, server("a b c", "a b c")).problems == []
    problems = mix.run_one("http://x", "chat", body, 5, server("a b c", "a b d")).problems
    assert len(problems) == 1 and "differs from the target alone" in problems[0]


def test_a_5xx_or_a_shapeless_error_is_a_problem_and_a_4xx_a_refusal():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
    assert mix.run_one("http://x", "chat", body, 5, server("", "", status=500)).problems
    assert mix.refusal_of(400, {"error": {"message": "bad n"}}) == ("bad n", [])
    assert mix.refusal_of(400, {"detail": "bad n"})[1]


def test_a_stream_without_done_or_with_miscounted_ids_is_a_problem():
    chunk = {"choices": [{"index": 0, "text": "ab", "token_ids": [1, 2], "finish_reason": "stop"}],
             "usage": {"completion_tokens": 3}}
    problems: list[str] = []
    answer = mix.openai_answer("completions", [(None, chunk)], problems)
    mix.check_openai({"prompt": "x", "return_token_ids": True, "stream": True}, answer, problems)
    assert any("[DONE]" in p for p in problems) and any("usage.completion_tokens 3" in p for p in problems)


def test_usage_may_count_more_than_the_returned_ids_only_where_best_of_ranked():
    reply = {"choices": [{"index": 0, "text": "ab", "token_ids": [1, 2], "finish_reason": "length"}],
             "usage": {"completion_tokens": 4}}
    body = {"prompt": "x", "return_token_ids": True, "max_tokens": 2}
    for extra, flagged in (({"best_of": 2}, False), ({"best_of": 2, "temperature": 0}, True), ({}, True)):
        problems: list[str] = []
        mix.check_openai({**body, **extra}, mix.openai_answer("completions", reply, problems), problems)
        assert bool(problems) == flagged, extra


def test_a_responses_stream_whose_text_is_not_its_final_response_s_is_a_problem():
    final = {"status": "completed", "output": [{"type": "message", "content": [{"type": "output_text", "text": "hi"}]}]}
    events = [(None, {"type": "response.output_text.delta", "delta": "ho", "sequence_number": 1}),
              (None, {"type": "response.completed", "response": final, "sequence_number": 0})]
    problems: list[str] = []
    mix.responses_answer(None, "", {"stream": True}, events, problems)
    assert len(problems) == 2  # the numbers go down, and "ho" is not "hi"


def test_draws_cover_every_route_and_are_reproducible():
    draws = [mix.draw(random.Random(k), CTX, list(mix.ROUTES)) for k in range(200)]
    assert draws == [mix.draw(random.Random(k), CTX, list(mix.ROUTES)) for k in range(200)]
    assert {route for route, _ in draws} == set(mix.ROUTES)
    assert any(body.get("stream") for _, body in draws) and any("tools" in body for _, body in draws)


def test_stream_lines_read_as_named_events():
    """A Responses or Messages stream names each event; an OpenAI one does not, and ends with [DONE]."""
    from specserve.bench.sse import named_events

    lines = ["event: response.created", 'data: {"type": "response.created"}', "", ": keep-alive",
             "event: response.completed", 'data: {"type": "response.completed"}', ""]
    assert list(named_events(lines)) == [("response.created", {"type": "response.created"}),
                                         ("response.completed", {"type": "response.completed"})]
    assert list(named_events(['data: {"choices": []}', "", "data: [DONE]"])) == [(None, {"choices": []}),
                                                                                  (None, "[DONE]")]
