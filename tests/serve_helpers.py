"""Helpers for the Ray Serve tests: start the tiny app on a local Ray, look at its worker actors."""
from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
TINY_YAML = ROOT / "configs" / "tiny.yaml"


def tiny_app_spec() -> dict:
    """The one application of configs/tiny.yaml (name, route_prefix, args)."""
    return yaml.safe_load(TINY_YAML.read_text())["applications"][0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_local_serve(port: int) -> str:
    """Ray on 2 CPUs bound to 127.0.0.1, Serve's proxy on 127.0.0.1:port, the tiny app deployed."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a throwaway local cluster on loopback only
    import ray
    from ray import serve

    from specserve.serve.app import build_app

    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             namespace="specserve-tests")
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    spec = tiny_app_spec()
    serve.run(build_app(spec["args"]), name=spec["name"], route_prefix=spec["route_prefix"])
    return f"http://127.0.0.1:{port}"


def stop_local_serve() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def worker_actors(kind: str) -> list:
    """Handles of the live TargetWorker ("target") or DraftWorker ("draft") actors, all replicas."""
    import ray

    from specserve.serve.coordinator import WORKER_NAMESPACE

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == WORKER_NAMESPACE and a["name"].endswith(f":{kind}")]
    handles = []
    for name in names:
        try:
            handles.append(ray.get_actor(name, namespace=WORKER_NAMESPACE))
        except ValueError:  # died between listing and lookup
            pass
    return handles


def cache_counts() -> list[int]:
    """Cached requests on every live worker (target and draft, every replica)."""
    import ray

    counts = []
    for actor in worker_actors("target") + worker_actors("draft"):
        try:
            counts.append(ray.get(actor.num_cached.remote(), timeout=10))
        except ray.exceptions.RayActorError:
            pass
    return counts


def wait_for(predicate, timeout: float, interval: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def coordinator_replicas(app_name: str) -> int:
    from ray import serve

    status = serve.status().applications[app_name].deployments["Coordinator"]
    return status.replica_states.get("RUNNING", 0)
