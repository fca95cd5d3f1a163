"""One multi-node run of the tiny app, for tests/test_multinode.py (run in its own process).

    python tests/multinode_scenario.py '{"port": 8123, "prompts": ["Hello"], "max_tokens": 16}'   # port 0: any free one
    python tests/multinode_scenario.py '{"scenario": "node_loss", "port": 8123, "prompts": [...], ...}'

Starts a `ray.cluster_utils.Cluster` on this machine: a head node and two worker nodes whose
custom resources stand in for GPUs (node A: {"gpu_node_a": 1}, node B: {"gpu_node_b": 1}), all on
127.0.0.1. Deploys the tiny app (configs/tiny.yaml's args) with the TargetWorker's bundle asking
for gpu_node_a and the DraftWorker's for gpu_node_b (strategy SPREAD), sends each prompt as a
greedy completion over HTTP, asks Ray where every worker actor and bundle landed, and prints one
line `RESULT <json>` on stdout. The node-loss scenario instead starts two fake-GPU nodes of each
kind (two groups, coordinators and ingress on the CPU-only head, GCS node-death detection made
fast), removes one group's target node while streams run (then adds an A node back and times the
group's rebuild), then a draft's node, and reports every stream's tokens and longest gap. The cluster is shut down on every exit path (an error, SIGTERM, or
the deadline: a watchdog thread kills the nodes even while the main thread is stuck inside Ray);
Ray's reaper kills the node processes if this process is killed outright.

Environment (the test sets it): RAY_AUTH_MODE=disabled; a private RAY_TMPDIR (Cluster writes its
address to $RAY_TMPDIR/ray/ray_current_cluster, where a plain `ray.init()` elsewhere on the machine
would otherwise find and join it); RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, without which `ray.init`
rewrites the 127.0.0.1 GCS address to the machine's external IP, where nothing listens (every
node here binds 127.0.0.1 only).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
import traceback

RESULT_MARKER = "RESULT "
NODE_A, NODE_B = "gpu_node_a", "gpu_node_b"
CPU_NODE = "cpu_node"  # the head's: where coordinators and ingress replicas go
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
    # the coordinator and the ingress on the CPU-only head: a lost GPU node takes neither with it
    args["coordinator"] = {**args["coordinator"], "resources": {"num_cpus": 0.1, "custom": {CPU_NODE: 0.01}}}
    args["ingress"] = {**args["ingress"], "resources": {"num_cpus": 0.1, "custom": {CPU_NODE: 0.01}}}
    # one group only: each fake GPU exists once, so a second coordinator replica could never place
    args["coordinator"] = {**args["coordinator"],
                           "autoscaling": {"min_replicas": 1, "max_replicas": 1}}
    return args


NODE = {"node_ip_address": "127.0.0.1", "num_cpus": 1, "object_store_memory": 80 * 1024 * 1024}
# how fast the GCS declares a node that stopped answering dead (Ray's default is ~15 s; docs/multi-gpu.md)
FAST_NODE_DEATH = {"health_check_initial_delay_ms": 1000, "health_check_period_ms": 300,
                   "health_check_timeout_ms": 1000, "health_check_failure_threshold": 3}


@contextlib.contextmanager
def cluster_with(gpu_nodes: list[str], system_config: dict | None = None):
    """A head (CPU only, with CPU_NODE) and one node per entry of gpu_nodes (that custom resource),
    Ray initialised against it; shut down on every exit path (the watchdog's too)."""
    import ray
    from ray.cluster_utils import Cluster

    global _cluster
    head = {**NODE, "include_dashboard": False, "resources": {CPU_NODE: 100}}
    if system_config:
        head["_system_config"] = system_config
    with _cleanup_lock:
        cluster = _cluster = Cluster(initialize_head=True, head_node_args=head)
    try:
        for resource in gpu_nodes:
            cluster.add_node(**NODE, resources={resource: 1})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, _node_ip_address="127.0.0.1", log_to_driver=False,
                 namespace="specserve-multinode")
        try:
            yield cluster
        finally:
            try:
                from ray import serve

                serve.shutdown()
            finally:
                ray.shutdown()
    finally:
        with _cleanup_lock:
            cluster.shutdown()
            _cluster = None


