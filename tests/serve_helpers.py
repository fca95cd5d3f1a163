"""Helpers for the Ray Serve tests: start the tiny app on a local Ray, look at its worker actors."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import tempfile
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


# Ports Ray's own components take by default (dashboard agent's HTTP, GCS, dashboard, client server):
# a free port drawn for the metrics endpoint (or Serve's proxy) that is one of these makes Ray refuse to start
# (it happened once, 52365, and every serve test of that run errored)
RAY_DEFAULT_PORTS = frozenset({52365, 6379, 8265, 10001})


def port_ray_leaves_free() -> int:
    """A free port that none of Ray's components takes by default."""
    port = free_port()
    while port in RAY_DEFAULT_PORTS:
        port = free_port()
    return port


METRICS_PORT = port_ray_leaves_free()  # Ray's Prometheus endpoint of the session's cluster (conftest.py's `server`)


def start_local_serve(port: int, metrics_port: int | None = None) -> str:
    """Ray on 2 CPUs bound to 127.0.0.1, Serve's proxy on 127.0.0.1:port, the tiny app deployed.
    With metrics_port, Ray's Prometheus endpoint is http://127.0.0.1:metrics_port/metrics, flushed
    every second."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a throwaway local cluster on loopback only
    # the workers' test-only fault files (specserve.serve.workers): Ray's processes inherit this
    os.environ.setdefault("SPECSERVE_FAULTS_DIR", tempfile.mkdtemp(prefix="specserve-faults-"))
    import ray
    from ray import serve

    from specserve.serve.app import build_app

    extra = {}
    if metrics_port is not None:
        extra = {"_metrics_export_port": metrics_port, "_system_config": {"metrics_report_interval_ms": 1000}}
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             namespace="specserve-tests", **extra)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        spec = tiny_app_spec()
        serve.run(build_app(spec["args"]), name=spec["name"], route_prefix=spec["route_prefix"])
    except BaseException:
        # a failed start leaves no Ray behind: pytest retries a failed session fixture for every test
        # that uses it, and each retry should show this error, not "ray.init twice"
        stop_local_serve()
        raise
    return f"http://127.0.0.1:{port}"


def deploy_app(name: str, route_prefix: str, **overrides) -> None:
    """Another application of the tiny models beside the session's one (args of tiny.yaml + overrides)."""
    from ray import serve

    from specserve.serve.app import build_app

    serve.run(build_app({**tiny_app_spec()["args"], **overrides}), name=name, route_prefix=route_prefix)


@contextlib.contextmanager
def app_client(server: str, name: str, route_prefix: str, timeout: float = 120, **overrides):
    """Deploy another application of the tiny models (`deploy_app`), yield an HTTP client on its
    route, and delete it afterwards, whatever happened."""
    import httpx
    from ray import serve

    deploy_app(name, route_prefix, **overrides)
    try:
        with httpx.Client(base_url=f"{server}{route_prefix}", timeout=timeout) as client:
            yield client
    finally:
        serve.delete(name)


def scrape(metrics_port: int) -> dict[tuple[str, frozenset], float]:
    """Ray's Prometheus text -> {(name, labels without Ray's per-process ones): value summed over processes}."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    drop = {"WorkerId", "SessionName", "NodeAddress", "Version", "Component", "otel_scope_name",
            "otel_scope_schema_url", "otel_scope_version"}
    out: dict[tuple[str, frozenset], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "specserve" not in sample.name:
                continue
            key = (sample.name, frozenset((k, v) for k, v in sample.labels.items() if k not in drop))
            out[key] = out.get(key, 0.0) + sample.value
    return out


def metric(samples: dict, name: str, **labels: str) -> float:
    """The sum of every series of `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= set(lab))


def stop_local_serve() -> None:
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
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


def inject_fault(app_name: str, method: str, kind: str, count: int) -> Path:
    """Make the next `count` calls of `method` ("verify" / "propose") on `app_name`'s workers
    `kind` ("hang" / "raise"); see specserve.serve.workers. Returns the fault file."""
    path = Path(os.environ["SPECSERVE_FAULTS_DIR"]) / f"{app_name}.{method}"
    path.write_text(f"{kind} {count}")
    return path


def replica_actors(app_name: str, deployment: str = "Coordinator") -> list:
    """Handles of the live Serve replica actors of one deployment of an application."""
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == "serve" and f"{app_name}#{deployment}#" in a["name"]]
    handles = []
    for name in names:
        try:
            handles.append(ray.get_actor(name, namespace="serve"))
        except ValueError:  # died between listing and lookup
            pass
    return handles


def sse_events_iter(response):
    """The events of an SSE response (httpx, streaming): each `data:` payload parsed, "[DONE]" as is."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            yield payload if payload == "[DONE]" else json.loads(payload)
