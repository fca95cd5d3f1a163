"""The HTTP layer in process: the real FastAPI app, routes and validation of `OpenAIServer`, with the
coordinator's DeploymentHandle replaced by a fake that runs the engine's own admission checks
(`new_sequence`) and answers with made-up tokens. No Ray cluster: runs in a few seconds.

    - property testing from the app's OpenAPI schema (schemathesis): no input gives a 5xx
    - explicit bad inputs, API keys, what a client sees when the coordinator replica is lost,
      and that prompts and outputs stay out of the logs.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, settings

from serve_helpers import tiny_app_spec

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
MODEL = "tiny"


# -- a coordinator handle without Ray ----------------------------------------------------------------
class _Call:
    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)


class FakeStream:
    """What `handle.options(stream=True).generate.remote(...)` returns: an async iterator + cancel()."""

    def __init__(self, gen) -> None:
        self.gen, self.cancelled = gen, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.gen.__anext__()

    def cancel(self) -> None:
        self.cancelled = True


class FakeCoordinator:
    """Admission exactly as the real coordinator checks it; output: the prompt's tokens, cycled.

    mode: "ok" | "queue_full" (every request refused as the full queue is) | "lost" (every replica
    dies after `lost_after` deltas: the stream raises like a dead actor's does) | "lost_once" (only
    the first submission's does). A continuation (`request.resume`) goes on from its generated
    tokens, as the real coordinator does; `requests` keeps what was submitted."""

    def __init__(self, max_model_len: int = 512, vocab_size: int = 259) -> None:
        self.max_model_len, self.vocab_size = max_model_len, vocab_size
        self.mode, self.lost_after = "ok", 2
        self.requests: list = []
        self.wrap = 128  # output token ids: the prompt's, modulo this (256: any byte, UTF-8 included)
        self.script: list[int] | None = None  # output token ids instead, the last the stop token (finish "stop")
        self.step_delay = 0.0  # seconds before each delta after the first (a slow generation)
        # seed -> the logprob of every token of a request with that seed, whose output ids are then
        # the prompt's shifted by its seed (generations told apart by their text and their score)
        self.by_seed: dict[int, float] | None = None
        self.streams: list[FakeStream] = []  # every generation's stream (cancelled: the ingress closed it)
        self.info = _Call(self._info)
        self.ready = _Call(self._ready)
        self.stats = _Call(self._stats)
        self.reset_stats = _Call(self._stats)
        self.generate = _Call(self._stream)
        self.prompt_logprobs = _Call(self._prompt_logprobs)

    def _stream(self, request) -> FakeStream:
        self.streams.append(FakeStream(self._generate(request)))
        return self.streams[-1]

    def options(self, stream: bool = False) -> "FakeCoordinator":
        return self

    async def _info(self) -> dict:
        return {"max_model_len": self.max_model_len, "vocab_size": self.vocab_size, "num_speculative_tokens": 4}

    async def _stats(self) -> dict:
        return {"running": 0, "waiting": 0}

    async def _ready(self) -> bool:
        return True

    async def _prompt_logprobs(self, tokens: list[int], k: int) -> list:
        """As the target worker answers: None for the first token, then (logprob, k alternatives)."""
        return [None] + [(-1.0 - j, [(t, -1.0 - j)] + [(1, -9.0)] * (k - 1) if k else [])
                         for j, t in enumerate(tokens[1:])]

    async def _generate(self, request):
        from ray.exceptions import ActorDiedError

        from specserve.engine.step import ContextLengthExceeded, InvalidPrompt, new_sequence
        from specserve.serve.coordinator import Accepted, Delta, Lost, Rejected

        self.requests.append(request)
        if self.mode == "queue_full":
            yield Rejected("the server is overloaded (4 requests waiting); retry later", "queue_full")
            return
        try:
            seq = new_sequence(request.request_id, request.prompt_token_ids, request.params,
                               vocab_size=self.vocab_size, max_model_len=self.max_model_len,
                               eos_token_ids=frozenset(), max_gamma=request.num_speculative_tokens)
        except (InvalidPrompt, ContextLengthExceeded) as err:
            code = "context_length_exceeded" if isinstance(err, ContextLengthExceeded) else "invalid_prompt"
            yield Rejected(str(err), code)
            return
        if self.mode == "leaving_at_once" and len(self.requests) == 1:  # its first answer
            yield Lost("the target worker's node is gone")
            return
        yield Accepted(len(seq.prompt))
        n, step = seq.params.max_tokens, 0
        script = self.script
        if script is not None:
            n = min(n, len(script))
        produced = len(request.resume.generated) if request.resume else 0
        dies = self.mode == "lost" or (self.mode == "lost_once" and request.resume is None)
        leaves = self.mode == "leaving_once" and request.resume is None
        while produced < n:
            if dies and step == self.lost_after:
                raise ActorDiedError()
            if leaves and step == self.lost_after:
                yield Lost("the target worker's node is gone")
                return
            k = min(3, n - produced)
            shift = 0 if self.by_seed is None else seq.params.seed
            tokens = script[produced:produced + k] if script is not None else \
                [(seq.prompt[(produced + i) % len(seq.prompt)] + shift) % self.wrap for i in range(k)]
            produced += k
            step += 1
            k = request.params.logprobs
            logprobs = None if k is None else [-0.25 * (i + 1) if self.by_seed is None else self.by_seed[shift]
                                               for i in range(len(tokens))]
            forbidden = -9.0 if request.params.grammar is None else float("-inf")  # (a grammar's masked token)
            tops = None if k is None else [([(t, lp)] + [(1, forbidden)] * (k - 1)) if k else []
                                           for t, lp in zip(tokens, logprobs)]
            end = "stop" if script is not None and produced == len(script) else "length"
            yield Delta(tokens, end if produced >= n else None, 4 * step, 2 * step, step, None, logprobs, tops)
            await asyncio.sleep(self.step_delay)


# -- the app in process --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fake():
    return FakeCoordinator()


def _server(fake, monkeypatch, **config_overrides):
    from ray import serve

    from specserve.config import load_app_config
    from specserve.serve.openai_api import OpenAIServer

    server = OpenAIServer(fake, load_app_config({**tiny_app_spec()["args"], **config_overrides}))

    class _Context:
        servable_object = server

    monkeypatch.setattr(serve, "get_replica_context", lambda: _Context())  # the routes' `self`

    async def no_controller() -> bool:
        return False

    # This ingress has no Serve controller of its own. With the session's Ray up (the other serve test
    # files), its readiness probe would ask the real controller from a pool thread that outlives the
    # test, and Ray builds autoscaling configs through a process-global pickling registry that is not
    # thread-safe: a later test's serve.run in the main thread then fails ("... is not registered for
    # pickle by value").
    monkeypatch.setattr(server, "_serve_reports_running", no_controller)
    return server


@pytest.fixture()
def client(fake, monkeypatch):
    from starlette.testclient import TestClient

    from specserve.serve.openai_api import app

    fake.mode, fake.script, fake.by_seed = "ok", None, None
    _server(fake, monkeypatch)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def _error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


# -- property testing from the OpenAPI schema ----------------------------------------------------------
def test_openapi_fuzz_finds_no_server_error(fake, monkeypatch):
    """Cases drawn from /openapi.json (valid and invalid bodies): none may be answered with a 5xx."""
    import schemathesis
    from schemathesis import GenerationMode

    from specserve.serve.openai_api import app

    fake.mode = "ok"
    _server(fake, monkeypatch)
    statuses: dict[int, int] = {}
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    bad: list[str] = []

    def fuzz() -> None:
        for result in schema.get_all_operations():
            operation = result.ok()
            heavy = operation.method.upper() == "POST" and ("completions" in operation.path
                                                            or operation.path in ("/v1/responses", "/v1/messages"))
            modes = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if heavy else (GenerationMode.POSITIVE,)
            for mode in modes:  # (an operation without inputs has no invalid ones)
                try:
                    bad.extend(_fuzz_operation(operation, mode, statuses, max_examples=100 if heavy else 10))
                except Exception as err:  # (the thread would die silently, and the rest go unfuzzed)
                    bad.append(f"{operation.label} {mode}: the fuzzing itself failed: {err!r}"[:500])

    # bounded: ~450 cases, each answered within CASE_LIMIT_S, the whole run within RUN_LIMIT_S (no hang)
    runner = threading.Thread(target=fuzz, daemon=True)
    runner.start()
    runner.join(timeout=RUN_LIMIT_S)
    assert not runner.is_alive(), f"the fuzz run did not finish within {RUN_LIMIT_S} s: {statuses}"
    assert not bad, "\n".join(bad[:10])
    assert statuses.get(200, 0) > 50 and statuses.get(400, 0) > 50, statuses  # both paths were exercised


CASE_LIMIT_S, RUN_LIMIT_S = 10.0, 300.0


def _fuzz_operation(operation, mode, statuses: dict[int, int], max_examples: int) -> list[str]:
    """Draw `max_examples` cases of one operation and return the ones answered with a 5xx."""
    from hypothesis import given
    from schemathesis import GenerationMode

    bad: list[str] = []
    drawn = [0]

    # derandomize: CI sees the same cases every run (a finding is reproducible, never a flake)
    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case):
        if mode == GenerationMode.POSITIVE and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = MODEL  # else nearly every valid body is a 404 (unknown model)
            drawn[0] += 1
            if drawn[0] % 2:  # a random schema / regex / grammar is nearly always a 400: every other case keeps it
                case.body.pop("response_format", None)
                # (as are a random min_tokens, over max_tokens, and random token ids, past the vocabulary)
                case.body.pop("min_tokens", None)
                case.body.pop("stop_token_ids", None)
                case.body.pop("allowed_token_ids", None)
                prompt = case.body.get("prompt")
                if isinstance(prompt, list) and all(type(t) is int for t in prompt):
                    case.body["prompt"] = [abs(t) % FakeCoordinator().vocab_size for t in prompt]
        began = time.monotonic()
        response = case.call()
        took = time.monotonic() - began
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        if response.status_code >= 500 or took > CASE_LIMIT_S:
            bad.append(f"{operation.label}: {response.status_code} in {took:.1f} s for {case.body!r}"[:500])

    run()
    return bad


# -- explicit bad inputs (the ones tests/test_serve.py does not already cover) ----------------------------
def _post(client, body, path="/v1/completions", **kw):
    return client.post(path, json=body, **kw) if not isinstance(body, bytes) else client.post(path, content=body, **kw)


@pytest.mark.parametrize("name,body", [
    ("huge max_tokens", {"model": MODEL, "prompt": "x", "max_tokens": 10**30}),
    ("zero max_tokens", {"model": MODEL, "prompt": "x", "max_tokens": 0}),
    ("negative temperature", {"model": MODEL, "prompt": "x", "temperature": -0.5}),
    ("top_p above one", {"model": MODEL, "prompt": "x", "top_p": 1.5}),
    ("top_p negative", {"model": MODEL, "prompt": "x", "top_p": -0.1}),
    ("huge top_k", {"model": MODEL, "prompt": "x", "top_k": 10**20}),
    ("huge seed", {"model": MODEL, "prompt": "x", "seed": 2**70}),
    ("token id huge", {"model": MODEL, "prompt": [1, 2**70], "max_tokens": 2}),
    ("token id negative", {"model": MODEL, "prompt": [-1], "max_tokens": 2}),
    ("token id negative, echoed", {"model": MODEL, "prompt": [5, -1], "max_tokens": 2, "echo": True}),
    ("token id past the vocabulary, echoed", {"model": MODEL, "prompt": [5, 300], "max_tokens": 0, "echo": True}),
    ("prompt over context", {"model": MODEL, "prompt": "y" * 600, "max_tokens": 2}),
    ("prompt null", {"model": MODEL, "prompt": None}),
    ("body is a list", [1, 2, 3]),
    ("nested junk", {"model": MODEL, "prompt": "x", "stop": [{"a": 1}]}),
    ("presence penalty above 2", {"model": MODEL, "prompt": "x", "presence_penalty": 2.5}),
    ("frequency penalty below -2", {"model": MODEL, "prompt": "x", "frequency_penalty": -3}),
    ("repetition penalty zero", {"model": MODEL, "prompt": "x", "repetition_penalty": 0}),
    ("logit_bias key not a token id", {"model": MODEL, "prompt": "x", "logit_bias": {"abc": 1.0}}),
    ("logit_bias key past the vocabulary", {"model": MODEL, "prompt": "x", "logit_bias": {"259": 1.0}}),
    ("logit_bias value above 100", {"model": MODEL, "prompt": "x", "logit_bias": {"5": 101}}),
])
def test_bad_values_are_400(client, name, body):
    _error(_post(client, body), 400)


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty"])
def test_nan_and_inf_are_400(client, field, literal):
    body = f'{{"model": "{MODEL}", "prompt": "x", "max_tokens": 2, "{field}": {literal}}}'.encode()
    err = _error(_post(client, body, headers={"content-type": "application/json"}), 400)
    assert err["param"] == field


def test_chat_bad_inputs(client):
    path = "/v1/chat/completions"
    _error(_post(client, {"model": MODEL, "messages": []}, path), 400)
    _error(_post(client, {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, path), 400)
    _error(_post(client, {"model": MODEL, "messages": [{"role": "user"}]}, path), 400)
    _error(_post(client, {"model": MODEL, "messages": [{"role": "user", "content": "x" * 600}]}, path), 400)
    _error(_post(client, {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                          "max_completion_tokens": -3}, path), 400)


def test_invalid_utf8_and_wrong_content_type_are_400(client):
    _error(_post(client, b'{"model": "tiny", "prompt": "\xff\xfe\xfa"}', headers={"content-type": "application/json"}),
           400)
    _error(_post(client, b"\xff\xfe\x00garbage", headers={"content-type": "application/json"}), 400)
    _error(_post(client, b'{"model": "tiny", "prompt": "x"}', headers={"content-type": "text/plain"}), 400)
    _error(_post(client, b"model=tiny&prompt=x", headers={"content-type": "application/x-www-form-urlencoded"}), 400)
    _error(client.post("/v1/completions"), 400)  # no body at all


def test_multi_megabyte_prompt_is_400_not_a_crash(client):
    r = _post(client, {"model": MODEL, "prompt": "z" * (3 << 20), "max_tokens": 4})
    assert _error(r, 400)["code"] == "context_length_exceeded"
    r = _post(client, {"model": MODEL, "prompt": list(range(200)) * 2000, "max_tokens": 4})  # 400k token ids
    assert _error(r, 400)["code"] == "context_length_exceeded"
    assert _post(client, {"model": MODEL, "prompt": "fine", "max_tokens": 4}).status_code == 200


# -- API key ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("source", ["config", "env"])
def test_api_key(fake, monkeypatch, source):
    from starlette.testclient import TestClient

    from specserve.serve.openai_api import app

    fake.mode = "ok"
    if source == "env":
        monkeypatch.setenv("SPECSERVE_API_KEY", "s3cret-key")
        _server(fake, monkeypatch)
    else:
        monkeypatch.delenv("SPECSERVE_API_KEY", raising=False)
        _server(fake, monkeypatch, api_key="s3cret-key")
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    with TestClient(app, raise_server_exceptions=False) as c:
        assert c.get("/health").status_code == 200  # open, for load balancers and probes
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret-key"},
                        {"authorization": "Basic s3cret-key"}):
            for method, path, json_ in (("POST", "/v1/completions", body), ("GET", "/v1/models", None),
                                        ("GET", "/v1/stats", None), ("POST", "/v1/stats/reset", None),
                                        ("POST", "/v1/chat/completions",
                                         {"model": MODEL, "messages": [{"role": "user", "content": "x"}]})):
                r = c.request(method, path, json=json_, headers=headers)
                err = _error(r, 401)
                assert err["code"] in ("missing_api_key", "invalid_api_key") and "s3cret" not in r.text
                assert r.headers["www-authenticate"] == "Bearer"
        ok = {"authorization": "Bearer s3cret-key"}
        assert c.post("/v1/completions", json=body, headers=ok).status_code == 200
        assert c.get("/v1/models", headers=ok).status_code == 200

    import openai  # the official client sends the key as a Bearer token

    transport = httpx.ASGITransport(app=app)

    async def call(key: str):
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key=key, max_retries=0,
                                    http_client=httpx.AsyncClient(transport=transport))
        return await client.completions.create(model=MODEL, prompt="x", max_tokens=2)

    assert asyncio.run(call("s3cret-key")).usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError):
        asyncio.run(call("nope"))


# -- overload and a lost coordinator replica: what the client sees ----------------------------------------
def test_queue_full_is_429_with_retry_after(client, fake):
    fake.mode = "queue_full"
    for path, body in (("/v1/completions", {"model": MODEL, "prompt": "x"}),
                       ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                  "stream": True})):
        r = client.post(path, json=body)
        err = _error(r, 429)
        assert err["code"] == "queue_full" and err["type"] == "rate_limit_error"
        assert int(r.headers["retry-after"]) >= 1


def test_replica_lost_every_time_is_503_or_sse_error_then_done(client, fake):
    """Every replica dies mid-request: after max_resumes continuations (3 by default) the client
    gets a clear error; a stream keeps the tokens it already had."""
    fake.mode = "lost"
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": 30}
    fake.requests.clear()
    r = client.post("/v1/completions", json=body)
    err = _error(r, 503)
    assert err["code"] == "engine_unavailable" and err["type"] == "server_error" and "retry" in err["message"]
    assert r.headers["retry-after"] == "1"
    assert len(fake.requests) == 4  # the request and 3 continuations, each 6 tokens further on
    assert [len(q.resume.generated) if q.resume else 0 for q in fake.requests] == [0, 6, 12, 18]
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200  # the stream had started: the error arrives as an event
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "engine_unavailable" and error["type"] == "server_error"
    chunks = [json.loads(e) for e in events[:-2]]
    assert chunks and all("choices" in c for c in chunks)  # tokens before the loss were delivered


def _stream_text(client, path: str, body: dict) -> tuple[str, list[dict]]:
    with client.stream("POST", path, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks), chunks
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    return text, chunks


@pytest.mark.parametrize("stop", [None, "straddle"])
def test_lost_replica_is_continued_with_identical_output(client, fake, stop):
    """The replica dies after 6 tokens: the request goes on elsewhere from those 6 (the
    continuation carries them, the same parameters and another request id), and the client sees
    the undisturbed output: no gap, no duplicate, no error; usage as the original request's;
    speculation totals over both replicas. A stop string whose match starts before the loss and
    ends after it still cuts the text."""
    body = {"model": MODEL, "prompt": "abcdefghijklmnop", "max_tokens": 14, "temperature": 0.7, "seed": 3}
    fake.mode = "ok"
    clean = client.post("/v1/completions", json=body).json()
    if stop:
        body["stop"] = clean["choices"][0]["text"][5:8]  # tokens 5 (before the loss) to 7 (after)
        clean = client.post("/v1/completions", json=body).json()
        assert clean["choices"][0]["finish_reason"] == "stop" and len(clean["choices"][0]["text"]) == 5
    clean_stream, _ = _stream_text(client, "/v1/completions", body)
    fake.mode = "lost_once"
    fake.requests.clear()
    whole = client.post("/v1/completions", json=body).json()
    assert whole["choices"] == clean["choices"] and whole["usage"] == clean["usage"]
    first, again = fake.requests
    assert again.resume.generated == tuple(ord(c) for c in "abcdef")
    assert again.request_id == f"{first.request_id}.1" and again.params == first.params
    assert again.prompt_token_ids == first.prompt_token_ids
    if not stop:  # 2 deltas on the lost replica, then 3 on the next: totals add up
        assert whole["speculation"] == {"num_draft_tokens": 4 * 2 + 4 * 3, "num_accepted_tokens": 2 * 2 + 2 * 3,
                                        "num_steps": 5}
    text, chunks = _stream_text(client, "/v1/completions", {**body, "return_token_ids": True})
    assert text == clean_stream == clean["choices"][0]["text"]
    assert chunks[-1]["usage"] == clean["usage"]
    fake.mode = "ok"
    clean_ids = client.post("/v1/completions", json={**body, "return_token_ids": True}).json()["choices"][0]["token_ids"]
    # streamed ids (each chunk: the ids new since the previous one) add up to the whole's, exactly
    assert [t for c in chunks if c["choices"] for t in c["choices"][0]["token_ids"]] == clean_ids
    if not stop:
        assert len(clean_ids) == 14


def test_utf8_character_split_by_a_lost_replica_is_whole(client, fake):
    """A 2-byte character whose first byte came from the lost replica and second from the next:
    the ingress's incremental detokenizer holds the first byte across the continuation."""
    prompt = list("abcde".encode()) + list("é".encode()) + list("xyz".encode())  # é: tokens 5 and 6
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 9, "temperature": 0.0}
    fake.wrap = 256
    try:
        fake.mode = "lost_once"
        text, _ = _stream_text(client, "/v1/completions", body)
    finally:
        fake.wrap = 128
    assert text == "abcdeéxy"


