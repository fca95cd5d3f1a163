"""build_app(args) -> serve.Application: the `import_path` of configs/*.yaml.

    HTTP -> OpenAIIngress --(DeploymentHandle, streaming)--> Coordinator replica
                                                               |- TargetWorker (bundle 1)
                                                               '- DraftWorker  (bundle 2)

`args` is validated once into an `AppConfig`; every deployment's resources and autoscaling come
from it (so the coordinator's placement-group bundles always match its workers' requests).
"""
from __future__ import annotations

from ray import serve

from specserve.config import AppConfig, DeploymentConfig, load_app_config

from .coordinator import Coordinator
from .openai_api import OpenAIIngress


def _options(dep: DeploymentConfig) -> dict:
    auto = dep.autoscaling.model_dump(exclude_none=True)
    actor = {"num_cpus": dep.resources.num_cpus, "num_gpus": dep.resources.num_gpus}
    if dep.resources.memory:
        actor["memory"] = dep.resources.memory
    if dep.resources.custom_request():
        actor["resources"] = dep.resources.custom_request()
    return {"autoscaling_config": auto, "max_ongoing_requests": dep.max_ongoing_requests, "ray_actor_options": actor}


def build_from_config(config: AppConfig) -> serve.Application:
    coordinator = Coordinator.options(
        placement_group_bundles=config.coordinator_bundles(),
        placement_group_strategy=config.placement_group_strategy,
        **_options(config.coordinator),
    ).bind(config)
    return OpenAIIngress.options(**_options(config.ingress)).bind(coordinator, config)


def build_app(args: dict) -> serve.Application:
    return build_from_config(load_app_config(args))
