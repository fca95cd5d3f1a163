"""Smoke test of the drafter benchmark on tiny models: every method runs, outputs match, JSON is written."""
import json

import torch

from specserve.bench.drafters import main


def test_drafter_bench_tiny(tmp_path, capsys):
    threads = torch.get_num_threads()
    out = tmp_path / "drafters.json"
    try:
        code = main(["--model", "tiny", "--per-category", "1", "--max-new-tokens", "8", "--reps", "3",
                     "--threads", "1", "--layer-skip-config", str(tmp_path / "missing.json"), "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    assert "untuned baseline" in capsys.readouterr().out
    result = json.loads(out.read_text())
    methods = {r["method"] for r in result["results"]}
    assert {"target-only", "draft model", "layer skip", "prompt lookup", "HF generate", "HF lookup(10)"} <= methods
    assert {r["category"] for r in result["results"]} == {"chat", "code", "summarise", "extraction"}
    assert all(r["identical"] for r in result["results"])