def test_models_answer_at_once_while_the_engine_starts(fake, monkeypatch):
    """/v1/models does not wait for the engine: while no coordinator answers (its models still
    loading), the card comes without the engine's context, or with the configured one (it was
    held until the engine was up: minutes for a large model)."""
    from starlette.testclient import TestClient

    from specserve.serve import ingress
    from specserve.serve.openai_api import app

    async def starting() -> dict:
        await asyncio.sleep(30)

    monkeypatch.setattr(ingress, "MODEL_CARD_WAIT_S", 0.2)
    monkeypatch.setattr(fake, "info", _Call(starting))
    for overrides, card in [({"max_model_len": None}, {"id": MODEL}), ({"max_model_len": 300}, {"id": MODEL, "max_model_len": 300})]:
        _server(fake, monkeypatch, **overrides)
        with TestClient(app, raise_server_exceptions=False) as client:
            began = time.monotonic()
            r = client.get("/v1/models")
            assert r.status_code == 200 and time.monotonic() - began < 5, r.text
            (got,) = r.json()["data"]
            assert {k: got.get(k) for k in card} == card and ("max_model_len" in got) == ("max_model_len" in card)
    monkeypatch.undo()
    _server(fake, monkeypatch)
    with TestClient(app, raise_server_exceptions=False) as client:
        assert client.get("/v1/models").json()["data"][0]["max_model_len"] == fake.max_model_len


