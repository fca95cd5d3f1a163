"""The benchmarks that send requests to a running app load loopback only, unless told otherwise."""
import importlib

import pytest

from specserve.bench.sse import is_loopback

URL_BENCHES = ["http", "features", "ingress", "overload", "mix", "soak"]


@pytest.mark.parametrize("url, local", [
    ("http://127.0.0.1:8000", True), ("http://127.9.8.7:80", True), ("http://localhost:8000", True),
    ("http://[::1]:8000/v1", True), ("http://10.0.0.1:8000", False), ("http://192.168.1.2", False),
    ("http://example.com", False), ("http://127.0.0.1.example.com", False), ("http://[::2]:8000", False),
])
def test_is_loopback_takes_the_whole_loopback_range_and_nothing_else(url, local):
    assert is_loopback(url) is local


@pytest.mark.parametrize("bench", URL_BENCHES)
def test_a_bench_refuses_a_remote_url_before_it_sends_anything(bench, monkeypatch, capsys):
    module = importlib.import_module(f"specserve.bench.{bench}")
    sent = []
    monkeypatch.setattr("httpx.Client.send", lambda *a, **k: sent.append(a))
    monkeypatch.setattr("httpx.AsyncClient.send", lambda *a, **k: sent.append(a))
    with pytest.raises(SystemExit) as exit_:
        module.main(["--url", "http://10.1.2.3:8000"])
    assert exit_.value.code == 2
    assert "is not loopback; pass --allow-remote" in capsys.readouterr().err
    assert sent == []
