"""The GPU benchmark runs on CPU with --tiny and imports nothing of Ray/FastAPI/pydantic (its
planted drafter is tested in test_planted.py)."""
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from specserve.bench import gpu


def test_tiny_run_without_serving_imports(tmp_path):
    out = tmp_path / "gpu.json"
    script = textwrap.dedent(f"""
        import sys
        from specserve.bench import gpu
        assert gpu.main(["--tiny", "--sections", "random", "--alphas", "0.5,0.9", "--out", {str(out)!r}]) == 0
        leaked = {{m.split(".")[0] for m in sys.modules}} & {{"ray", "fastapi", "pydantic", "starlette"}}
        assert not leaked, leaked
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "bound_v" in done.stdout and "eff." in done.stdout
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert {r["gamma"] for r in rows} == {0, 2, 4, None} and {r["batch"] for r in rows} == {1, 4}
    assert all(r["identical"] for r in rows)  # lossless against the target-only run
    assert all(r.get("off_reference", 0) == 0 for r in rows)
    for r in rows:
        assert r["bound_v"] > 0 and r["speedup"] > 0 and r["c"] > 0
    anchors = {(a["batch"], a["anchor"].split(" (")[0]) for a in result["anchors"]}
    assert {(b, n) for b in (1, 4) for n in ("HF generate() eager", "bandwidth limit")} <= anchors
    assert all(a["identical"] in (True, None) for a in result["anchors"])  # HF's greedy tokens are the engine's
    # what each adaptive engine learnt, for `bench policy --costs gpu.json --select random/4/0.9`
    from specserve.bench.policy import Costs, compare

    costs = Costs.load(out, "random/4/0.9")
    assert costs.seconds("target", 4) > 0 and costs.seconds("draft", 4) > 0 and costs.overhead >= 0
    assert set(result["costs"]["random"]["1"]["policy"]) == {"0.5", "0.9"}
    assert compare(costs, 4, 0.9, max_gamma=2, rounds=1, tokens=16, seeds=1)["adaptive"].rate > 0


def test_smollm2_section_skips_with_a_message(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu, "_load_smollm2", lambda device, dtype: "FileNotFoundError: no checkpoint")
    assert gpu.main(["--tiny", "--sections", "smollm2", "--out", str(tmp_path / "g.json")]) == 0
    assert "smollm2 section skipped: FileNotFoundError: no checkpoint" in capsys.readouterr().out


def test_gpu_checks_run_every_check_on_a_cpu(tmp_path):
    """`bench gpu-checks` on a CPU (eager: no graphs) runs every configuration to the end, and its
    report says what its table says."""
    from specserve.bench import gpu_checks

    out = tmp_path / "checks.json"
    assert gpu_checks.main(["--device", "cpu", "--max-new", "8", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    families = [f[0] for f in gpu_checks.FAMILIES]
    assert [r["check"] for r in rows] == ["target alone = HF generate", *gpu_checks.CHECKS, *families,
                                          "q placed, read by another process"]
    assert rows[0]["ok"] and rows[0]["greedy_same"]  # the reference is HF's own greedy
    assert all(r["ok"] and r["greedy_same"] and r["sampled_same"] for r in rows[1:1 + len(gpu_checks.CHECKS)])
    assert all(r["ok"] and r["greedy_same"] for r in rows[-1 - len(families):-1])  # families against HF's generate
    assert rows[-1]["ok"] and rows[-1]["read_same"] and rows[-1]["read_ms"] > 0  # (shared memory on a CPU)


def test_a_check_that_breaks_is_a_row_of_its_own():
    """A device run cannot be rerun cheaply: a check that raises becomes its row's error, timed,
    and the run goes on."""
    from specserve.bench import gpu_checks

    with gpu_checks.checked({"check": "x"}) as row:
        row["greedy_same"] = True
        raise RuntimeError("CUDA error: an illegal memory access")
    assert row["ok"] is False and row["error"].startswith("RuntimeError: CUDA error")
    assert row["greedy_same"] and row["seconds"] >= 0


def test_paged_layout_pools_are_sized_by_the_batch(tmp_path):
    """With --kv-block-size and no --kv-pool, each batch's engines get a pool of what admission
    counts for that batch (every engine of a batch is alive at once, so a fixed large pool per
    engine would not fit a GPU at 7B shapes), and the paged run stays lossless."""
    from specserve.engine.admission import allocation

    layout = gpu.Layout(kv_block_size=16)
    sized = layout.for_batch(16, 256, 6)
    assert sized.kv_pool == allocation([256 + 2 * 6 + 3] * 16, 16) == (1 + 16 * 17) * 16  # 272 positions: 17 blocks each
    # at batch 1 an adaptive engine's calibration row (16 + 64 + 1 positions) needs more than the request
    assert layout.for_batch(1, 24, 2).kv_pool == allocation([gpu.calibration_row(1, 2)], 16) == (1 + 6) * 16
    assert gpu.Layout(kv_block_size=16, kv_pool=999).for_batch(16, 256, 6).kv_pool == 999  # asked for: kept
    assert gpu.Layout().for_batch(16, 256, 6).kv_pool is None  # dense: nothing to size
    try:
        layout.runner(gpu.random_llama("tiny-target", "cpu", torch.float32, 0, peaked=False))
    except ValueError as e:
        assert "unsized" in str(e)
    else:
        raise AssertionError("an unsized paged pool was accepted")
    out = tmp_path / "paged.json"
    assert gpu.main(["--tiny", "--sections", "random", "--alphas", "0.9", "--random-batches", "1,4",
                     "--kv-block-size", "4", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert rows and all(r["identical"] for r in rows)


def test_plain_bench_rehearses_its_layouts_on_a_cpu(tmp_path):
    """`bench plain --tiny`: every layout and batch gets a row with its ratios to the anchors, and
    every layout decodes the first one's tokens."""
    from specserve.bench import plain

    out = tmp_path / "plain.json"
    assert plain.main(["--tiny", "--layouts", "eager:mask,eager:flex,eager:mask:7", "--max-new-tokens", "8",
                       "--repeats", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["batch"], r["layout"]) for r in rows] == [
        (b, name) for b in (1, 4) for name in ("eager, mask", "eager, flex", "eager, mask, paged 7")]
    assert all(r["same_as_first"] and r["static_loop_same"] for r in rows)
    assert all(r["vs_static_loop"] > 0 and r["vs_limit"] > 0 for r in rows)
    assert "/ static loop" in result["table"]
    with pytest.raises(ValueError, match="execution:attention"):
        plain.parse_layouts("graph:mask:16:x")
    with pytest.raises(ValueError, match="named twice"):
        plain.parse_layouts("graph:mask,graph:mask")


def test_plain_bench_reports_a_failing_layout_in_its_place(tmp_path):
    """A layout that cannot build (fused graphs need a CUDA device) is a row of its own, in the order
    asked for; the layouts beside it are measured, and the run's status says one failed."""
    from specserve.bench import plain

    out = tmp_path / "plain.json"
    assert plain.main(["--tiny", "--layouts", "eager:mask,fused-graph:mask,eager:flex", "--batches", "1",
                       "--max-new-tokens", "4", "--repeats", "1", "--profile", "--out", str(out)]) == 1
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [r["layout"] for r in rows] == ["eager, mask", "fused-graph, mask", "eager, flex"]
    assert "CUDA" in rows[1]["error"] and "tokens_per_second" not in rows[1]
    assert rows[0]["same_as_first"] and rows[2]["same_as_first"]
    # --profile: each layout that ran and the static-loop anchor once more under the profiler
    profiled = [r["profile"] for r in (rows[0], rows[2], result["anchors"][0])]
    assert all(p["wall_ms"] > 0 and (tmp_path / p["table"]).read_text().count("aten::") > 5 for p in profiled)
    assert "profile" not in rows[1] and "kernel ms" in result["table"]


def test_bench_engines_state_a_context_that_holds_their_runs():
    """Benches' engines state their context (`Layout.for_batch`), so that in graph mode their
    caches are sized once, before capture, and never grow under the warm-up (a growth drops every
    graph, and the timed runs would capture them again: the H200's speculative rows at batch 8 and
    32). The context holds prompt + new tokens + drafts, and an adaptive engine's calibration."""
    target = gpu.random_llama("tiny-target", "cpu", torch.float32, 0, peaked=True)
    for batch, positions, max_gamma in ((1, 256, 3), (16, 40, 6), (4, 300, 0)):
        layout = gpu.Layout().for_batch(batch, positions, max_gamma)
        assert layout.max_model_len >= max(positions + max_gamma, gpu.calibration_row(batch, max_gamma))
        engine = gpu.build_engine(target, None, 0, 0, batch, layout)
        assert engine.verifier.runner.stated_max_model_len == engine.max_model_len == layout.max_model_len
    paged = gpu.Layout(kv_block_size=16).for_batch(4, 100, 2)
    assert paged.max_model_len and paged.kv_pool  # (a paged pool is sized as before)