def test_health_is_readiness_and_live_is_liveness(fake, monkeypatch):
    """/health answers 200 only while a coordinator replica answers in time (503 `not_ready`
    otherwise); /live never asks the engine. Neither needs the API key."""
    from starlette.testclient import TestClient

    from specserve.serve import openai_api
    from specserve.serve.openai_api import app

    monkeypatch.setenv("SPECSERVE_API_KEY", "k")
    _server(fake, monkeypatch)
    monkeypatch.setattr(openai_api, "READY_TIMEOUT_S", 0.2)
    with TestClient(app, raise_server_exceptions=False) as c:
        assert c.get("/health").json() == {"status": "ok"} and c.get("/live").json() == {"status": "ok"}

        async def stuck():
            await asyncio.sleep(5)

        monkeypatch.setattr(fake, "ready", _Call(stuck))
        # an engine that just answered (a probe, a request) is ready without a probe: none queues
        # behind a burst
        assert c.get("/health").status_code == 200
        done = c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                      headers={"Authorization": "Bearer k"})
        assert done.status_code == 200 and c.get("/health").status_code == 200
        monkeypatch.setattr(openai_api, "READY_FRESH_S", 0.0)  # quiet since: the probe decides
        r = c.get("/health")
        assert _error(r, 503)["code"] == "not_ready" and r.headers["retry-after"] == "1"
        assert c.get("/live").status_code == 200
        assert c.get("/v1/models").status_code == 401  # the other routes still need the key


# -- no prompts or outputs in the logs ---------------------------------------------------------------------
def test_prompts_and_outputs_are_not_logged(client, caplog):
    marker = "zebra-quartz-secret-prompt-71"
    with caplog.at_level(logging.DEBUG):
        for stream in (False, True):
            r = client.post("/v1/completions", json={"model": MODEL, "prompt": marker, "max_tokens": 20,
                                                     "stream": stream})
            assert r.status_code == 200
        _post(client, {"model": MODEL, "prompt": marker, "temperature": -1})  # and a rejected one
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert marker not in text and marker[:20] not in text


def test_null_max_tokens_means_the_default(client):
    """Found by the schema fuzzer: an explicit null max_tokens reached SamplingParams and was a 500."""
    r = _post(client, {"model": MODEL, "prompt": "x", "max_tokens": None})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 16


@pytest.mark.parametrize("path,body,nulls", [
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 4},
     ["temperature", "top_p", "n", "echo", "stream", "presence_penalty", "frequency_penalty", "logprobs", "seed",
      "stop", "best_of", "suffix", "user", "logit_bias", "top_k", "min_tokens", "ignore_eos", "stream_options"]),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
     ["temperature", "top_p", "n", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "stream",
      "stream_options", "parallel_tool_calls", "tools", "tool_choice", "response_format", "seed", "stop",
      "max_completion_tokens", "reasoning_effort", "add_generation_prompt"]),
])
def test_a_null_optional_parameter_is_its_default(client, fake, path, body, nulls):
    """OpenAI's optional parameters are nullable, and clients send `"temperature": null` for "not
    given": each is its default (it was a 400 where the field's type had no null)."""
    r = _post(client, body, path)
    assert r.status_code == 200, r.text
    plain = fake.requests[-1]
    r = _post(client, {**body, **dict.fromkeys(nulls)}, path)
    assert r.status_code == 200, r.text
    assert fake.requests[-1].params == plain.params
    assert fake.requests[-1].prompt_token_ids == plain.prompt_token_ids
    _error(_post(client, {**body, "model": None}, path), 400)  # (a required field stays required)


def test_openai_s_other_chat_parameters_are_taken_or_refused_by_name(client, fake):
    """OpenAI's chat parameters that change no token here (tags, hints, store false) are taken as
    they are; those that ask for what this server does not do are a 400 naming them (they were
    all `extra_forbidden`)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    assert _post(client, body, "/v1/chat/completions").status_code == 200
    plain = fake.requests[-1]
    taken = {"store": False, "metadata": {"team": "search"}, "service_tier": "auto", "prompt_cache_key": "u1",
             "prompt_cache_retention": "24h", "safety_identifier": "h4sh", "modalities": ["text"]}
    r = _post(client, {**body, **taken}, "/v1/chat/completions")
    assert r.status_code == 200, r.text
    assert fake.requests[-1].params == plain.params and fake.requests[-1].prompt_token_ids == plain.prompt_token_ids
    for extra, param in [({"store": True}, "store"), ({"modalities": ["text", "audio"]}, "modalities"),
                         ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
                         ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
                         ({"service_tier": "fastest"}, "service_tier")]:
        assert _error(_post(client, {**body, **extra}, "/v1/chat/completions"), 400)["param"] == param, extra


def test_a_tool_result_must_answer_a_call_before_it(client):
    """A `tool` message answers a call of the assistant message its run of results follows; one
    with no call before it, or naming another call's id, is a 400 naming the message."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    user, result = {"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "c1", "content": "42"}
    called = {"role": "assistant", "content": None, "tool_calls": [call, {**call, "id": "c2"}]}
    good = [user, called, result, {**result, "tool_call_id": "c2"}]
    body = {"model": MODEL, "max_tokens": 2}  # (no tools offered: a history may hold calls of earlier ones)
    r = _post(client, {**body, "messages": good}, "/v1/chat/completions")
    assert r.status_code == 200, r.text
    for messages, param in [([user, result], "messages.1"),
                            ([user, called, {**result, "tool_call_id": "c9"}], "messages.2.tool_call_id"),
                            ([user, called, result, user, result], "messages.4"),
                            ([user, {"role": "assistant", "content": "no calls"}, result], "messages.2")]:
        assert _error(_post(client, {**body, "messages": messages}, "/v1/chat/completions"), 400)["param"] == param


