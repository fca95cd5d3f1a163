"""`specserve bench memory --tiny` runs end to end on CPU: both layouts, every section, the same
tokens, and a JSON report whose figures say what the table says."""
import json

from specserve.bench import memory


def test_tiny_run_reports_every_section(tmp_path):
    out = tmp_path / "memory.json"
    code = memory.main(["--tiny", "--budget", "2048", "--long", "400", "--short", "12", "--new", "8",
                        "--batch", "4", "--uniform-prompt", "32", "--system", "200", "--later", "2",
                        "--repeats", "1", "--out", str(out)])
    report = json.loads(out.read_text())
    assert code == 0 and report["same_mix"] and report["same_uniform"] and report["prefix"]["same_tokens"]
    assert report["mix"]["paged"]["peak_running"] > report["mix"]["dense"]["peak_running"]
    assert report["prefix"]["paged+prefix"]["later_ttft_p50_s"] > 0
    assert all(report["uniform"][name]["tokens_per_s"] > 0 for name in ("dense", "paged"))


def test_uniform_runs_each_layout_under_each_attention(tmp_path, capsys):
    out = tmp_path / "memory.json"
    code = memory.main(["--tiny", "--budget", "2048", "--long", "200", "--short", "4", "--new", "6",
                        "--batch", "3", "--uniform-prompt", "24", "--system", "64", "--later", "1",
                        "--repeats", "1", "--attention", "mask,flex", "--out", str(out)])
    report = json.loads(out.read_text())
    assert code == 0 and report["same_uniform"]
    assert sorted(report["uniform"]) == ["dense flex", "dense mask", "paged flex", "paged mask"]
    assert "uniform paged flex / dense flex" in capsys.readouterr().out


def test_a_windowed_model_runs_more_requests_at_once_when_it_gives_blocks_back(tmp_path):
    """`specserve bench windows` on the CPU's small Mistral-style shape, keys gathered as on a GPU:
    the same tokens every way, and at a budget that holds three whole requests, giving back what the
    window passed runs all four (whether windowed layers gather their windows or every block)."""
    from specserve.bench import windows

    out = tmp_path / "windows.json"
    code = windows.main(["--requests", "4", "--prompt", "200", "--new", "24", "--budget", "768", "--window", "32",
                         "--gathered", "--settings", "kept,whole prompts,whole reads", "--out", str(out)])
    report = json.loads(out.read_text())
    assert code == 0 and report["same_tokens"] and report["window"] == 32
    given, kept, whole = report["given back"], report["kept"], report["whole reads"]
    assert given["peak_running"] == 4 and kept["peak_running"] < 4 and given["preemptions"] == 0
    assert whole["peak_running"] == 4 and whole["preemptions"] == 0
    assert report["whole prompts"]["peak_running"] == 4  # (prompts counted whole until prefilled)
    assert given["long_ttft_s"] is None  # (no --long)
    assert all(len(t) == 24 for t in given["tokens"].values())


def test_a_long_windowed_prompt_is_admitted_by_the_chunk_it_takes(tmp_path):
    """`bench windows --long`: two 600-token prompts queued behind three short requests, at a
    budget where the second long prompt, counted whole, waits for others to finish: counted by
    the chunk each cache takes next, all five run at once (no preemption, the same tokens)."""
    from specserve.bench import windows

    out = tmp_path / "windows.json"
    code = windows.main(["--requests", "5", "--prompt", "16", "--new", "48", "--long", "2", "--long-prompt", "600",
                         "--budget", "768", "--window", "32", "--chunk", "64", "--settings", "whole prompts",
                         "--out", str(out)])
    report = json.loads(out.read_text())
    assert code == 0 and report["same_tokens"] and "kept" not in report
    given, whole = report["given back"], report["whole prompts"]
    assert given["peak_running"] == 5 and whole["peak_running"] < 5, (given["peak_running"], whole["peak_running"])
    assert given["preemptions"] == 0 and given["long_ttft_s"] is not None
    assert all(len(t) == 48 for t in given["tokens"].values())


def test_a_hybrid_model_runs_more_requests_in_the_same_kv_bytes(tmp_path):
    """`bench windows --hybrid` (Gemma 3's layout, small): with the windowed layers in a pool of
    their own, the full layers' budget grows by what they no longer hold, in the same KV bytes
    as one pool for all, so more requests run at once; the same tokens every way."""
    from specserve.bench import windows

    out = tmp_path / "windows.json"
    code = windows.main(["--hybrid", "--requests", "6", "--prompt", "320", "--new", "16", "--budget", "1536",
                         "--window", "16", "--chunk", "32", "--settings", "kept,whole reads", "--out", str(out)])
    report = json.loads(out.read_text())
    assert code == 0 and report["same_tokens"]
    given, kept, whole = report["given back"], report["kept"], report["whole reads"]
    assert kept["budget"] == 1536 and given["budget"] > 1536 and given["kv_bytes"] <= kept["kv_bytes"]
    assert given["peak_running"] > kept["peak_running"] and whole["peak_running"] == given["peak_running"]
    assert all(len(t) == 16 for t in given["tokens"].values())
