"""The engine benchmark runs end to end (on tiny models) and its speculative rows are lossless."""
import json

from specserve.bench import engine as bench


def test_engine_bench_smoke(tmp_path, capsys):
    out = tmp_path / "engine.json"
    args = ["--model", "tiny", "--gammas", "0,2", "--prompts", "2", "--max-new-tokens", "8",
            "--batches", "1,4", "--reps", "2", "--out", str(out)]
    assert bench.main(args) == 0
    result = json.loads(out.read_text())
    assert all(r["identical"] for r in result["rows"])
    assert all(t["speculative"]["identical"] for t in result["throughput"])
    assert {r["label"] for r in result["rows"]} >= {"γ=0", "γ=2", "auto", "HF generate", "HF assisted"}
    assert result["costs"]["c"] > 0 and "bound_v" in capsys.readouterr().out