@pytest.mark.parametrize("path,body,field", [
    ("/v1/completions", {"prompt": "x"}, "stream"), ("/v1/completions", {"prompt": "x"}, "echo"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "ignore_eos"),
    ("/v1/responses", {"input": "hi"}, "store"), ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}],
                                                                    "max_tokens": 4}, "stream"),
])
@pytest.mark.parametrize("value", ["yes", "true", 1, 0])
def test_a_boolean_must_be_a_json_boolean(client, path, body, field, value):
    """OpenAI's rule: "stream": "yes" (or 1) is a 400 naming the field, not a stream."""
    r = _post(client, {"model": MODEL, **body, field: value}, path)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert field in (error.get("param") or error.get("message", "")), r.text


def test_a_prediction_reaches_the_engine_as_token_ids_and_usage_reports_it(client, fake):
    """`prediction` (text, or text parts) is tokenized without special tokens into the request's
    params; usage then carries completion_tokens_details with the prediction's counts (here 0: this
    coordinator drafts nothing); a malformed one, or one longer than the context, is a 400 naming it."""
    from specserve.models.tiny import byte_tokenizer

    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for content in ("def f(x):\n    return x", [{"type": "text", "text": "def f(x):"},
                                                 {"type": "text", "text": "\n    return x"}]):
        r = _post(client, {**body, "prediction": {"type": "content", "content": content}}, "/v1/chat/completions")
        assert r.status_code == 200, r.text
        expected = tuple(byte_tokenizer()("def f(x):\n    return x", add_special_tokens=False).input_ids)
        assert fake.requests[-1].params.prediction == expected
        assert r.json()["usage"]["completion_tokens_details"] == {"accepted_prediction_tokens": 0,
                                                                  "rejected_prediction_tokens": 0}
    r = _post(client, {"model": MODEL, "prompt": "x", "max_tokens": 4, "prediction": {"type": "content", "content": "ab"}})
    assert r.status_code == 200 and fake.requests[-1].params.prediction == (97, 98)
    assert "completion_tokens_details" not in _post(client, body, "/v1/chat/completions").json()["usage"]
    r = _post(client, {**body, "prediction": {"type": "token_ids", "token_ids": [3, 258, 0]}}, "/v1/chat/completions")
    assert r.status_code == 200 and fake.requests[-1].params.prediction == (3, 258, 0)
    for bad in ({"type": "text", "content": "x"}, {"content": "x"}, {"type": "content", "content": [{"text": "x"}]},
                {"type": "content", "content": "x" * 600}, {"type": "token_ids", "token_ids": [259]},
                {"type": "token_ids", "token_ids": [-1]}, {"type": "token_ids", "token_ids": [1] * 513}):
        assert _error(_post(client, {**body, "prediction": bad}, "/v1/chat/completions"), 400)["param"] \
            .startswith("prediction"), bad
    r = _post(client, {**body, "prediction": {"type": "content", "content": ""}}, "/v1/chat/completions")
    assert r.status_code == 200 and fake.requests[-1].params.prediction is None  # (an empty one: none)


def test_best_of_runs_every_candidate_and_returns_the_n_likeliest_per_token(client, fake, monkeypatch):
    """best_of k > n: k generations per prompt (seeds seed..seed+k-1, logprobs computed whether or
    not asked), the n with the highest mean log-probability per token returned best first and
    indexed prompt by prompt; usage counts every candidate's tokens. Greedy runs n (the candidates
    would be equal); best_of < n, a stream that would rank, or too many candidates are a 400."""
    monkeypatch.setattr(fake, "by_seed", {5: -2.0, 6: -0.5, 7: -1.0, 8: -0.1})
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 4, "temperature": 1.0, "seed": 5, "best_of": 3, "n": 2}
    sent = len(fake.requests)
    r = _post(client, body)
    assert r.status_code == 200, r.text
    asked = fake.requests[sent:]
    assert [q.params.seed for q in asked] == [5, 6, 7] and all(q.params.logprobs == 0 for q in asked)
    out = r.json()
    shifted = lambda seed: "".join(chr((ord(c) + seed) % 128) for c in "abca")  # (the fake's output)
    assert [(c["index"], c["text"], c["logprobs"]) for c in out["choices"]] == [(0, shifted(6), None),
                                                                                 (1, shifted(7), None)]
    assert out["usage"]["completion_tokens"] == 12 and out["usage"]["prompt_tokens"] == 3
    # asked for logprobs: the chosen ones carry theirs; two prompts: each its own best, indexed in turn
    r = _post(client, {**body, "prompt": ["abc", "abd"], "n": 1, "best_of": 2, "logprobs": 1})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [(c["index"], c["logprobs"]["token_logprobs"]) for c in choices] == [(0, [-0.5] * 4), (1, [-0.1] * 4)]
    assert r.json()["usage"]["completion_tokens"] == 16
    sent = len(fake.requests)
    r = _post(client, {**body, "temperature": 0.0, "stream": True})
    assert r.status_code == 200 and len(fake.requests) - sent == 2  # greedy: n generations, streamed
    sent = len(fake.requests)  # (a temperature the engine decodes greedily is greedy here too)
    assert _post(client, {**body, "temperature": 1e-6}).status_code == 200 and len(fake.requests) - sent == 2
    for bad in ({"best_of": 1}, {"stream": True}, {"best_of": 65, "n": 1}, {"best_of": 0}):
        assert _error(_post(client, {**body, **bad}), 400)["param"] in ("best_of", "n"), bad


# -- the front door: body limit, key before body, pre-check, limits, edge inputs -------------------------
def _client(fake, monkeypatch, **overrides):
    from starlette.testclient import TestClient

    from specserve.serve.openai_api import app

    fake.mode, fake.by_seed = "ok", None
    monkeypatch.delenv("SPECSERVE_API_KEY", raising=False)
    server = _server(fake, monkeypatch, **overrides)
    return server, TestClient(app, raise_server_exceptions=False)


def test_body_over_the_limit_is_413_before_it_is_parsed(fake, monkeypatch):
    _, c = _client(fake, monkeypatch, front_door={"max_request_bytes": 64 << 10})
    with c:
        big = {"model": MODEL, "prompt": "x" * (100 << 10)}
        err = _error(_post(c, big), 413)  # Content-Length says so
        assert err["code"] == "request_too_large"
        chunks = (b'{"model": "tiny", "prompt": "' + b"y" * (16 << 10) for _ in range(8))  # chunked: no length
        r = c.post("/v1/completions", content=chunks, headers={"content-type": "application/json"})
        assert _error(r, 413)["code"] == "request_too_large"
        # malformed JSON under the limit is still the parser's 400; a body just under the limit is served
        assert _error(_post(c, b'{"model": ', headers={"content-type": "application/json"}), 400)
        ok = {"model": MODEL, "prompt": "x" * 400, "max_tokens": 2}
        assert _post(c, ok).status_code == 200


def test_the_key_is_checked_before_the_body(fake, monkeypatch):
    """A wrong key gets its 401 whatever the body: too large, malformed, or nothing at all."""
    _, c = _client(fake, monkeypatch, api_key="k-123", front_door={"max_request_bytes": 64 << 10})
    json_headers = {"content-type": "application/json"}
    with c:
        for body in (b"x" * (1 << 20), b'{"model": ', b""):
            r = c.post("/v1/completions", content=body, headers={**json_headers, "authorization": "Bearer nope"})
            assert _error(r, 401)["code"] == "invalid_api_key"
        r = c.post("/v1/completions", content=b"x" * (1 << 20), headers={**json_headers, "authorization": "Bearer k-123"})
        assert _error(r, 413)["code"] == "request_too_large"


def test_openapi_and_unknown_routes_need_the_key(fake, monkeypatch):
    _, c = _client(fake, monkeypatch, api_key=["first-key", "second-key"])
    with c:
        assert c.get("/health").status_code == 200
        for path in ("/openapi.json", "/docs", "/v1/nothing-here"):
            assert _error(c.get(path), 401)["code"] == "missing_api_key"
        for key in ("first-key", "second-key"):  # several keys: each works
            r = c.get("/openapi.json", headers={"authorization": f"Bearer {key}"})
            assert r.status_code == 200 and "/v1/completions" in r.json()["paths"]
        assert c.get("/v1/nothing-here", headers={"authorization": "Bearer first-key"}).status_code == 404


