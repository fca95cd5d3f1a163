"""One multi-node run of the tiny app, for tests/test_multinode.py (run in its own process).

    python tests/multinode_scenario.py '{"port": 8123, "prompts": ["Hello"], "max_tokens": 16}'

Starts a `ray.cluster_utils.Cluster` on this machine: a head node and two worker nodes whose
custom resources stand in for GPUs (node A: {"gpu_node_a": 1}, node B: {"gpu_node_b": 1}), all on
127.0.0.1. Deploys the tiny app (configs/tiny.yaml's args) with the TargetWorker's bundle asking
for gpu_node_a and the DraftWorker's for gpu_node_b (strategy SPREAD), sends each prompt as a
greedy completion over HTTP, asks Ray where every worker actor and bundle landed, and prints one
line `RESULT <json>` on stdout. The cluster is shut down on every exit path (an error, SIGTERM, or
the deadline: a watchdog thread kills the nodes even while the main thread is stuck inside Ray);
Ray's reaper kills the node processes if this process is killed outright.

Environment (the test sets it): RAY_AUTH_MODE=disabled; a private RAY_TMPDIR (Cluster writes its
address to $RAY_TMPDIR/ray/ray_current_cluster, where a plain `ray.init()` elsewhere on the machine
would otherwise find and join it); RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, without which `ray.init`
rewrites the 127.0.0.1 GCS address to the machine's external IP, where nothing listens (every
node here binds 127.0.0.1 only).
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback

RESULT_MARKER = "RESULT "
NODE_A, NODE_B = "gpu_node_a", "gpu_node_b"
APP_NAME = "specserve-multinode"


class _Stop(Exception):
    pass


def _on_sigterm(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second one must not cut the cleanup short
    raise _Stop("SIGTERM: asked to stop")


_cluster = None  # the running Cluster, for the watchdog
_cleanup_lock = threading.Lock()


def _watchdog() -> None:
    """At the deadline the main thread may sit in a blocking Ray call that no signal interrupts:
    kill the cluster's processes from here, report, and leave."""
    _cleanup_lock.acquire(timeout=30)  # held while the main thread starts or stops the cluster
    if _cluster is not None:
        # not Cluster.shutdown(): it refuses to remove the head while this driver is connected.
        # Gracefully (SIGTERM, then SIGKILL): a raylet that gets SIGTERM stops its workers and agents.
        for node in [*_cluster.worker_nodes, _cluster.head_node]:
            try:
                if node is not None:
                    node.kill_all_processes(check_alive=False, allow_graceful=True, wait=True)
            except Exception:
                traceback.print_exc()
    print(RESULT_MARKER + json.dumps({"ok": False, "error": "scenario deadline passed", "traceback": ""}),
          flush=True)
    os._exit(3)


def app_args() -> dict:
    """configs/tiny.yaml's args, with each worker's bundle pinned to one fake-GPU node."""
    from serve_helpers import tiny_app_spec

    args = tiny_app_spec()["args"]
    args["target_worker"] = {**args["target_worker"], "custom": {NODE_A: 1}}
    args["draft_worker"] = {**args["draft_worker"], "custom": {NODE_B: 1}}
    args["placement_group_strategy"] = "SPREAD"
    # one group only: each fake GPU exists once, so a second coordinator replica could never place
    args["coordinator"] = {**args["coordinator"],
                           "autoscaling": {"min_replicas": 1, "max_replicas": 1}}
    return args


def run(port: int, prompts: list, max_tokens: int) -> dict:
    import httpx
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from serve_helpers import worker_actors
    from specserve.serve.app import build_app

    timings: dict[str, float] = {}
    began = time.monotonic()
    node = {"node_ip_address": "127.0.0.1", "num_cpus": 1, "object_store_memory": 80 * 1024 * 1024}
    global _cluster
    with _cleanup_lock:
        cluster = _cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    try:
        cluster.add_node(**node, resources={NODE_A: 1})
        cluster.add_node(**node, resources={NODE_B: 1})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, _node_ip_address="127.0.0.1", log_to_driver=False,
                 namespace="specserve-multinode")
        timings["cluster_s"] = time.monotonic() - began
        try:
            serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
            serve.run(build_app(app_args()), name=APP_NAME, route_prefix="/")
            timings["deploy_s"] = time.monotonic() - began - timings["cluster_s"]

            outputs = []
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
                for prompt in prompts:
                    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                            "ignore_eos": True, "return_token_ids": True}
                    r = http.post("/v1/completions", json=body)
                    r.raise_for_status()
                    reply = r.json()
                    outputs.append({"prompt": prompt, "token_ids": reply["choices"][0]["token_ids"],
                                    "text": reply["choices"][0]["text"], "speculation": reply["speculation"]})

            # where things ran, as Ray (GCS) reports it: no dashboard needed
            nodes = {n["NodeID"]: {"resources": n["Resources"],
                                   "head": "node:__internal_head__" in n["Resources"]}
                     for n in ray.nodes() if n["Alive"]}
            workers = {}
            for kind in ("target", "draft"):
                handles = worker_actors(kind)
                workers[kind] = [ray.get(h.node_id.remote(), timeout=30) for h in handles]
            groups = [{"strategy": g["strategy"], "state": g["state"],
                       "bundles": {str(i): b for i, b in g["bundles"].items()},
                       "bundles_to_node_id": {str(i): n for i, n in g["bundles_to_node_id"].items()}}
                      for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
            return {"ok": True, "outputs": outputs, "nodes": nodes, "workers": workers,
                    "placement_groups": groups, "timings": timings}
        finally:
            try:
                serve.shutdown()
            finally:
                ray.shutdown()
    finally:
        with _cleanup_lock:
            cluster.shutdown()
            _cluster = None


def main() -> int:
    spec = json.loads(sys.argv[1])
    signal.signal(signal.SIGTERM, _on_sigterm)
    watchdog = threading.Timer(float(spec.get("deadline_s", 150)), _watchdog)
    watchdog.daemon = True
    watchdog.start()
    try:
        result = run(int(spec["port"]), list(spec["prompts"]), int(spec["max_tokens"]))
    except BaseException as err:  # report, after the finally blocks shut the cluster down
        result = {"ok": False, "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
    with _cleanup_lock:  # the watchdog may not report once this one has
        watchdog.cancel()
        print(RESULT_MARKER + json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
