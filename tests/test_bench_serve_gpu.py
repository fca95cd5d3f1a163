"""`specserve bench serve-gpu`: its rows, table and plot, its app config, and one tiny run of the
real Serve app against the in-process engine on the CPU (in a child process: a Ray of its own)."""
import json
import subprocess
import sys

import pytest

from specserve.bench import serve_gpu
from specserve.config import AppConfig


def test_app_args_validate_with_planted_acceptance_and_gpu_shares(tmp_path):
    args = serve_gpu.parse_args(["--out", str(tmp_path)])
    config = AppConfig.model_validate(serve_gpu.app_args(args, "pipelined", 0.8, tmp_path / "refs.jsonl", gpu=True))
    assert config.target.shape == "llama-7b" and config.target.peaked and config.draft.shape == "llama-1b"
    assert config.speculation.pipelined and config.speculation.transport == "compiled_graph"
    assert config.speculation.planted.alpha == 0.8 and not config.speculation.adaptive
    assert config.target_worker.num_gpus + config.draft_worker.num_gpus == 1.0
    assert config.max_batch_size == 32 and args.levels == [1, 8, 32]
    tiny = serve_gpu.parse_args(["--tiny"])
    config = AppConfig.model_validate(serve_gpu.app_args(tiny, "sequential", 0.6, tmp_path / "r", gpu=False))
    assert config.target.dtype == "float32" and config.target_worker.num_gpus == 0 and not config.speculation.pipelined


def test_a_row_is_same_only_when_every_token_is_and_meets_its_engine_row():
    refs = [[1, 2, 10, 11, 12], [3, 4, 20, 21, 22]]
    results = [{"tokens": [10, 11, 12], "ttft": 0.01, "itl": 0.002, "speculation": {"num_draft_tokens": 4,
                                                                                     "num_accepted_tokens": 2}},
               {"tokens": [20, 21, 22], "ttft": 0.03, "itl": 0.004, "speculation": {}}]
    stats = {"rpc_overhead_p50_ms": 0.4, "overhead_p99_ms": 2.0, "transport": "compiled_graph", "steps": 8,
             "graph_steps": 6,
             "memory": {"target": {"cuda_peak_allocated_bytes": 3 << 30}, "draft": {"cuda_peak_allocated_bytes": 1 << 30}}}
    row = serve_gpu.served_row("sequential", 0.8, 2, results, 0.5, stats, refs, prompt_len=2)
    assert row["same"] and row["tokens_per_s"] == 12.0 and row["acceptance"] == 0.5
    assert row["coordination_p50_ms"] == 0.4 and row["overhead_p99_ms"] == 2.0 and row["cuda_peak_bytes"] == 4 << 30
    assert row["graph_share"] == 0.75
    results[1]["tokens"] = [20, 21, 23]
    assert not serve_gpu.served_row("sequential", 0.8, 2, results, 0.5, stats, refs, prompt_len=2)["same"]
    engine = [{"mode": "sequential", "alpha": 0.8, "concurrency": 2, "tokens_per_s": 24.0},
              {"mode": "γ=0", "alpha": None, "concurrency": 2, "tokens_per_s": 12.0}]
    assert serve_gpu.with_engine(row, engine, "pipelined", 0.8)["ratio"] == 0.5
    assert serve_gpu.with_engine({**row, "alpha": None}, engine, "γ=0", None)["ratio"] == 1.0
    lines = serve_gpu.table([row]).splitlines()
    assert lines[0].split()[:3] == ["mode", "α", "acc"] and "0.50" in lines[1] and "4.0" in lines[1]
    assert "0.75" in lines[1]


def test_a_failed_level_is_a_row_and_the_report_is_saved_as_it_goes(tmp_path):
    """A level that fails on the GPU machine must not cost the rows already measured: each row
    rewrites DIR/serve-gpu.json (partial until the end), a failure is a row of its own."""
    args = serve_gpu.parse_args(["--tiny", "--out", str(tmp_path)])
    engine = {"device": "cpu", "rows": [{"mode": "γ=0", "alpha": None, "concurrency": 1, "same": True}],
              "peak_cuda_bytes": None}
    progress = serve_gpu.Progress(args, engine, began=0.0)
    progress.add({"mode": "sequential", "alpha": 0.8, "concurrency": 1, "tokens_per_s": 10.0, "itl_p50_ms": 5.0,
                  "same": True})
    saved = json.loads((tmp_path / "serve-gpu.json").read_text())
    assert saved["partial"] and len(saved["served"]) == 1 and saved["all_same"]
    progress.add({"mode": "sequential", "alpha": 0.8, "concurrency": 8, "same": False, "error": "RuntimeError: boom"})
    saved = json.loads((tmp_path / "serve-gpu.json").read_text())
    assert len(saved["served"]) == 2 and not saved["all_same"]
    assert "c=8: FAILED RuntimeError: boom" in serve_gpu.table(saved["served"])
    assert not progress.save(partial=False)["partial"]
    why = serve_gpu.plot({**saved, "shapes": "tiny"}, tmp_path / "p.png")  # (the failed row is left out)
    assert why is None or "matplotlib" in why