def test_env_holds_several_keys(fake, monkeypatch):
    from specserve.serve.front_door import parse_keys

    assert parse_keys(None, " a , b,,") == (b"a", b"b") and parse_keys("c", "a,b") == (b"c",)
    assert parse_keys(None, None) == () and parse_keys(("x", "y"), None) == (b"x", b"y")


def test_require_api_key_refuses_to_start_without_one(fake, monkeypatch):
    monkeypatch.delenv("SPECSERVE_API_KEY", raising=False)
    with pytest.raises(RuntimeError, match="SPECSERVE_API_KEY"):
        _server(fake, monkeypatch, front_door={"require_api_key": True})
    monkeypatch.setenv("SPECSERVE_API_KEY", "from-a-secret")
    assert _server(fake, monkeypatch, front_door={"require_api_key": True}).door.keys == (b"from-a-secret",)


def test_a_text_that_cannot_fit_is_refused_without_tokenizing(fake, monkeypatch):
    server, c = _client(fake, monkeypatch)
    per_token = server._token_floor.chars_per_token
    assert per_token == len("<|endoftext|>")  # the byte tokenizer's longest token: a special token
    calls = []
    encode = server._encode
    monkeypatch.setattr(server, "_encode", lambda *a: calls.append(a) or encode(*a))
    with c:
        too_long = "z" * (fake.max_model_len * per_token + 1)
        err = _error(_post(c, {"model": MODEL, "prompt": too_long, "max_tokens": 4}), 400)
        assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
        chat = {"model": MODEL, "messages": [{"role": "user", "content": too_long}]}
        err = _error(_post(c, chat, "/v1/chat/completions"), 400)
        assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
        assert calls == []  # neither was tokenized
        # one that might fit is tokenized and then measured exactly (the engine's own check)
        err = _error(_post(c, {"model": MODEL, "prompt": "z" * 600, "max_tokens": 4}), 400)
        assert err["code"] == "context_length_exceeded" and len(calls) == 1


def test_chars_per_token_bound_holds_and_unbounded_pipelines_are_detected():
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from specserve.models.tiny import byte_tokenizer
    from specserve.serve.front_door import max_chars_per_token, token_floor

    tok = byte_tokenizer()
    floor = token_floor(tok)
    assert floor.dropped == ""
    for text in ["<|endoftext|>" * 50, "héllo → 你好 🙂", "a" * 1000, "<|im_start|><|im_end|>x"]:
        assert len(tok(text).input_ids) >= floor(text)

    def wrap(backend):
        return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")

    word_piece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    word_piece.pre_tokenizer = pre_tokenizers.Whitespace()
    assert max_chars_per_token(wrap(word_piece)) is None  # a whole unknown word is one [UNK]
    bpe = Tokenizer(models.BPE({"[UNK]": 0, "a": 1}, [], unk_token="[UNK]", fuse_unk=True))
    assert max_chars_per_token(wrap(bpe)) is None  # no byte fallback: a run of unknowns fuses
    byte_level = Tokenizer(models.BPE({"a": 0, "b": 1}, []))
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel()
    assert max_chars_per_token(wrap(byte_level)) is None  # BPE drops bytes it has no symbol for
    alphabet = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    gaps = Tokenizer(models.BPE({c: i for c, i in alphabet.items() if c not in ("Ĕ", "ÿ")}, []))
    gaps.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # lacks byte 0x14 (a control) and 0xff (never UTF-8)
    floor = token_floor(wrap(gaps))
    text = "ab\x14\x14\x14\x14cd"
    assert floor.dropped == "\x14" and len(wrap(gaps)(text).input_ids) == 4  # the controls vanished
    assert floor(text) == 1 and floor("\x14" * 1000) == 0  # 4 kept characters, at most 5 ("[UNK]") a token
    byte_level = Tokenizer(models.BPE({**alphabet, "abcdef": 256}, []))
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel()
    assert max_chars_per_token(wrap(byte_level)) == 6
    byte_level.normalizer = normalizers.NFKC()  # composition shrinks the text
    assert max_chars_per_token(wrap(byte_level)) is None
    byte_level.normalizer = normalizers.Sequence([normalizers.NFD(), normalizers.Lowercase()])
    assert max_chars_per_token(wrap(byte_level)) == 6
    byte_level.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.ByteLevel()])
    assert max_chars_per_token(wrap(byte_level)) is None  # whitespace is dropped


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "ok \ud800 not ok"}, "prompt"),
    ("/v1/completions", {"prompt": "x", "stop": ["fine", "\udfff"]}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud83d"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]},
     "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "prediction": {"type": "content", "content": "a\ud800"}}, "prediction"),
])
def test_lone_surrogates_are_400(client, path, body, param):
    r = client.post(path, content=json.dumps({"model": MODEL, "max_tokens": 2, **body}).encode(),
                    headers={"content-type": "application/json"})
    err = _error(r, 400)
    assert err["code"] == "invalid_unicode" and err["param"] == param


@pytest.mark.parametrize("name,body,param", [
    ("too many stops", {"prompt": "x", "stop": [f"s{i}" for i in range(17)]}, "stop"),
    ("stop too long", {"prompt": "x", "stop": "s" * 257}, "stop"),
    ("too many logit_bias entries", {"prompt": "x", "logit_bias": {str(i): 1.0 for i in range(1025)}}, "logit_bias"),
    ("too many messages", {"messages": [{"role": "user", "content": "m"}] * 1025}, "messages"),
    ("too many content parts", {"messages": [{"role": "user", "content": [{"type": "text", "text": "p"}] * 257}]},
     "messages"),
    ("too many choices", {"prompt": ["a", "b"], "n": 33}, "n"),
    ("n zero", {"prompt": "a", "n": 0}, "n"),
    ("token ids over the context", {"prompt": [65] * 600}, "prompt"),
])
def test_client_controlled_lists_are_limited(client, name, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    assert _error(_post(client, {"model": MODEL, **body}, path), 400)["param"] == param


def test_chat_default_max_tokens_fits_the_context_and_the_kv_budget(fake, monkeypatch):
    messages = [{"role": "user", "content": "twenty chars, about."}]
    # AppConfig refuses a KV budget that cannot hold one request of the whole context, so the
    # context is what bounds the default
    for overrides in ({}, {"max_cached_tokens": 1536}):
        _, c = _client(fake, monkeypatch, **overrides)
        room = fake.max_model_len
        with c:
            r = _post(c, {"model": MODEL, "messages": messages}, "/v1/chat/completions")
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            assert usage["total_tokens"] == room  # all that fits, not more
    monkeypatch.setattr(fake, "max_model_len", 8)
    _, c = _client(fake, monkeypatch)
    with c:  # the prompt alone fills the context: the 400 names the messages, never max_tokens
        err = _error(_post(c, {"model": MODEL, "messages": messages}, "/v1/chat/completions"), 400)
        assert err["param"] == "messages" and "max_tokens" not in err["message"]


def test_tiny_temperature_is_greedy_not_nan():
    import torch

    from specserve.engine.sampling import BatchSampling, SamplingParams, logits_to_probs

    params = [SamplingParams(temperature=t) for t in (1e-40, 5e-324, 1e-6)]
    assert all(p.greedy and p.temperature == 0.0 for p in params)
    assert not SamplingParams(temperature=1e-3).greedy
    logits = torch.tensor([[1.0, 3.0, 2.0]] * 3) * 1e3
    probs = logits_to_probs(logits, BatchSampling.from_params(params))
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0]] * 3))


def test_per_key_concurrency_and_tokens_per_minute():
    from specserve.serve.front_door import KeyLimits, OpenAIError

    now = [0.0]
    limits = KeyLimits(max_concurrent=2, tokens_per_minute=600, clock=lambda: now[0])
    limits.enter(0), limits.enter(0), limits.enter(1)  # keys are separate accounts
    with pytest.raises(OpenAIError) as busy:
        limits.enter(0)
    assert busy.value.status == 429 and busy.value.code == "concurrency_limit_exceeded"
    assert busy.value.headers["Retry-After"] == "1"
    limits.leave(0)
    limits.charge(0, 900)  # overshoots by one request: 300 tokens in debt
    with pytest.raises(OpenAIError) as spent:
        limits.enter(0)
    assert spent.value.code == "tokens_per_minute_exceeded"
    assert spent.value.headers["Retry-After"] == "31"  # (300 + 1) tokens at 10 per second
    limits.enter(1)
    now[0] = 31.0  # refilled past zero
    limits.enter(0)


