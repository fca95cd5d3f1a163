"""Workers on different nodes: a 3-node Ray cluster on this machine (ray.cluster_utils.Cluster), the
TargetWorker pinned to node A and the DraftWorker to node B by custom resources that stand in for
GPUs, a greedy request over HTTP, the output token-identical to the in-process engine.

Ray can be initialised once per process and tests/test_serve.py holds a session-wide Ray, so the
cluster lives in a subprocess (tests/multinode_scenario.py) that prints a JSON result. ~1 min.
Run: pytest -m serve tests/test_multinode.py
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest

from models import hf_greedy
from multinode_scenario import NODE_A, NODE_B, RESULT_MARKER, app_args, node_loss_args

pytestmark = [pytest.mark.serve, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
SCENARIO = Path(__file__).with_name("multinode_scenario.py")
PROMPTS = ["Hello", "The quick brown fox", "héllo wörld → ok"]
MAX_NEW = 24
DEADLINE_S = 150  # the scenario's own limit; the subprocess is killed 45 s after that


def expected_outputs(args: dict | None = None, prompts: list[str] = PROMPTS, max_new: int = MAX_NEW,
                     check: bool = True) -> list[list[int]]:
    """The in-process SpeculativeEngine on the same config (checked against plain greedy decoding)."""
    from specserve import SamplingParams, SpeculativeEngine
    from specserve.config import load_app_config
    from specserve.models.loading import load_draft, load_target
    from specserve.models.tiny import byte_tokenizer

    config = load_app_config(args or app_args())
    target, draft = load_target(config.target), load_draft(config.draft)
    tok = byte_tokenizer()
    engine = SpeculativeEngine(target, draft, config.speculation.num_speculative_tokens, adaptive=False,
                               max_model_len=config.max_model_len)
    ids = [tok(p).input_ids for p in prompts]
    outs = engine.generate(ids, SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True))
    for prompt_ids, out in zip(ids, outs):
        assert not check or out.token_ids == hf_greedy(target, prompt_ids, max_new)
    return [out.token_ids for out in outs]


def kill_stragglers(marker: str, grace_s: float = 5.0) -> list[int]:
    """SIGKILL, by pid, any process still carrying this run's private RAY_TMPDIR in its environment
    (only the scenario's Ray processes do); normally there are none. Returns the pids killed."""
    def find() -> list[int]:
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != os.getpid():
                try:
                    if marker.encode() in (entry / "environ").read_bytes().split(b"\0"):
                        pids.append(int(entry.name))
                except OSError:  # gone, or not ours to read
                    pass
        return pids

    deadline = time.monotonic() + grace_s
    while (pids := find()) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def run_scenario(spec: dict | None = None, expected=expected_outputs, deadline_s: float = DEADLINE_S) -> dict:
    ray_tmp = tempfile.mkdtemp(prefix="ssmn-", dir="/tmp")  # short: Ray's unix sockets live under it
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": ray_tmp, "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # keep ray.init on 127.0.0.1: see the scenario's docstring
    env.pop("RAY_ADDRESS", None)  # the scenario makes its own cluster
    # port 0: the scenario picks one once its cluster is up (picked here, before, Ray once took it first)
    spec = {"port": 0, "prompts": PROMPTS, "max_tokens": MAX_NEW, **(spec or {}), "deadline_s": deadline_s}
    proc = subprocess.Popen([sys.executable, str(SCENARIO), json.dumps(spec)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        references = expected()  # meanwhile, in this process
        try:
            stdout, stderr = proc.communicate(timeout=deadline_s + 45)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                stdout, stderr = proc.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                stdout, stderr = proc.communicate()
            pytest.fail(f"multi-node scenario timed out; stderr tail:\n{stderr[-4000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        stragglers = kill_stragglers(f"RAY_TMPDIR={ray_tmp}")
        shutil.rmtree(ray_tmp, ignore_errors=True)
    if stragglers:
        warnings.warn(f"killed {len(stragglers)} Ray processes the scenario left behind: {stragglers}")
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_MARKER)]
    assert lines, f"no result (rc {proc.returncode}); stderr tail:\n{stderr[-4000:]}"
    result = json.loads(lines[-1][len(RESULT_MARKER):])
    assert result["ok"], f"{result['error']}\n{result['traceback']}\nstderr tail:\n{stderr[-4000:]}"
    result["expected"] = references
    return result


def test_workers_on_two_nodes_match_engine():
    result = run_scenario()

    # lossless across nodes: HTTP output == in-process engine == plain greedy, with real speculation
    got = [o["token_ids"] for o in result["outputs"]]
    assert got == result["expected"]
    assert all(o["speculation"]["num_draft_tokens"] > 0 for o in result["outputs"])

    # three live nodes: the head and one per fake GPU
    nodes = result["nodes"]
    assert len(nodes) == 3 and sum(n["head"] for n in nodes.values()) == 1
    node_a = [nid for nid, n in nodes.items() if NODE_A in n["resources"]]
    node_b = [nid for nid, n in nodes.items() if NODE_B in n["resources"]]
    assert len(node_a) == 1 and len(node_b) == 1 and node_a != node_b

    # the actors themselves report their nodes: target on A, draft on B
    assert result["workers"] == {"target": node_a, "draft": node_b}

    # and the coordinator's placement group put the bundles there, with the custom resources
    (group,) = result["placement_groups"]
    assert group["strategy"] == "SPREAD"
    assert group["bundles"]["1"].get(NODE_A) == 1 and group["bundles"]["2"].get(NODE_B) == 1
    assert group["bundles_to_node_id"]["1"] == node_a[0] and group["bundles_to_node_id"]["2"] == node_b[0]
    print("timings", result["timings"])


LOSS_PROMPTS = [f"stream {i}: the node under it may go at any moment" for i in range(16)]
LOSS_MAX_NEW = 400


def test_a_lost_node_loses_no_stream():
    """Two groups, 16 greedy streams. The node of one group's target is removed mid-stream: that
    group gives its requests up within seconds and the other group continues them; when an A node
    comes back, Serve rebuilds the group. Then a draft's node is removed: its group goes target-only.
    Every stream completes with the reference tokens, no stream pauses more than 10 s, /health
    stays 200 (the other group serves)."""
    result = run_scenario({"scenario": "node_loss", "prompts": LOSS_PROMPTS, "max_tokens": LOSS_MAX_NEW},
                          lambda: expected_outputs(node_loss_args(), LOSS_PROMPTS, LOSS_MAX_NEW, check=False),
                          deadline_s=480)  # (~210 s alone on 2 cores; the watchdog is for a hang, not a timer)
    for name, round_ in result["rounds"].items():
        records = round_["records"]
        print(name, round_["fault"], f"wall {round_['wall_s']:.1f} s",
              f"longest gap {max(r['max_gap_s'] or 0 for r in records):.2f} s",
              f"gaps at the fault {sorted(round(r['gap_at_fault_s'] or 0, 2) for r in records)}",
              f"full capacity again after {round_.get('full_capacity_s')}")
        assert [r["error"] for r in records] == [None] * len(records), name
        length = LOSS_MAX_NEW if name == "target node" else LOSS_MAX_NEW // 2
        assert [r["tokens"] for r in records] == [e[:length] for e in result["expected"]], name
        assert all(r["chunks_before_fault"] > 0 and r["running_at_fault"] for r in records), name  # mid-stream
        assert max(r["max_gap_s"] for r in records) <= 10.0, name
        assert round_["health_after"] == 200, name
    assert result["rounds"]["target node"]["full_capacity_s"] is not None
