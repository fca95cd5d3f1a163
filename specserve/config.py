"""Typed configuration: validated once (from a Serve YAML's `args`), then passed down in pieces.

    AppConfig
      served_model_name, max_batch_size, max_model_len
      max_queued_requests, max_cached_tokens   overload: bounded waiting queue, KV-cache token budget
      api_key                                  optional Bearer key (or env SPECSERVE_API_KEY)
      target / draft:   ModelSource  (tiny | smollm2 | hf)
      speculation:      SpeculationConfig
      ingress / coordinator: DeploymentConfig (Serve resources, autoscaling, max_ongoing_requests)
      target_worker / draft_worker: Resources (the coordinator's placement-group bundles)

Every field is checked here; nothing downstream re-validates a dict.
"""
from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

Dtype = Literal["float32", "bfloat16", "float16"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# -- where models come from ----------------------------------------------------------------------
class TinySource(_Strict):
    """A seeded tiny Llama built in code, with the byte-level tokenizer of `specserve.models.tiny`.

    A draft is usually the target's seed with `noise` > 0: the same weights plus Gaussian noise,
    so that it agrees with the target only some of the time."""

    kind: Literal["tiny"] = "tiny"
    seed: int = 0
    layers: int = Field(2, ge=1, le=8)
    hidden_size: int = Field(64, ge=8, le=512)
    noise: float = Field(0.0, ge=0.0)  # relative std of the weight noise
    noise_seed: int = 1
    max_position_embeddings: int = Field(512, ge=16)


class SmolLM2Source(_Strict):
    """The offline SmolLM2-135M-Instruct target / its shipped draft (specserve.models.smollm2)."""

    kind: Literal["smollm2"] = "smollm2"
    cache_dir: str | None = None
    dtype: Dtype = "float32"


class HFSource(_Strict):
    """A local Hugging Face checkpoint directory (no hub access is attempted).

    On a worker that Ray gave GPUs, the model is sharded over exactly those GPUs
    (`specserve.engine.sharding.load_sharded`): decoder layers kept whole, each GPU filled up to
    `max_memory_per_gpu` minus `kv_cache_headroom`, and a model that cannot fit is refused before
    any weight is read. Without GPUs it loads on the CPU.
    """

    kind: Literal["hf"] = "hf"
    path: str
    dtype: Dtype = "bfloat16"
    max_memory_per_gpu: str | None = None  # e.g. "74GiB"; default: each GPU's total memory
    kv_cache_headroom: float | str = 0.1  # per GPU: a fraction of the budget, or a size like "8GiB"
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"

    @model_validator(mode="after")
    def _headroom(self) -> "HFSource":
        if isinstance(self.kv_cache_headroom, float) and not 0.0 <= self.kv_cache_headroom < 1.0:
            raise ValueError("kv_cache_headroom as a fraction must lie in [0, 1)")
        return self


ModelSource = Annotated[Union[TinySource, SmolLM2Source, HFSource], Field(discriminator="kind")]


# -- drafters that run inside the target worker (a separate draft model is `draft:`) -------------
class LayerSkipDrafter(_Strict):
    """Self-speculation: the target's own weights with these decoder layers skipped (see
    `specserve.tuning.layer_skip` for a search over skip sets). Shares the target's GPU memory."""

    kind: Literal["layer_skip"] = "layer_skip"
    skip_layers: tuple[int, ...] = Field(min_length=1)

    def engine_spec(self):
        from specserve.engine.proposers import LayerSkipSpec

        return LayerSkipSpec(self.skip_layers)


class PromptLookupDrafter(_Strict):
    """Prompt lookup: copies what followed the latest earlier match of the request's suffix n-gram."""

    kind: Literal["prompt_lookup"] = "prompt_lookup"
    min_n: int = Field(1, ge=1)
    max_n: int = Field(3, ge=1)

    @model_validator(mode="after")
    def _order(self) -> "PromptLookupDrafter":
        if self.min_n > self.max_n:
            raise ValueError("prompt_lookup: min_n must be <= max_n")
        return self

    def engine_spec(self):
        from specserve.engine.proposers import PromptLookupSpec

        return PromptLookupSpec(self.min_n, self.max_n)


class FeatureDrafter(_Strict):
    """A feature head (EAGLE-style) drafting from the target's hidden states inside the target
    worker: `path` is a directory with config.json + safetensors (written by `specserve distill`,
    or a public EAGLE-3 head), or the name of a head shipped in specserve/models/weights."""

    kind: Literal["eagle"] = "eagle"
    path: str = Field(min_length=1)

    def engine_spec(self):
        from specserve.engine.feature_drafter import FeatureDrafterSpec

        return FeatureDrafterSpec(self.path)


ColocatedDrafter = Annotated[
    Union[LayerSkipDrafter, PromptLookupDrafter, FeatureDrafter], Field(discriminator="kind")
]


# -- speculation and resources -------------------------------------------------------------------
class SpeculationConfig(_Strict):
    num_speculative_tokens: int = Field(4, ge=0, le=16)  # γ, the most drafts per row and step
    adaptive: bool = True  # choose γ <= num_speculative_tokens from live measurements


_BUILTIN_RESOURCES = frozenset({"cpu", "gpu", "memory", "object_store_memory"})


class Resources(_Strict):
    num_cpus: float = Field(0.25, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    memory: int | None = Field(None, ge=0)  # bytes, Ray's logical memory resource
    torch_threads: int | None = Field(None, ge=1)  # torch intra-op threads in that process
    # Ray custom resources (a node's `--resources`), e.g. {"gpu_node_a": 1}: they pin this
    # bundle to the nodes that declare them (see docs/multi-gpu.md, placement across nodes)
    custom: dict[str, Annotated[float, Field(ge=0, allow_inf_nan=False)]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _custom(self) -> "Resources":
        for name in self.custom:
            if not name or name != name.strip():
                raise ValueError(f"custom resource name {name!r} must be non-empty, without surrounding spaces")
            if name.lower() in _BUILTIN_RESOURCES:
                raise ValueError(f"custom resource {name!r} clashes with a built-in Ray resource: "
                                 "use num_cpus / num_gpus / memory")
        return self

    def bundle(self) -> dict[str, float]:
        """The placement-group bundle (Ray resource dict) these resources ask for."""
        bundle = {"CPU": self.num_cpus}
        if self.num_gpus:
            bundle["GPU"] = self.num_gpus
        if self.memory:
            bundle["memory"] = float(self.memory)
        bundle.update(self.custom_request())
        return bundle

    def custom_request(self) -> dict[str, float]:
        """The custom resources as a Ray `resources=` dict (zero amounts left out)."""
        return {name: float(amount) for name, amount in self.custom.items() if amount}


class AutoscalingConfig(_Strict):
    """The subset of Serve's autoscaling_config we set; passed to Serve unchanged."""

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    initial_replicas: int | None = Field(None, ge=0)
    target_ongoing_requests: float = Field(16.0, gt=0)
    upscale_delay_s: float = Field(30.0, ge=0)
    downscale_delay_s: float = Field(600.0, ge=0)
    look_back_period_s: float = Field(30.0, gt=0)
    metrics_interval_s: float = Field(10.0, gt=0)  # how often handles/replicas push load to the controller

    @model_validator(mode="after")
    def _bounds(self) -> "AutoscalingConfig":
        if self.min_replicas > self.max_replicas:
            raise ValueError("autoscaling: min_replicas must be <= max_replicas")
        return self


class DeploymentConfig(_Strict):
    resources: Resources = Resources()
    autoscaling: AutoscalingConfig = AutoscalingConfig()
    max_ongoing_requests: int = Field(64, ge=1)


# -- the application -----------------------------------------------------------------------------
class AppConfig(_Strict):
    served_model_name: str = Field(min_length=1)
    target: ModelSource
    draft: ModelSource | None = None  # a separate draft model, in its own worker and bundle
    drafter: ColocatedDrafter | None = None  # or a drafter inside the target worker (no draft model)
    tokenizer: str | None = None  # a local tokenizer directory; default: the target's
    speculation: SpeculationConfig = SpeculationConfig()
    max_batch_size: int = Field(32, ge=1)
    max_model_len: int | None = Field(None, ge=2)  # default: the models' own limit
    # Overload, per coordinator replica: requests waiting for the running batch beyond this are
    # refused (HTTP 429 + Retry-After); 0 = no waiting at all (admit or refuse).
    max_queued_requests: int = Field(256, ge=0)
    # KV-cache budget per worker, in tokens: a request reserves prompt + max_tokens while it runs,
    # and admission waits while the running reservations would exceed this (None: no budget).
    max_cached_tokens: int | None = Field(None, ge=2)
    # Bearer key every route but /health requires (None: the environment's SPECSERVE_API_KEY, if
    # set, else no authentication). Prefer the environment: a config's args are stored by Serve.
    api_key: str | None = Field(None, min_length=1)
    ingress: DeploymentConfig = DeploymentConfig(resources=Resources(num_cpus=0.1))
    coordinator: DeploymentConfig = DeploymentConfig(resources=Resources(num_cpus=0.1))
    target_worker: Resources = Resources()
    draft_worker: Resources = Resources()
    placement_group_strategy: Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"] = "PACK"

    @model_validator(mode="after")
    def _consistent(self) -> "AppConfig":
        if self.draft is not None and self.drafter is not None:
            raise ValueError("give either a draft model (draft) or a drafter (drafter), not both")
        if self.draft is None and self.drafter is None and self.speculation.num_speculative_tokens > 0:
            raise ValueError("speculation.num_speculative_tokens > 0 needs a draft model or a drafter (or set it to 0)")
        if self.draft is not None and self.draft.kind != self.target.kind and "tiny" in (self.draft.kind, self.target.kind):
            raise ValueError("a tiny draft only fits a tiny target (they share the byte tokenizer)")
        return self

    def coordinator_bundles(self) -> list[dict[str, float]]:
        """[coordinator, target worker, draft worker (only with a draft model)]: one placement group
        per coordinator replica."""
        bundles = [self.coordinator.resources.bundle(), self.target_worker.bundle()]
        return bundles + ([self.draft_worker.bundle()] if self.draft is not None else [])


def load_app_config(args: dict) -> AppConfig:
    """Validate a Serve application's `args` once; raises pydantic.ValidationError."""
    return AppConfig.model_validate(args)