def test_per_key_limits_over_http(fake, monkeypatch):
    _, c = _client(fake, monkeypatch, api_key=["a-key", "b-key"],
                   front_door={"per_key": {"max_concurrent_requests": 1, "tokens_per_minute": 50}})
    a, b = {"authorization": "Bearer a-key"}, {"authorization": "Bearer b-key"}
    body = {"model": MODEL, "prompt": "0123456789", "max_tokens": 30, "stream": True}
    with c:
        with c.stream("POST", "/v1/completions", json=body, headers=a) as first:
            assert first.status_code == 200
            r = _post(c, body, headers=a)  # a's one slot is taken while its stream is open
            assert _error(r, 429)["code"] == "concurrency_limit_exceeded" and r.headers["retry-after"] == "1"
            assert _post(c, {**body, "stream": False}, headers=b).status_code == 200  # b has its own
            list(first.iter_lines())
        # a spent 10 prompt + 30 generated tokens of 50; b spent 40 too: one more each overshoots
        assert _post(c, {**body, "stream": False}, headers=a).status_code == 200
        r = _post(c, body, headers=a)
        assert _error(r, 429)["code"] == "tokens_per_minute_exceeded" and int(r.headers["retry-after"]) >= 1
        assert c.get("/health").status_code == 200  # never limited


def test_small_requests_stay_fast_while_a_huge_one_is_refused(fake, monkeypatch):
    """The issue's scenario in process: a 20 MB prompt used to be tokenized on the event loop and
    stall every other request. Latency of a small request during a stream of huge ones stays within
    a ratio of its latency alone (medians, so a slow machine moves both alike)."""
    import statistics
    import time

    from specserve.serve.openai_api import app

    fake.mode, fake.by_seed = "ok", None
    monkeypatch.delenv("SPECSERVE_API_KEY", raising=False)
    _server(fake, monkeypatch)
    small = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
    huge = json.dumps({"model": MODEL, "prompt": "h" * (20 << 20), "max_tokens": 4}).encode()

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            async def timed():
                began = time.perf_counter()
                r = await client.post("/v1/completions", json=small)
                assert r.status_code == 200
                return time.perf_counter() - began

            async def refuse_huge():
                began = time.perf_counter()
                r = await client.post("/v1/completions", content=huge, headers={"content-type": "application/json"})
                assert r.status_code == 413
                return time.perf_counter() - began

            for _ in range(5):
                await timed()  # warm-up
            alone = [await timed() for _ in range(15)]
            during, refusals = [], []
            for _ in range(5):
                huge_task = asyncio.ensure_future(refuse_huge())
                during += [await timed() for _ in range(3)]
                refusals.append(await huge_task)
            return statistics.median(alone), statistics.median(during), max(refusals)

    alone, during, refusal = asyncio.run(scenario())
    assert during <= 3 * alone, (alone, during)
    assert refusal < 1.0, refusal


def test_tokens_without_text_still_stream_as_token_ids(client, fake):
    """Tokens that decode to no text (special tokens here; most of a random model's vocabulary under
    the byte tokenizer) get a chunk each time they arrive when token ids are asked for, so a load
    test sees its time to first token and its inter-token gaps; without token ids nothing empty is sent."""
    body = {"model": MODEL, "prompt": [256, 257, 257], "max_tokens": 9, "temperature": 0.0, "ignore_eos": True}
    fake.wrap = 1000  # the prompt's tokens come back as they are
    text, chunks = _stream_text(client, "/v1/completions", {**body, "return_token_ids": True})
    with_ids = [c["choices"][0]["token_ids"] for c in chunks if c["choices"]]
    assert text == "" and with_ids == [[256, 257, 257]] * 3  # one chunk per delta (3 tokens each)
    text, chunks = _stream_text(client, "/v1/completions", body)
    assert text == "" and len([c for c in chunks if c["choices"]]) == 2  # the first and the finishing chunk


@pytest.mark.parametrize("mode", ["leaving_once", "leaving_at_once"])
def test_a_replica_that_leaves_hands_its_requests_on(client, fake, mode):
    """A coordinator whose target has no node left sends Lost (mid-stream, or as its first answer):
    the ingress continues the request on the next replica, and the client sees one unbroken answer."""
    body = {"model": MODEL, "prompt": "abcdefgh", "max_tokens": 14, "temperature": 0.0, "return_token_ids": True}
    clean = client.post("/v1/completions", json=body).json()
    fake.mode = mode
    fake.requests.clear()
    whole = client.post("/v1/completions", json=body).json()
    assert whole["choices"] == clean["choices"] and whole["usage"] == clean["usage"]
    first, again = fake.requests
    if mode == "leaving_once":  # a loss mid-stream: a continuation from the 6 tokens delivered
        assert again.request_id == f"{first.request_id}.1" and len(again.resume.generated) == 6
    else:  # a leaving replica took nothing over: the request is simply sent again
        assert again == first
    fake.requests.clear()
    text, chunks = _stream_text(client, "/v1/completions", body)
    assert text == clean["choices"][0]["text"] and chunks[-1]["usage"] == clean["usage"]


def test_penalties_and_logit_bias_reach_the_engine(client, fake):
    """OpenAI's presence/frequency penalties and logit_bias (string keys) and the repetition_penalty
    extension arrive in the request's SamplingParams (the engine applies them: test_processing.py)."""
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 3, "presence_penalty": 0.5, "frequency_penalty": -1.25,
            "repetition_penalty": 1.2, "logit_bias": {"97": -100, "5": 2.5}}
    fake.requests.clear()
    assert client.post("/v1/completions", json=body).status_code == 200
    chat = {**body, "messages": [{"role": "user", "content": "hi"}]}
    del chat["prompt"]
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    for request in fake.requests:
        p = request.params
        assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -1.25, 1.2)
        assert p.logit_bias == ((5, 2.5), (97, -100.0))


def test_min_tokens_min_p_stop_token_ids_and_priority_reach_the_engine(client, fake):
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 6, "min_tokens": 4, "stop_token_ids": [33, 7]}
    fake.requests.clear()
    assert client.post("/v1/completions", json=body).status_code == 200
    (request,) = fake.requests
    assert request.params.min_tokens == 4 and request.params.stop_token_ids == (33, 7)
    fake.requests.clear()
    assert client.post("/v1/completions", json={**body, "min_p": 0.25, "priority": -3,
                                                "allowed_token_ids": [9, 4, 9]}).status_code == 200
    assert fake.requests[0].params.min_p == 0.25 and fake.requests[0].priority == -3
    assert fake.requests[0].params.allowed_token_ids == (4, 9)
    fake.requests.clear()
    assert client.post("/v1/completions", json={**body, "bad_words": ["hi", " yo"]}).status_code == 200
    assert set(fake.requests[0].params.bad_words_ids) == {tuple(b"hi"), tuple(b" hi"), tuple(b"yo"), tuple(b" yo")}


def _text_and_ids(client, body: dict, stream: bool) -> tuple[str, list[int], dict]:
    """A completion's text, token ids and usage, whole or streamed."""
    body = {**body, "return_token_ids": True}
    if stream:
        text, chunks = _stream_text(client, "/v1/completions", body)
        ids = [t for c in chunks if c["choices"] for t in c["choices"][0].get("token_ids") or []]
        return text, ids, chunks[-1]["usage"]
    r = client.post("/v1/completions", json=body).json()
    return r["choices"][0]["text"], r["choices"][0]["token_ids"], r["usage"]


@pytest.mark.parametrize("stream", [False, True])
def test_the_stop_token_that_ends_the_output_has_no_text(client, fake, stream):
    """vLLM's rule: the stop token that ends a generation (here "!", a stop_token_ids id) is in its
    token ids and usage, not in its text, unless include_stop_str_in_output; a stop string stays
    out unless so asked too."""
    fake.script = list(b"hello!")
    base = {"model": MODEL, "prompt": "abc", "max_tokens": 16, "stop_token_ids": [33]}
    for extra, want in (({}, "hello"), ({"include_stop_str_in_output": True}, "hello!"),
                        ({"stop": "ll"}, "he"), ({"stop": "ll", "include_stop_str_in_output": True}, "hell")):
        text, ids, usage = _text_and_ids(client, {**base, **extra}, stream)
        assert text == want, extra
        # a stop string ends the tokens at the one that completes it ("hel" + "lo!" came in 2 deltas)
        assert ids == list(b"hell" if "stop" in extra else b"hello!"), extra
        assert usage["completion_tokens"] == len(ids)


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_inside_a_step_scores_no_token_after_it(client, fake, stream):
    """The fake sends 3 tokens a delta, as a speculative step does: "aXb" then "cde". The stop
    string "X" is completed by token 1; logprobs, token ids and usage end there, as they would
    where the target alone makes one token a step."""
    fake.script = list(b"aXbcde!")
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 16, "stop": "X", "logprobs": 1, "return_token_ids": True}
    if stream:
        text, chunks = _stream_text(client, "/v1/completions", body)
        scored = [t for c in chunks if c["choices"] and c["choices"][0].get("logprobs")
                  for t in c["choices"][0]["logprobs"]["tokens"]]
        usage = chunks[-1]["usage"]
    else:
        choice, usage = (r := client.post("/v1/completions", json=body).json())["choices"][0], r["usage"]
        text, scored = choice["text"], choice["logprobs"]["tokens"]
    assert text == "a" and scored == ["a", "X"] and usage["completion_tokens"] == 2


