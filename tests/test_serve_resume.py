"""No request lost when a coordinator replica dies or is replaced: real kills on a real Serve app.

A second application of the tiny models beside the session's one (conftest.py's `server`: one Ray
start for every serve test file), with 2 coordinator replicas. Concurrent greedy streams run while
one replica's actor is killed (`ray.kill`), or while `serve.run` redeploys the app with a changed
config (every replica replaced): every stream completes with no error event, its token ids (each
chunk's `token_ids`) equal the target's own greedy output, so does its text, and its usage is the
original request's.

Run: pytest -m serve tests/test_serve_resume.py
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from models import hf_greedy
from serve_helpers import coordinator_replicas, deploy_app, replica_actors, sse_events_iter, tiny_app_spec, wait_for

pytestmark = [pytest.mark.serve, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
APP, ROUTE, MODEL = "specserve-resume", "/resume", "tiny-resume"
MAX_NEW = 160
PROMPTS = [f"stream {i}: " + "abcdefghij"[i % 10] * (1 + i % 4) for i in range(8)]
TWO = {"served_model_name": MODEL, "request_timeout_s": 90.0,
       "coordinator": {"resources": {"num_cpus": 0.1}, "autoscaling": {"min_replicas": 2, "max_replicas": 2},
                       "max_ongoing_requests": 1024}}


@pytest.fixture(scope="module")
def two_replicas(server):
    from ray import serve

    deploy_app(APP, ROUTE, **TWO)
    assert wait_for(lambda: coordinator_replicas(APP) == 2, timeout=90, interval=1)
    with httpx.Client(base_url=f"{server}{ROUTE}", timeout=120) as client:
        yield client
    serve.delete(APP)


@pytest.fixture(scope="module")
def references():
    """Each prompt's greedy continuation by the target alone: (token ids, their text)."""
    from specserve.config import load_app_config
    from specserve.models.loading import load_target
    from specserve.models.tiny import byte_tokenizer

    tok = byte_tokenizer()
    target = load_target(load_app_config(tiny_app_spec()["args"]).target)
    out = {}
    for p in PROMPTS:
        ids = hf_greedy(target, tok(p).input_ids, MAX_NEW)
        out[p] = ids, tok.decode(ids, skip_special_tokens=True)
    return out


class Streams:
    """Concurrent streaming completions; `chunks[i]` counts the events stream i has received."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.chunks = [0] * len(PROMPTS)
        self.results: list[dict] = []

    def _one(self, i: int) -> dict:
        body = {"model": MODEL, "prompt": PROMPTS[i], "max_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
        texts, ids, errors, usage, done = [], [], [], None, False
        with httpx.Client(base_url=self.base_url, timeout=120) as client:
            with client.stream("POST", "/v1/completions", json=body) as r:
                status = r.status_code
                for event in sse_events_iter(r):
                    if event == "[DONE]":
                        done = True
                    elif "error" in event:
                        errors.append(event["error"])
                    elif event.get("usage"):
                        usage = event["usage"]
                    else:
                        texts.append(event["choices"][0]["text"])
                        ids += event["choices"][0]["token_ids"]
                        self.chunks[i] += 1
        return {"prompt": PROMPTS[i], "status": status, "text": "".join(texts), "ids": ids, "errors": errors,
                "usage": usage, "done": done}

    def run(self, while_running) -> list[dict]:
        """Start every stream, call while_running() once each has its first chunks, collect."""
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            futures = [pool.submit(self._one, i) for i in range(len(PROMPTS))]
            assert wait_for(lambda: min(self.chunks) >= 3, timeout=60, interval=0.05), self.chunks
            while_running()
            return [f.result(timeout=180) for f in futures]


def _check(results: list[dict], references: dict) -> None:
    for r in results:
        assert r["status"] == 200 and r["done"] and not r["errors"], r
        ids, text = references[r["prompt"]]
        assert r["ids"] == ids, r["prompt"]  # no token lost or duplicated
        if "\ufffd" not in text:  # (how invalid UTF-8 bytes split into chunks can change their text)
            assert r["text"] == text, r["prompt"]
        assert r["usage"]["completion_tokens"] == MAX_NEW, r["usage"]


def test_killed_replica_loses_no_request(server, two_replicas, references):
    import ray

    before = two_replicas.get("/v1/stats").json()["ingress"]
    streams = Streams(f"{server}{ROUTE}")
    killed_at: list[int] = []

    def kill_one() -> None:  # the replica holding the most streams (the router may have sent all to one)
        replicas = replica_actors(APP)
        held = ray.get([r.get_num_ongoing_requests.remote() for r in replicas], timeout=30)
        killed_at.append(sum(streams.chunks))
        ray.kill(replicas[max(range(len(replicas)), key=held.__getitem__)], no_restart=True)

    results = streams.run(kill_one)
    _check(results, references)
    assert killed_at[0] < len(PROMPTS) * (MAX_NEW // 2)  # the kill really came mid-run
    after = two_replicas.get("/v1/stats").json()["ingress"]
    # the killed replica held some of the streams: they went on elsewhere
    assert after["continuations"] > before["continuations"] and after["given_up"] == before["given_up"], after
    assert wait_for(lambda: coordinator_replicas(APP) == 2, timeout=90, interval=1)  # Serve replaced it


def test_redeploy_with_a_changed_config_loses_no_request(server, two_replicas, references):
    """`serve.run` with another request_timeout_s replaces every replica (ingress and coordinators)
    while the streams run: old replicas drain or hand their requests over; none is lost."""
    old = {a._actor_id for a in replica_actors(APP)}
    done = threading.Event()

    def redeploy() -> None:
        deploy_app(APP, ROUTE, **{**TWO, "request_timeout_s": 91.0})  # blocks until the new replicas run
        done.set()

    streams = Streams(f"{server}{ROUTE}")
    results = streams.run(redeploy)
    _check(results, references)
    assert done.is_set()
    assert wait_for(lambda: not old & {a._actor_id for a in replica_actors(APP)}, timeout=120, interval=1)
