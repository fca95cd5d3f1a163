"""build_app(args) -> serve.Application: the `import_path` of configs/*.yaml.

    HTTP -> OpenAIIngress --(DeploymentHandle, streaming)--> Coordinator replica
                 |                                             |- TargetWorker (bundle 1)
                 |                                             '- DraftWorker  (bundle 2)
                 |--(DeploymentHandle)--> ResponseStore (one replica: the Responses API's store)
                 '--(DeploymentHandle)--> ConversationStore (one replica: the Conversations API's)

`args` is validated once into an `AppConfig`; every deployment's resources and autoscaling come
from it (so the coordinator's placement-group bundles always match its workers' requests), and so
do their queue bounds (Serve's `max_queued_requests`, refused with 429), health checks and
graceful shutdown (long enough for a request that runs until `request_timeout_s`).
"""
from __future__ import annotations

from ray import serve

from specserve.config import AppConfig, DeploymentConfig, load_app_config

from .conversation_store import ConversationStoreDeployment
from .coordinator import Coordinator
from .ingress import RETRY_AFTER_S
from .openai_api import OpenAIIngress
from .response_store import ResponseStoreDeployment

SHUTDOWN_MARGIN_S = 30.0  # beyond request_timeout_s, for the last chunks and the replica's own shutdown


def _options(name: str, config: AppConfig) -> dict:
    dep: DeploymentConfig = getattr(config, name)
    auto = dep.autoscaling.model_dump(exclude_none=True)
    actor = {"num_cpus": dep.resources.num_cpus, "num_gpus": dep.resources.num_gpus}
    if dep.resources.memory:
        actor["memory"] = dep.resources.memory
    if dep.resources.custom_request():
        actor["resources"] = dep.resources.custom_request()
    placement = {} if dep.max_replicas_per_node is None else {"max_replicas_per_node": dep.max_replicas_per_node}
    return {**placement, "autoscaling_config": auto, "max_ongoing_requests": config.max_ongoing(name),
            "ray_actor_options": actor,
            # Serve's queue at each caller: refused beyond it with 429 + Retry-After, never unbounded
            "max_queued_requests": dep.max_queued_requests,
            "backpressure_config": {"status_code": 429, "retry_after_s": RETRY_AFTER_S},
            "health_check_period_s": dep.health_check_period_s, "health_check_timeout_s": dep.health_check_timeout_s,
            # scale-down and updates let the longest allowed generation finish
            "graceful_shutdown_timeout_s": config.request_timeout_s + SHUTDOWN_MARGIN_S}


def build_from_config(config: AppConfig) -> serve.Application:
    coordinator = Coordinator.options(
        placement_group_bundles=config.coordinator_bundles(),
        placement_group_strategy=config.placement_group_strategy,
        **_options("coordinator", config),
    ).bind(config)
    responses = config.responses
    store = conversations = None
    if responses.store:
        store = ResponseStoreDeployment.bind(responses.max_stored, responses.max_stored_bytes,
                                             responses.journal("responses"))
        conversations = ConversationStoreDeployment.bind(responses.max_conversations, responses.max_conversation_bytes,
                                                         responses.journal("conversations"))
    return OpenAIIngress.options(**_options("ingress", config)).bind(coordinator, config, store, conversations)


def build_app(args: dict) -> serve.Application:
    return build_from_config(load_app_config(args))
