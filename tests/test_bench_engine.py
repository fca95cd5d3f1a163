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


def test_ttft_bench_runs_both_orders_and_the_folded_one_runs_one_forward(tmp_path, capsys):
    """`bench ttft` (tiny models): the first token after one target forward when the first step
    carries the prompt's last chunk, two in the earlier order, the same tokens either way."""
    from specserve.bench import ttft

    out = tmp_path / "ttft.json"
    assert ttft.main(["--model", "tiny", "--drafter", "draft", "--count", "2", "--long", "40", "--rounds", "1",
                      "--max-tokens", "6", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    forwards = {(r["prompts"], r["order"]): r["target_forwards_to_first_token"] for r in rows}
    assert forwards == {(kind, order): n for kind in ("chat", "long") for order, n in zip(ttft.ORDERS, (2, 1))}
    assert all(r["same_tokens"] for r in rows) and "TTFT p50" in capsys.readouterr().out
