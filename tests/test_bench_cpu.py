"""Smoke test of the CPU kernels benchmark on the offline SmolLM2 pair: both tables, every output
(HF generate's too) equal to the target alone with the kernels off, JSON written."""
import json

import torch

from specserve.bench.cpu import main


def test_cpu_bench_smollm2(tmp_path, capsys):
    threads = torch.get_num_threads()
    out = tmp_path / "cpu.json"
    try:
        code = main(["--per-category", "1", "--max-new-tokens", "6", "--reps", "1", "--threads", "1",
                     "--lookup-min-n", "none", "3", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    printed = capsys.readouterr().out
    assert "v(2)" in printed and "vs target on" in printed
    result = json.loads(out.read_text())
    rows = result["end_to_end"]
    assert {(r["method"], r["kernels"]) for r in rows} == {("HF generate", "-")} | {
        (m, k) for m in ("target-only", "draft model", "feature head", "feature head +lookup3") for k in ("off", "on")}
    assert "HF generate" in printed and "same tokens: yes" in printed
    assert {r["category"] for r in rows} == {"chat", "code", "summarise"}
    assert all(r["identical"] for r in rows)
    assert set(result["forward_seconds"]) == {"target-only", "draft model", "feature head", "feature head +lookup3"}