@pytest.mark.parametrize("stream", [False, True])
def test_special_tokens_show_with_skip_special_tokens_false(client, fake, stream):
    fake.script = list(b"hi") + [257] + list(b"x") + [256]  # <|im_start|>, then EOS ends it
    base = {"model": MODEL, "prompt": "abc", "max_tokens": 16}
    assert _text_and_ids(client, base, stream)[0] == "hix"
    assert _text_and_ids(client, {**base, "skip_special_tokens": False}, stream)[0] == "hi<|im_start|>x"
    shown = _text_and_ids(client, {**base, "skip_special_tokens": False, "include_stop_str_in_output": True}, stream)
    assert shown[0] == "hi<|im_start|>x<|endoftext|>"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("min_tokens,text", [(0, "a"), (2, "a"), (3, "aXb"), (4, "aXb"), (5, "aXbXc")])
def test_no_stop_string_ends_in_the_first_min_tokens(client, fake, stream, min_tokens, text):
    """vLLM's rule: a stop string counts from the min_tokens-th token on (one that ends in that
    token's text counts). The fake sends 3 tokens per delta, so the boundary falls inside one."""
    fake.script = list(b"aXbXcXd")
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 16, "min_tokens": min_tokens, "stop": "X"}
    if stream:
        got, _ = _stream_text(client, "/v1/completions", body)
    else:
        got = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert got == text


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "max_tokens": 3, "min_tokens": 4}, "min_tokens"),
    ({"prompt": "x", "min_tokens": -1}, "min_tokens"),
    ({"prompt": "x", "min_p": 1.5}, "min_p"),
    ({"prompt": "x", "min_p": -0.1}, "min_p"),
    ({"prompt": "x", "stop_token_ids": [259]}, "stop_token_ids"),
    ({"prompt": "x", "stop_token_ids": [-2]}, "stop_token_ids"),
    ({"prompt": "x", "stop_token_ids": list(range(17))}, "stop_token_ids"),
    ({"prompt": "x", "allowed_token_ids": [259]}, "allowed_token_ids"),
    ({"prompt": "x", "bad_words": ["  "]}, "bad_words"),
    ({"prompt": "x", "bad_words": ["w"], "response_format": {"type": "json_object"}}, "bad_words"),
    ({"prompt": "x", "bad_words": ["w"] * 17}, "bad_words"),
    ({"prompt": "x", "bad_words": ["w" * 257]}, "bad_words"),
    ({"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids"),
    ({"prompt": "x", "allowed_token_ids": [5], "response_format": {"type": "json_object"}}, "allowed_token_ids"),
    ({"prompt": "x", "min_tokens": 2, "response_format": {"type": "json_object"}}, "min_tokens"),
])
def test_bad_min_tokens_min_p_and_stop_token_ids_are_400(client, body, param):
    assert _error(_post(client, {"model": MODEL, **body}), 400)["param"] == param


def _chat_prompt(client, fake, **extra) -> str:
    """The prompt text a chat request's template made (as the engine received it)."""
    fake.requests.clear()
    messages = extra.pop("messages", [{"role": "user", "content": "hi"}])
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2, **extra})
    assert r.status_code == 200, r.text
    from specserve.models.tiny import byte_tokenizer
    return byte_tokenizer().decode(fake.requests[-1].prompt_token_ids)


def test_chat_template_options_shape_the_prompt(client, fake, monkeypatch):
    """vLLM's add_generation_prompt, continue_final_message (the last assistant message left open,
    the output continuing it) and chat_template_kwargs (variables for the template)."""
    from ray import serve

    assert _chat_prompt(client, fake).endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert _chat_prompt(client, fake, add_generation_prompt=False).endswith("hi<|im_end|>\n")
    opened = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]
    assert _chat_prompt(client, fake, messages=opened, add_generation_prompt=False,
                        continue_final_message=True).endswith("<|im_start|>assistant\nThe answer is")
    tokenizer = serve.get_replica_context().servable_object.tokenizer
    monkeypatch.setattr(tokenizer, "chat_template",
                        tokenizer.chat_template + "{% if enable_thinking %}<think>{% endif %}")
    assert _chat_prompt(client, fake, chat_template_kwargs={"enable_thinking": True}).endswith("assistant\n<think>")
    assert _chat_prompt(client, fake, chat_template_kwargs={"enable_thinking": False}).endswith("assistant\n")


@pytest.mark.parametrize("extra", [
    {"continue_final_message": True},  # add_generation_prompt defaults to true
    {"continue_final_message": True, "add_generation_prompt": False},  # the last message is the user's
    {"chat_template_kwargs": {"tokenize": True}},
    {"chat_template_kwargs": {"add_generation_prompt": False}},
    {"chat_template_kwargs": {"not a name": 1}},
    {"chat_template_kwargs": {f"k{i}": i for i in range(33)}},
])
def test_bad_chat_template_options_are_400(client, extra):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    err = _error(client.post("/v1/chat/completions", json=body), 400)
    assert err["param"] == next(iter(extra)), err


def test_tokenize_counts_what_a_request_would_send(client, fake):
    """/tokenize gives the ids a completion's prompt or a chat's rendered messages become (the ones
    the engine receives), /detokenize turns ids back into text."""
    r = client.post("/tokenize", json={"model": MODEL, "prompt": "héllo", "return_token_strs": True})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["tokens"] == list("héllo".encode()) and out["count"] == 6 and out["max_model_len"] == fake.max_model_len
    assert len(out["token_strs"]) == 6
    chat = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"x": 1}}
    ids = client.post("/tokenize", json=chat).json()["tokens"]  # (model may be left out)
    fake.requests.clear()
    assert client.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, **chat}).status_code == 200
    assert ids == fake.requests[0].prompt_token_ids
    opened = client.post("/tokenize", json={"messages": chat["messages"], "add_generation_prompt": False}).json()
    assert opened["count"] < len(ids)
    back = client.post("/detokenize", json={"model": MODEL, "tokens": ids}).json()["prompt"]
    assert back == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("path,body,status,param", [
    ("/tokenize", {"model": "gpt-9", "prompt": "x"}, 404, "model"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "junk": 1}, 400, "junk"),
    ("/tokenize", {"messages": []}, 400, "messages"),  # (the chat's error, not the text's "prompt: Field required")
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "prompt": "x"}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True}, 400,
     "continue_final_message"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, 400, "tool_choice"),
    ("/detokenize", {"tokens": [259]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, None),
    ("/detokenize", {"tokens": [1] * 513}, 400, "tokens"),
])
def test_bad_tokenize_and_detokenize_bodies(client, path, body, status, param):
    err = _error(client.post(path, json=body), status)
    if param is not None:
        assert err["param"] == param, err
    assert "Request" not in err["message"], err  # (no schema class named to the client)


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client):
    body = {"model": MODEL, "prompt": "abcdefgh", "max_tokens": 7, "stream": True, "n": 2,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert len(chunks) > 3 and counts == sorted(counts) and counts[-1] == 14 and counts[0] < 14
    assert all(c["usage"]["prompt_tokens"] == 8 for c in chunks)
    err = _error(client.post("/v1/completions", json={**body, "stream_options": {"usage": True}}), 400)
    assert err["param"] in ("stream_options", None)


def test_truncate_prompt_tokens_keeps_the_prompts_end(client, fake):
    """vLLM's left truncation: the last k tokens go to the engine (a prompt longer than the context
    included), an echo shows what was kept; chat truncates the rendered conversation."""
    fake.requests.clear()
    body = {"model": MODEL, "prompt": "y" * 600 + "abcdefghij", "max_tokens": 2, "truncate_prompt_tokens": 4,
            "echo": True}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert fake.requests[-1].prompt_token_ids == list(b"ghij") and r.json()["choices"][0]["text"].startswith("ghij")
    assert r.json()["usage"]["prompt_tokens"] == 4
    ids = client.post("/v1/completions", json={**body, "prompt": list(range(1, 30)), "echo": False})
    assert ids.status_code == 200 and fake.requests[-1].prompt_token_ids == [26, 27, 28, 29]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 600}], "max_tokens": 2,
            "truncate_prompt_tokens": 6}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    assert fake.requests[-1].prompt_token_ids == list(b"stant\n")  # the end of "<|im_start|>assistant\n"
    assert client.post("/v1/completions", json={**body, "truncate_prompt_tokens": -1, "prompt": "abc"}).status_code \
        == 200 and fake.requests[-1].prompt_token_ids == list(b"abc")


@pytest.mark.parametrize("keep", [0, -2, 513])
def test_bad_truncate_prompt_tokens_are_400(client, keep):
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 2, "truncate_prompt_tokens": keep}
    assert _error(client.post("/v1/completions", json=body), 400)["param"] == "truncate_prompt_tokens"