@pytest.mark.serve
def test_tiny_run_serves_the_engines_tokens(tmp_path):
    """The whole bench on tiny shapes: in-process engine, then the Serve app pipelined on the
    compiled graph at α 0.8, every served token the engine's, a table, JSON and a plot."""
    out = tmp_path / "out"
    argv = ["--tiny", "--out", str(out), "--modes", "pipelined", "--alphas", "0.8", "--concurrency", "1,3",
            "--max-tokens", "10"]
    done = subprocess.run([sys.executable, "-m", "specserve.bench.serve_gpu", *argv], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "serve-gpu.json").read_text())
    served = report["served"]
    assert [(r["mode"], r["concurrency"]) for r in served] == [("pipelined", 1), ("pipelined", 3), ("γ=0", 1),
                                                               ("γ=0", 3)]
    assert report["all_same"] and all(r["same"] for r in served)
    assert all(r["tokens_per_s"] > 0 and r["engine_tokens_per_s"] > 0 for r in served)
    assert served[0]["transport"] == "compiled_graph" and served[0]["acceptance"] > 0
    shares = [(r["mode"], r["concurrency"], r["graph_share"], r["warmups"], r["graph_solo"]) for r in served]
    assert all(r["graph_share"] == 1.0 for r in served), shares  # every timed step on the compiled graph
    assert not report["partial"] and (out / "ray-warnings.txt").exists()
    steps = report["engine"][0]["steps"]  # where the in-process engine's timed steps went
    assert steps["steps"] > 0 and steps["graphs_captured"] == 0 and steps["step_ms"] > 0
    assert {(r["mode"], r["concurrency"]) for r in report["engine"]} == {(m, c) for m in ("γ=0", "sequential")
                                                                        for c in (1, 3)}
    assert "every served and in-process token the same: True" in done.stdout
    assert (out / "serve-gpu.png").exists()
    assert serve_gpu.main(["--plot", str(out / "serve-gpu.json")]) == 0


@pytest.mark.parametrize("transport, passes, warmups", [
    ("compiled_graph", [0.1, 0.5, 1.0, 1.0], 3),  # warmed until a pass ran on the graph
    ("compiled_graph", [1.0, 0.2], 1),
    ("compiled_graph", [0.0, 0.0, 0.0, 0.0], 3),  # at most MAX_WARMUPS, then timed anyway
    ("actor_calls", [0.0, 0.0], 1),  # no graph to wait for
    ("compiled_graph", [1.0, "reshaped", 1.0, 1.0], 3),  # a pass the graph changed shape in is not timed
    ("compiled_graph", ["reshaped", 1.0, 1.0], 2),  # ... nor does it settle the level
    ("compiled_graph", [1.0, "reshaped", 1.0, "reshaped"], 3),  # at most MAX_WARMUPS all the same
])
def test_a_level_is_timed_once_its_warm_up_ran_on_the_graph(monkeypatch, transport, passes, warmups):
    """A replica whose steps stop drafting reshapes its compiled graph for the target alone and
    steps over plain calls while it rebuilds (on a CPU run, the γ=0 rows at 8 streams ran 6% of
    their timed steps on the graph; at 3 streams, 0% where the 64th step without drafts fell in
    the timed pass): a level's timed pass waits until a warm-up pass ran on the graph, starts
    once the graph is built, and is never a pass in which the graph changed shape."""
    import asyncio

    kinds = iter(passes)
    calls, state = [], {"reshapes": 0, "polls": 0, "in_pass": False}

    class Reply:
        def __init__(self, body=None):
            self.body = body

        def raise_for_status(self):
            pass

        def json(self):
            return self.body

    class Client:
        async def post(self, path):
            calls.append(path)
            state["in_pass"] = True
            return Reply()

        async def get(self, path):
            if not state["in_pass"]:  # before a pass: a graph torn down by the last reshape is built again
                state["polls"] += 1
                ready = state["polls"] % 2 == 0 or state["reshapes"] == 0
                return Reply({"graph_ready": ready, "graph_builds": 1, "graph_reshapes": state["reshapes"]})
            state["in_pass"] = False
            kind = next(kinds)
            reshaped = kind == "reshaped"
            state["reshapes"] += reshaped
            share = 0.0 if reshaped else kind
            return Reply({"steps": 10, "graph_steps": round(10 * share), "graph_reshapes": state["reshapes"],
                          "pass": len(calls)})

    async def stream(client, prompt, max_tokens, gamma):
        return {"tokens": [1], "ttft": 0.0, "itl": None, "speculation": {}}

    monkeypatch.setattr(serve_gpu, "one_stream", stream)
    args = serve_gpu.parse_args(["--tiny", "--transport", transport])
    results, wall, stats = asyncio.run(serve_gpu.level(Client(), args, [[1, 2]] * 4, 2, None))
    assert stats["bench_warmups"] == warmups and stats["pass"] == warmups + 1 == len(calls)
    assert len(results) == 2 and wall >= 0
    if "reshaped" in passes and passes.index("reshaped") < len(calls) - 1:
        assert state["polls"] > len(calls)  # the graph torn down by the reshape was waited for
