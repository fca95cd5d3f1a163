"""cluster/ manifests parse, validate against Ray's own schemas and stay in sync with configs/."""
import json
import os
from pathlib import Path

import jsonschema
import ray
import yaml
from ray.serve.schema import ServeDeploySchema

from specserve.config import load_app_config

ROOT = Path(__file__).resolve().parents[1]


def load(path: str):
    return yaml.safe_load((ROOT / path).read_text())


def test_rayservice_embeds_the_gpu_serve_config():
    service = load("cluster/rayservice.yaml")
    assert service["kind"] == "RayService" and service["apiVersion"] == "ray.io/v1"
    embedded = yaml.safe_load(service["spec"]["serveConfigV2"])
    assert embedded == load("configs/gpu-70b.yaml"), "cluster/rayservice.yaml drifted from configs/gpu-70b.yaml"
    ServeDeploySchema.model_validate(embedded)
    for app in embedded["applications"]:
        load_app_config(app["args"])


def test_rayservice_gpu_workers_fit_a_coordinator_group():
    service = load("cluster/rayservice.yaml")
    app = load_app_config(yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"])
    group_gpus = app.target_worker.num_gpus + app.draft_worker.num_gpus
    workers = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    per_pod = max(int(w["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]) for w in workers)
    assert group_gpus <= per_pod  # PACK can place a whole group on one pod
    assert sum(w["maxReplicas"] for w in workers) * per_pod >= group_gpus * app.coordinator.autoscaling.max_replicas


def test_cluster_launcher_config_validates_against_ray_schema():
    config = load("cluster/ray-cluster-aws.yaml")
    schema_path = Path(os.path.dirname(ray.__file__)) / "autoscaler" / "ray-schema.json"
    jsonschema.validate(config, json.loads(schema_path.read_text()))
    gpus = config["available_node_types"]["gpu_worker"]["resources"]["GPU"]
    app = load_app_config(load("configs/gpu-70b.yaml")["applications"][0]["args"])
    assert app.target_worker.num_gpus + app.draft_worker.num_gpus <= gpus



def test_serving_pods_are_ready_only_when_the_app_would_serve():
    """The worker pods' readiness probe asks the app's /health (readiness: a warm coordinator
    answers) on the Serve port, which the front door lets through without the API key that this
    config requires; liveness is left to KubeRay's raylet check (never the model)."""
    from specserve.serve.front_door import FrontDoor

    service = load("cluster/rayservice.yaml")
    port = yaml.safe_load(service["spec"]["serveConfigV2"])["http_options"]["port"]
    for group in service["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        container = group["template"]["spec"]["containers"][0]
        command = " ".join(container["readinessProbe"]["exec"]["command"])
        assert f"http://localhost:{port}/health" in command and "local_raylet_healthz" in command
        assert container["readinessProbe"]["timeoutSeconds"] > 4  # the wget timeouts fit inside it
        assert "/health" not in json.dumps(container.get("livenessProbe", {}))
    assert {"/health", "/live"} <= FrontDoor.OPEN_PATHS


def test_ingress_replicas_are_pinned_to_a_resource_the_cpu_head_declares():
    """A lost GPU node must cut no client connection: the ingress asks for a resource that only
    the CPU-only head declares, in both cluster manifests (docs/multi-gpu.md, "Failure domains")."""
    app = load_app_config(load("configs/gpu-70b.yaml")["applications"][0]["args"])
    wanted = set(app.ingress.resources.custom_request())
    assert wanted == {"cpu_node"}
    head = load("cluster/rayservice.yaml")["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]
    assert head["num-gpus"] == "0" and set(json.loads(json.loads(head["resources"]))) == wanted
    assert "health_check_period_ms" in json.loads(json.loads(head["system-config"]))
    launcher = load("cluster/ray-cluster-aws.yaml")
    assert wanted <= set(launcher["available_node_types"]["head"]["resources"])
    assert "GPU" not in launcher["available_node_types"]["head"]["resources"]
    assert any("--system-config" in c for c in launcher["head_start_ray_commands"])