def test_one_model_is_retrieved_by_its_id(client):
    card = client.get(f"/v1/models/{MODEL}").json()
    assert card["id"] == MODEL and card["object"] == "model" and card["max_model_len"] > 0
    assert card == client.get("/v1/models").json()["data"][0]
    err = _error(client.get("/v1/models/gpt-9"), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"


def test_logprobs_in_openai_shapes_whole_and_streamed(client):
    """Completions: tokens / token_logprobs / top_logprobs / text_offset; chat: content entries with
    token, logprob, bytes and top_logprobs; a stream carries each chunk's tokens' entries, and
    they add up to the whole answer's."""
    body = {"model": MODEL, "prompt": "abcdef", "max_tokens": 6, "temperature": 0.0, "logprobs": 2}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]
    lp = whole["logprobs"]
    assert lp["tokens"] == list("abcdef") and lp["token_logprobs"] == [-0.25, -0.5, -0.75] * 2
    assert lp["top_logprobs"][0] == {"a": -0.25, "\x01": -9.0} and lp["text_offset"] == [0, 1, 2, 3, 4, 5]
    _, chunks = _stream_text(client, "/v1/completions", body)
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    assert [t for s in streamed for t in s["tokens"]] == lp["tokens"]
    assert [o for s in streamed for o in s["text_offset"]] == lp["text_offset"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True,
            "top_logprobs": 1}
    content = client.post("/v1/chat/completions", json=chat).json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and content[0]["logprob"] == -0.25
    assert content[0]["bytes"] == list(content[0]["token"].encode())
    assert [a["token"] for a in content[0]["top_logprobs"]] == [content[0]["token"]]
    assert client.post("/v1/chat/completions", json={**chat, "logprobs": False}).status_code == 400  # top without
    plain = client.post("/v1/completions", json={**body, "logprobs": None}).json()["choices"][0]
    assert plain["logprobs"] is None
    _error(client.post("/v1/completions", json={**body, "logprobs": 21}), 400)


def test_batched_prompts_and_n_choices_whole_and_streamed(client, fake):
    """A list of prompts and n > 1: one generation per (prompt, i), choices indexed prompt-major,
    seeded choices with seed + their index, usage with each prompt counted once; a stream
    interleaves the choices' chunks, each with its index, then one usage chunk."""
    body = {"model": MODEL, "prompt": [[97, 98], [99, 100, 101]], "n": 2, "max_tokens": 4, "seed": 7}
    fake.requests.clear()
    whole = client.post("/v1/completions", json=body).json()
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in whole["choices"]] == ["abab", "abab", "cdec", "cdec"]
    assert whole["usage"] == {"prompt_tokens": 2 + 3, "completion_tokens": 16, "total_tokens": 21,
                              "prompt_tokens_details": {"cached_tokens": 0}}
    assert [r.params.seed for r in fake.requests] == [7, 8, 9, 10]
    assert len({r.request_id for r in fake.requests}) == 4
    text, chunks = _stream_text(client, "/v1/completions", body)
    per_choice: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            per_choice[choice["index"]] = per_choice.get(choice["index"], "") + choice["text"]
    assert per_choice == {c["index"]: c["text"] for c in whole["choices"]}
    assert chunks[-1]["usage"] == whole["usage"] and not chunks[-1]["choices"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 3}
    answer = client.post("/v1/chat/completions", json=chat).json()
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2] and answer["usage"]["completion_tokens"] == 9


def test_echo_returns_the_prompt_before_the_output_with_its_logprobs(client):
    """echo: the prompt's text before the completion, and with logprobs its tokens first (the first
    with none); max_tokens 0 scores the prompt alone (log-likelihood evaluation); streamed, the
    prompt comes as the first chunk."""
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 3, "temperature": 0.0, "echo": True}
    assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == "abcabc"
    scored = client.post("/v1/completions", json={**body, "logprobs": 1}).json()["choices"][0]
    lp = scored["logprobs"]
    assert lp["tokens"] == list("abcabc") and lp["token_logprobs"][:3] == [None, -1.0, -2.0]
    assert lp["top_logprobs"][0] is None and lp["top_logprobs"][1] == {"b": -1.0}
    assert lp["text_offset"] == [0, 1, 2, 3, 4, 5] and lp["token_logprobs"][3:] == [-0.25, -0.5, -0.75]
    only = client.post("/v1/completions", json={**body, "max_tokens": 0, "logprobs": 0}).json()
    assert only["choices"][0]["text"] == "abc" and only["choices"][0]["logprobs"]["token_logprobs"] == [None, -1.0, -2.0]
    assert only["usage"] == {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    text, chunks = _stream_text(client, "/v1/completions", {**body, "logprobs": 1})
    assert text == "abcabc" and chunks[0]["choices"][0]["text"] == "abc"
    assert chunks[0]["choices"][0]["logprobs"]["token_logprobs"] == [None, -1.0, -2.0]
    err = _error(client.post("/v1/completions", json={**body, "echo": False, "max_tokens": 0}), 400)
    assert err["param"] == "max_tokens"


@pytest.mark.parametrize("fmt,kind,source", [
    ({"type": "text"}, None, None),
    ({"type": "json_object"}, "json_object", ""),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object"}, "strict": True}},
     "json_schema", '{"type": "object"}'),
    ({"type": "json_schema", "json_schema": {"name": "any"}}, "json_object", ""),
    ({"type": "regex", "regex": "[a-z]+"}, "regex", "[a-z]+"),
    ({"type": "lark", "lark": 'start: "yes" | "no"'}, "lark", 'start: "yes" | "no"'),
])
def test_response_format_reaches_the_engine_as_a_grammar(client, fake, fmt, kind, source):
    """Chat and (as an extension) completions: each response_format becomes the request's grammar."""
    fake.requests.clear()
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "response_format": fmt}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 3, "response_format": fmt}
    assert client.post("/v1/completions", json=body).status_code == 200
    for request in fake.requests:
        g = request.params.grammar
        assert (g.kind, g.source) == (kind, source) if kind else g is None


@pytest.mark.parametrize("fmt", [
    {"type": "xml"},
    {"type": "json_schema"},
    {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "frobnicated"}}},
    {"type": "json_schema", "json_schema": {"name": "p", "schema": [1, 2]}},
    {"type": "regex", "regex": "[a-"},
    {"type": "regex", "regex": ""},
    {"type": "lark", "lark": "start: undefined_rule"},
    {"type": "json_object", "extra": 1},
    {"type": "regex", "regex": "a" * ((256 << 10) + 1)},
])
def test_a_bad_response_format_is_400(client, fmt):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "response_format": fmt}
    err = _error(client.post("/v1/chat/completions", json=chat), 400)
    assert err["param"] == "response_format", err


@pytest.mark.parametrize("outputs,kind,source", [
    ({"json": {"type": "array"}}, "json_schema", '{"type": "array"}'),
    ({"json": '{"type": "array"}'}, "json_schema", '{"type": "array"}'),
    ({"regex": "[a-z]+"}, "regex", "[a-z]+"),
    ({"choice": ["yes", "no"]}, "lark", 'start: "yes" | "no"'),
    ({"grammar": 'start: "a"+'}, "lark", 'start: "a"+'),
    ({"json_object": True}, "json_object", ""),
])
def test_structured_outputs_reach_the_engine_as_a_grammar(client, fake, outputs, kind, source):
    """vLLM's structured_outputs, chat and completions: the same grammars as response_format's."""
    fake.requests.clear()
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "structured_outputs": outputs}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 3, "structured_outputs": outputs}
    assert client.post("/v1/completions", json=body).status_code == 200
    for request in fake.requests:
        g = request.params.grammar
        assert (g.kind, g.source) == (kind, source)


def test_a_choice_grammar_takes_exactly_its_choices():
    from specserve.serve.schema import StructuredOutputs
    from test_tools import matches

    choices = ['say "hi"', "a\\b", "héllo", "x y", "tab\there"]
    grammar = StructuredOutputs(choice=choices).grammar_of()
    assert all(matches(grammar, c) for c in choices)
    assert not any(matches(grammar, c) for c in ["say hi", "x", "héllo!", "", "yes"])


@pytest.mark.parametrize("outputs", [
    {},
    {"regex": "a", "choice": ["b"]},
    {"json": "{not json"},
    {"choice": []},
    {"choice": [""]},
    {"regex": "[a-"},
    {"grammar": "start: undefined_rule"},
    {"guided_json": {}},
])
def test_bad_structured_outputs_are_400(client, outputs):
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 3, "structured_outputs": outputs}
    err = _error(client.post("/v1/completions", json=body), 400)
    assert err["param"] in ("structured_outputs", None), err  # (None: pydantic's own shape errors)


def test_structured_outputs_beside_response_format_or_tools_are_400(client):
    both = {"model": MODEL, "prompt": "abc", "max_tokens": 3, "structured_outputs": {"regex": "a"},
            "response_format": {"type": "json_object"}}
    assert _error(client.post("/v1/completions", json=both), 400)["param"] == "structured_outputs"
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "structured_outputs": {"regex": "a"},
            "tools": [tool]}
    assert _error(client.post("/v1/chat/completions", json=chat), 400)["param"] == "structured_outputs"


def test_a_forbidden_alternative_is_sent_as_a_finite_logprob(client):
    """-inf (a token the grammar masks) cannot be JSON: it goes out as -9999.0."""
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 3, "logprobs": 2, "response_format": {"type": "json_object"}}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200 and "Infinity" not in r.text
    assert list(r.json()["choices"][0]["logprobs"]["top_logprobs"][0].values())[1] == -9999.0
