"""`bench http` against a stand-in server (httpx's mock transport): levels interleaved over rounds,
rows summed over their passes, the speedup given summed and round by round."""
from __future__ import annotations

import json

import httpx
import pytest

from specserve.bench import http as bench_http


def fake_server(seen: list) -> httpx.MockTransport:
    """Answers /v1/models, /v1/stats(/reset) and streamed completions of `max_tokens` one-token
    chunks; `seen` gets each completion's (num_speculative_tokens or "default", concurrency tag)."""

    def handle(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        if path == "/v1/stats/reset":
            return httpx.Response(200, json={})
        if path == "/v1/stats":
            return httpx.Response(200, json={"step_wall_p50_ms": 1.0})
        body = json.loads(request.content)
        gamma = body.get("num_speculative_tokens", "default")
        seen.append(gamma)
        n = body["max_tokens"]
        drafted = 0 if gamma == 0 else n
        chunks = [{"choices": [{"text": "x"}]} for _ in range(n)]
        chunks.append({"choices": [], "usage": {"completion_tokens": n, "prompt_tokens": 3},
                       "speculation": {"num_draft_tokens": drafted, "num_accepted_tokens": drafted // 2}})
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handle)


@pytest.fixture
def served(monkeypatch):
    seen: list = []
    real = httpx.AsyncClient
    monkeypatch.setattr(bench_http.httpx, "AsyncClient",
                        lambda **kw: real(transport=fake_server(seen), **kw))
    return seen


def test_rounds_interleave_the_gamma_settings_and_rows_sum_their_passes(served, tmp_path):
    out = tmp_path / "http.json"
    assert bench_http.main(["--concurrency", "1,2", "--requests", "2", "--max-tokens", "3", "--rounds", "3",
                            "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    warm_up, passes = served[0], [served[i:i + 2] for i in range(1, len(served), 2)]
    assert warm_up == "default" and len(passes) == 3 * 2 * 2  # rounds x levels x γ settings, 2 requests each
    firsts = [p[0] for p in passes[::2]]  # each (round, level)'s first γ setting
    assert firsts == ["default", "default", 0, 0, "default", "default"]  # the order turns every other round
    rows = {(r["gamma"], r["concurrency"]): r for r in report["rows"]}
    assert set(rows) == {("default", 1), ("default", 2), (0, 1), (0, 2)}
    for row in rows.values():
        assert row["requests"] == 6 and row["output_tokens"] == 18 and len(row["round_tokens_per_s"]) == 3
        assert abs(row["tokens_per_s"] - 18 / row["wall_s"]) < 1e-9
    assert rows["default", 1]["acceptance_rate"] == 1 / 3 and rows[0, 1]["acceptance_rate"] is None
    speedup = report["speedup_vs_gamma0"]["1"]
    assert len(speedup["rounds"]) == 3 and speedup["speedup"] > 0
    assert report["rounds"] == 3


def test_rounds_must_be_positive(served, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_http.main(["--rounds", "0"])
    assert exit_.value.code == 2 and "--rounds" in capsys.readouterr().err and served == []


def test_a_setting_given_twice_runs_once_a_round(served, tmp_path):
    out = tmp_path / "http.json"
    assert bench_http.main(["--concurrency", "1", "--requests", "1", "--max-tokens", "2", "--gammas", "0,default,0",
                            "--rounds", "2", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["gamma"] for r in rows] == [0, "default"] and all(r["requests"] == 2 for r in rows)
    assert served[1:] == [0, "default", "default", 0]