def run(port: int, prompts: list, max_tokens: int) -> dict:
    import httpx
    import ray
    from ray import serve

    from serve_helpers import free_port, worker_actors
    from specserve.serve.app import build_app

    timings: dict[str, float] = {}
    began = time.monotonic()
    with cluster_with([NODE_A, NODE_B]):
        timings["cluster_s"] = time.monotonic() - began
        port = port or free_port()  # (0: one chosen once the cluster holds the ports it took)
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
        nodes = {n["NodeID"]: {"resources": n["Resources"], "head": "node:__internal_head__" in n["Resources"]}
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


# -- node loss: two groups; a target's node, then a draft's node, removed mid-stream ---------------
def node_loss_args() -> dict:
    """Two groups (each: target on an A node, draft on a B node, coordinator on the head), models
    slow enough that 16 streams are still running seconds after a node goes."""
    args = app_args()
    args["target"] = {"kind": "tiny", "seed": 0, "layers": 4, "hidden_size": 256}
    args["draft"] = {**args["target"], "noise": 0.15, "noise_seed": 1}
    args["coordinator"] = {**args["coordinator"], "autoscaling": {"min_replicas": 2, "max_replicas": 2}}
    args["deadlines"] = {"worker_lost_s": 1.0}
    return args


async def _stream(client, prompt: str, max_tokens: int, record: dict) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                record["error"] = f"HTTP {r.status_code}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    record["error"] = event["error"]
                for choice in event.get("choices", []):
                    if choice.get("token_ids"):
                        record["times"].append(time.monotonic())
                        record["tokens"] += choice["token_ids"]
    except Exception as err:  # the client side of a failed stream
        record["error"] = f"{type(err).__name__}: {err}"


async def _round(url: str, prompts: list[str], max_tokens: int, fault, settle_s: float) -> dict:
    """The streams; once each has its first tokens (and settle_s more), `fault()` (in a thread)."""
    import asyncio

    import httpx

    records = [{"tokens": [], "times": [], "error": None} for _ in prompts]
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        tasks = [asyncio.create_task(_stream(client, p, max_tokens, r)) for p, r in zip(prompts, records)]
        began = time.monotonic()
        while not all(r["times"] or r["error"] for r in records) and time.monotonic() - began < 60:
            await asyncio.sleep(0.05)
        await asyncio.sleep(settle_s)
        fault_at = time.monotonic()
        detail = await asyncio.to_thread(fault)
        await asyncio.gather(*tasks)
        health = (await client.get("/health")).status_code
    for r in records:
        times = r.pop("times")
        r["max_gap_s"] = max((b - a for a, b in zip(times, times[1:])), default=None)
        r["chunks_before_fault"] = sum(t < fault_at for t in times)
        r["gap_at_fault_s"] = max((b - a for a, b in zip(times, times[1:]) if a <= fault_at < b), default=None)
        r["running_at_fault"] = bool(times) and times[-1] > fault_at
    return {"records": records, "fault": detail, "health_after": health, "wall_s": time.monotonic() - began}


def _remove_group_node(cluster, bundle: int) -> dict:
    """Remove (not gracefully) the node that holds `bundle` of the first coordinator group."""
    import ray

    groups = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
    node_id = groups[0]["bundles_to_node_id"][bundle]
    (node,) = [n for n in cluster.worker_nodes if n.node_id == node_id]
    cluster.remove_node(node, allow_graceful=False)
    return {"bundle": bundle, "node": node_id[:8], "groups": len(groups)}


def _replicas_running(app: str) -> int:
    from ray import serve

    deployment = serve.status().applications[app].deployments["Coordinator"]
    return deployment.replica_states.get("RUNNING", 0)


def _wait_for(predicate, timeout: float) -> float | None:
    """Seconds until predicate() held, or None when it did not within timeout."""
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        if predicate():
            return time.monotonic() - began
        time.sleep(0.25)
    return None


def run_node_loss(port: int, prompts: list, max_tokens: int) -> dict:
    import asyncio

    from ray import serve

    from serve_helpers import free_port
    from specserve.serve.app import build_app

    with cluster_with([NODE_A, NODE_A, NODE_B, NODE_B], FAST_NODE_DEATH) as cluster:
        port = port or free_port()  # (0: one chosen once the cluster holds the ports it took)
        url = f"http://127.0.0.1:{port}"
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(node_loss_args()), name=APP_NAME, route_prefix="/")
        if _wait_for(lambda: _replicas_running(APP_NAME) == 2, 120) is None:
            raise RuntimeError("two coordinator groups did not start")
        target_lost = asyncio.run(_round(url, prompts, max_tokens, lambda: _remove_group_node(cluster, 1), 0.5))
        added = time.monotonic()  # capacity returns: a new A node, where Serve rebuilds the group
        cluster.add_node(**NODE, resources={NODE_A: 1})
        rebuilt_s = _wait_for(lambda: _replicas_running(APP_NAME) == 2, 120)
        target_lost["full_capacity_s"] = None if rebuilt_s is None else time.monotonic() - added
        # a draft's loss is seen within a step: shorter streams suffice (and its group runs target-only).
        # The fault comes as soon as every stream has begun: on a loaded 2-core machine the first
        # streams of a short round could otherwise end before the last one begins.
        draft_lost = asyncio.run(_round(url, prompts, max_tokens // 2, lambda: _remove_group_node(cluster, 2), 0.0))
        return {"ok": True, "rounds": {"target node": target_lost, "draft node": draft_lost}}


def main() -> int:
    spec = json.loads(sys.argv[1])
    signal.signal(signal.SIGTERM, _on_sigterm)
    watchdog = threading.Timer(float(spec.get("deadline_s", 150)), _watchdog)
    watchdog.daemon = True
    watchdog.start()
    try:
        scenario = run_node_loss if spec.get("scenario") == "node_loss" else run
        result = scenario(int(spec["port"]), list(spec["prompts"]), int(spec["max_tokens"]))
    except BaseException as err:  # report, after the finally blocks shut the cluster down
        result = {"ok": False, "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
    with _cleanup_lock:  # the watchdog may not report once this one has
        watchdog.cancel()
        print(RESULT_MARKER + json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
