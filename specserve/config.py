"""Typed configuration: validated once (from a Serve YAML's `args`), then passed down in pieces.

    AppConfig
      served_model_name, max_batch_size, max_model_len
      tokenizer, chat_template, default_chat_template_kwargs   how chats are rendered
      max_queued_requests, max_cached_tokens   overload: bounded waiting queue, KV-cache allocation budget
      request_timeout_s, deadlines             how long a request and each worker call may take
      max_resumes                              continuations of a request after its replica is lost
      api_key                                  optional Bearer key(s) (or env SPECSERVE_API_KEY)
      front_door:       FrontDoorConfig  (ingress threads, body / list limits, per-key limits)
      reasoning:        ReasoningConfig  (a reasoning model's thinking, split out of chat answers)
      fim:              FimConfig  (a code model's fill-in-the-middle tokens: completions' `suffix`)
      responses:        ResponsesConfig  (the Responses API's store of earlier responses)
      target / draft:   ModelSource  (tiny | smollm2 | hf | random)
      speculation:      SpeculationConfig
      ingress / coordinator: DeploymentConfig (Serve resources, autoscaling, max_ongoing_requests)
      target_worker / draft_worker: Resources (the coordinator's placement-group bundles)

Every field is checked here; nothing downstream re-validates a dict.
"""
from __future__ import annotations

import os
from typing import Annotated, Any, ClassVar, Literal, Union

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


# Named shapes of `kind: random` (Llama-2-7B's, TinyLlama-1.1B's, Mistral-7B-v0.1's: grouped
# queries and a sliding window of 4096 positions, and Gemma 3 12B's), as transformers config fields
RANDOM_SHAPES: dict[str, dict] = {
    "llama-7b": dict(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                     num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                     max_position_embeddings=4096),
    "llama-1b": dict(model_type="llama", vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                     num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                     max_position_embeddings=2048),
    "mistral-7b": dict(model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       max_position_embeddings=32768, sliding_window=4096),
    # Gemma 3 12B's text model (five windowed layers of 1024 positions to each full one), its output
    # head untied from the embedding (Gemma ties them) so that `peaked` weights can be made
    "gemma3-12b": dict(model_type="gemma3_text", vocab_size=262208, hidden_size=3840, intermediate_size=15360,
                       num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                       query_pre_attn_scalar=256, max_position_embeddings=131072, sliding_window=1024,
                       tie_word_embeddings=False,
                       layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 8),
}


class RandomSource(_Strict):
    """Random weights of a model's shape, for load tests without any weights (like vLLM's
    `load_format: dummy`): every forward, cache and memory figure is the shape's own, the tokens
    are noise. `shape` names one of RANDOM_SHAPES or gives transformers config fields (a
    `model_type` and what that model needs). The weights are drawn from `seed` on the device they
    live on (the worker's first GPU, else the CPU), so a 7B model is ready in seconds. The config
    declares no EOS token: every request runs to its max_tokens. The ingress uses the byte-level
    tokenizer of `kind: tiny` (ids past its 259 decode to no text; token counts stay exact)."""

    kind: Literal["random"] = "random"
    shape: str | dict = "llama-1b"
    dtype: Dtype = "bfloat16"
    seed: int = 0
    # a target whose greedy token cannot flip between kernels (specserve.models.peaked), so that a
    # planted drafter's references stay its outputs at every batch size and γ (speculation.planted)
    peaked: bool = False

    @model_validator(mode="after")
    def _shape(self) -> "RandomSource":
        if isinstance(self.shape, str) and self.shape not in RANDOM_SHAPES:
            raise ValueError(f"random: shape {self.shape!r} is not one of {sorted(RANDOM_SHAPES)} (or give config "
                             "fields as a mapping)")
        if isinstance(self.shape, dict) and "model_type" not in self.shape:
            raise ValueError("random: a shape given as config fields needs a model_type (e.g. llama)")
        return self

    def config_fields(self) -> dict:
        return dict(RANDOM_SHAPES[self.shape] if isinstance(self.shape, str) else self.shape)


ModelSource = Annotated[Union[TinySource, SmolLM2Source, HFSource, RandomSource], Field(discriminator="kind")]


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


class PredictionDrafter(_Strict):
    """The requests' own predictions (OpenAI's `prediction`) drafted alone, with no draft model:
    a request with one drafts up to γ of its predicted tokens a step where its output follows
    them; any other request decodes as the target alone does (docs/drafters.md, "Predicted outputs")."""

    kind: Literal["prediction"] = "prediction"
    own_drafts: ClassVar[bool] = False  # (the γ policy plans no drafts of its own: SpeculationPolicy.own_drafts)

    def engine_spec(self):
        from specserve.engine.proposers import PredictionSpec

        return PredictionSpec()


class FeatureDrafter(_Strict):
    """A feature head (EAGLE-style) drafting from the target's hidden states: `path` is a
    directory with config.json + safetensors (written by `specserve distill`, or a public EAGLE-3
    head), or the name of a head shipped in specserve/models/weights. `worker`: where it drafts.
    "target": inside the target worker (a step is one call). "draft": in a draft worker of its own
    (`draft_worker` resources: its own GPU, and `speculation.pipelined` becomes possible), which
    pulls the target's features of each step's committed tokens from the target worker and holds
    only the target's embedding and output head besides the head."""

    kind: Literal["eagle"] = "eagle"
    path: str = Field(min_length=1)
    # a row stops drafting where the product of the head's top probabilities falls below this
    # (EAGLE-2's acceptance estimate; docs/drafters.md); None: every draft the γ policy plans
    min_confidence: float | None = Field(None, gt=0.0, lt=1.0)
    # a row whose newest tokens repeat an earlier n-gram of at least this many tokens drafts what
    # followed it (prompt lookup) instead of running the head (docs/drafters.md); None: never
    lookup_min_n: int | None = Field(None, ge=1, le=64)
    worker: Literal["target", "draft"] = "target"

    def engine_spec(self):
        from specserve.engine.feature_drafter import FeatureDrafterSpec

        return FeatureDrafterSpec(self.path, self.min_confidence, self.lookup_min_n)


ColocatedDrafter = Annotated[
    Union[LayerSkipDrafter, PromptLookupDrafter, PredictionDrafter, FeatureDrafter], Field(discriminator="kind")
]


# -- speculation and resources -------------------------------------------------------------------
class HistoryConfig(_Strict):
    """Draft from earlier answers (engine/history.py): each coordinator replica keeps the answers of
    the requests it finished (after their prompts' last tokens), up to `max_tokens`, and a request
    whose latest `min_match` or more tokens occurred there drafts what followed them, before its
    drafter drafts. For agents, tool loops and templated jobs, which repeat structures across
    requests. Outputs are unchanged; a seeded sampled request never recalls. Off by default: like
    any cache shared between requests, how fast a request is answered then depends on what others
    were answered."""

    max_tokens: int = Field(200_000, ge=1)
    min_match: int = Field(8, ge=1, le=32)

    def engine_history(self):
        from specserve.engine.history import History

        return History(self.max_tokens, self.min_match)


class PlantedAcceptance(_Strict):
    """Benchmarks and load tests only: the draft model runs (its cost is real) but, for a greedy
    request whose prompt opens one of the `references` (prompt + the target's greedy output, one
    {"tokens": [...]} per line), proposes the reference's next token with probability `alpha` per
    position and a wrong one otherwise, so that acceptance is set over HTTP rather than hoped
    for (specserve.engine.planted). Other requests draft as the model would. Outputs are always
    the target's."""

    alpha: float = Field(ge=0.0, le=1.0)
    references: str = Field(min_length=1)  # a JSON-lines file readable where the draft worker runs
    seed: int = 0
    second: float = Field(0.0, ge=0.0, le=1.0)  # a wrong draft's runner-up is the true token this often


class SpeculationConfig(_Strict):
    num_speculative_tokens: int = Field(4, ge=0, le=16)  # γ, the most drafts per row and step
    adaptive: bool = True  # choose γ <= num_speculative_tokens from live measurements
    # How workers run their fixed-shape forwards: CUDA graphs on a GPU ("auto"), or always eager;
    # "fused-graph": CUDA graphs of the models with their decoder layers compiled first (fewer,
    # fused kernels; a few seconds of compiling at start-up; docs/engine.md).
    execution: Literal["auto", "eager", "graph", "fused-graph"] = "auto"
    # Draft block k+1 on the draft worker while the target verifies block k (specserve.serve.pipeline);
    # needs a separate draft model (draft:). Outputs are unchanged; off by default.
    pipelined: bool = False
    # How the coordinator calls the workers in each step: plain actor calls, or one Ray Compiled
    # Graph execution (the draft's proposal goes to the target directly; see specserve.serve.graph;
    # it falls back to plain calls while broken). Opt-in for now: a replica's start-up and every
    # rebuild cost a compile and a 1-2 s stall of the workers' ordinary calls (docs/serving.md).
    # With pipelined, the draft drafts the next block on the graph too, beside the verify.
    transport: Literal["actor_calls", "compiled_graph"] = "actor_calls"
    # Pipelined on the compiled graph, with a draft model: besides the block that assumes block k
    # is accepted whole, prepare up to this many more per greedy row, each from a rejection point
    # of block k (its first drafts) corrected to the draft's runner-up token there (speculative
    # speculative decoding). The policy uses fewer, or none, where the extra draft rows cost more
    # than the steps they save. Outputs are unchanged (the verdict decides which block is used).
    # Off by default: on the 2-core CPU machine they lost in `bench overlap` (docs/serving.md).
    branches: int = Field(0, ge=0, le=16)
    # Where a separate draft worker and the target share a GPU (or, on CPUs, a host), the q of
    # sampled rows reaches the target through a buffer both can read (serve/placed_q.py: CUDA IPC,
    # shared memory) instead of through the host and a channel or the object store. Tried at a
    # replica's first step and after a worker comes back; where it fails, q crosses as before.
    place_q: bool = True
    # Structured output: a grammar row whose mask, after its output so far, allows at least this
    # share of the vocabulary (free text in a JSON string, a reasoning model's thinking) drafts
    # unmasked in that step, so the step needs no mask per draft position (lossless: the target is
    # masked at every position; docs/engine.md, "Structured output"). null: every grammar row's
    # drafts masked.
    grammar_wide_share: float | None = Field(0.9, ge=0, le=1)
    # Draft from the answers this replica gave before, where a request's latest tokens occurred
    # in them (HistoryConfig; null: none kept).
    history: HistoryConfig | None = None
    # Benchmarks only: acceptance planted in the draft model's proposals (needs draft:).
    planted: PlantedAcceptance | None = None


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


CONTROL_HEADROOM = 8  # slots beyond generation traffic kept for /v1/stats, /v1/models, health calls
# Ingress and coordinator are async and cheap per request: they take a burst of this many requests
# in and answer the surplus with the coordinator's own 429 at once, rather than let Serve queue it
# in front of them, where /health and /v1/stats would wait behind it.
BURST_ONGOING = 1024


class DeploymentConfig(_Strict):
    resources: Resources = Resources()
    autoscaling: AutoscalingConfig = AutoscalingConfig()
    # requests Serve sends one replica at a time (None: the smallest value consistent with the
    # other limits, see AppConfig.max_ongoing)
    max_ongoing_requests: int | None = Field(None, ge=1)
    # Serve's own queue at each caller (the proxy, or an ingress's handle) once every replica holds
    # max_ongoing_requests: beyond it a request is refused at once (HTTP 429 + Retry-After).
    max_queued_requests: int = Field(BURST_ONGOING, ge=0)
    # at most this many replicas per node (Serve's option): spreads ingress replicas over CPU nodes
    max_replicas_per_node: int | None = Field(None, ge=1)
    health_check_period_s: float = Field(10.0, gt=0)  # Serve calls the replica's check_health this often
    health_check_timeout_s: float = Field(30.0, gt=0)  # and marks it unhealthy if it takes longer


class Deadlines(_Strict):
    """How long worker calls may take before the worker counts as failed (see docs/serving.md).

    A call's deadline is floor + multiple x the time the policy's measured per-token costs predict
    for the tokens it carries (prefill included): a draft that misses it is treated as gone
    (target-only steps); a target that misses it is killed and restarted by Ray, and its requests
    re-prefilled from the coordinator's tokens."""

    multiple: float = Field(20.0, ge=1.0)
    target_floor_s: float = Field(10.0, gt=0)
    draft_floor_s: float = Field(1.0, gt=0)
    restart_timeout_s: float = Field(600.0, gt=0)  # a restarted worker (model load) must answer within
    health_probe_s: float = Field(10.0, gt=0)  # each health check waits this long for each worker
    health_misses: int = Field(3, ge=1)  # consecutive unanswered health checks that fail the replica
    # A target worker whose placement-group bundle has had no node this long (its node gone, and no
    # other with the resources it asks for) is lost: the replica gives its requests up to the other
    # replicas (the ingress continues them from the tokens delivered) and leaves, and Serve builds
    # a new group when capacity allows (serve/placement.py, docs/multi-gpu.md "Failure domains").
    worker_lost_s: float = Field(5.0, gt=0)


# -- the ingress's front door --------------------------------------------------------------------
class PerKeyLimits(_Strict):
    """Per API key (every client shares one account when no key is set), per ingress replica:
    beyond either limit a request is refused with 429 + Retry-After. None = off."""

    max_concurrent_requests: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)  # prompt + generated tokens


class FrontDoorConfig(_Strict):
    """What the ingress refuses before doing any work, and where its slow work runs."""

    # tokenization and chat templating run on this many threads per ingress replica, never on its
    # event loop
    threads: int = Field(4, ge=1, le=256)
    # a larger body is refused with 413 before it is parsed (Content-Length, or while it streams in)
    max_request_bytes: int = Field(4 << 20, ge=1024)
    max_stop_sequences: int = Field(16, ge=0)
    max_stop_chars: int = Field(256, ge=1)  # per stop string
    max_messages: int = Field(1024, ge=1)
    max_content_parts: int = Field(256, ge=1)  # per message
    max_logit_bias_entries: int = Field(1024, ge=0)
    max_choices: int = Field(64, ge=1)  # prompts x n of one request (each is a generation of its own)
    max_grammar_chars: int = Field(256 << 10, ge=1)  # a response_format's schema / regex / grammar text
    max_tools: int = Field(128, ge=0)  # tools offered by one chat request (their schemas: max_grammar_chars)
    per_key: PerKeyLimits = PerKeyLimits()
    # refuse to start without an API key (config or env SPECSERVE_API_KEY): for public deployments
    require_api_key: bool = False
    # `specserve serve` refuses a non-loopback http_options.host without a key unless this is true
    allow_unauthenticated_public: bool = False


# -- code models -----------------------------------------------------------------------------------
class FimConfig(_Strict):
    """A fill-in-the-middle (code) target: a completion's `suffix` is the text after the cursor,
    and the prompt becomes prefix + prompt + suffix tag + suffix + middle ("psm"), or prefix +
    suffix tag + suffix + middle + prompt ("spm"), in the model's own FIM tokens (Qwen2.5-Coder:
    <|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>; StarCoder2: <fim_prefix>, <fim_suffix>,
    <fim_middle>; docs/serving.md)."""

    prefix: str = Field(min_length=1, max_length=64)
    suffix: str = Field(min_length=1, max_length=64)
    middle: str = Field(min_length=1, max_length=64)
    order: Literal["psm", "spm"] = "psm"


# -- reasoning models ------------------------------------------------------------------------------
class ReasoningConfig(_Strict):
    """A reasoning (thinking) target: chat answers split the text between the tags out of
    `content` (docs/serving.md, "Reasoning models"). The output reasons when the rendered prompt
    leaves `start` open (DeepSeek-R1's template ends with it) or when it begins with `start`
    (Qwen3's hybrid models write it themselves); either way its reasoning ends at `end`. A grammar
    (response_format, structured_outputs, a tool grammar) then applies only from `end` on, so the
    model still thinks first. `fields`: the message and delta fields that carry the reasoning text
    (vLLM's `reasoning`, DeepSeek's and SGLang's `reasoning_content`, or both)."""

    start: str = Field("<think>", min_length=1, max_length=64)
    end: str = Field("</think>", min_length=1, max_length=64)
    fields: tuple[Literal["reasoning", "reasoning_content"], ...] = Field(("reasoning",), min_length=1)

    @model_validator(mode="after")
    def _distinct(self) -> "ReasoningConfig":
        if not self.start.strip() or not self.end.strip():
            raise ValueError("reasoning.start and reasoning.end must not be blank")
        if self.start == self.end or self.end.startswith(self.start):
            raise ValueError("reasoning.end must differ from reasoning.start and not begin with it")
        if len(set(self.fields)) < len(self.fields):
            raise ValueError("reasoning.fields names a field twice")
        return self


class ResponsesConfig(_Strict):
    """The Responses API (`/v1/responses`): what it keeps of the responses it gave. With `store`,
    a request with `store: true` (OpenAI's default) is kept in the app's ResponseStore deployment
    (memory; the least recently used dropped beyond either bound), so that a later request's
    `previous_response_id` goes on from it and `GET /v1/responses/{id}` finds it. With `store`,
    too, the Conversations API (`/v1/conversations`) keeps conversations in the app's
    ConversationStore deployment, within bounds of their own. With `persist_dir`, both stores
    keep a journal of their changes in that directory (`responses.jsonl`, `conversations.jsonl`)
    and read it back when their replica restarts; it must be reachable where the store replicas
    run (on a cluster, a shared filesystem: Serve may restart a replica on another node)."""

    store: bool = True
    max_stored: int = Field(1024, ge=1)  # responses kept
    max_stored_bytes: int = Field(64 << 20, ge=1 << 16)  # their JSON, in all
    max_conversations: int = Field(1024, ge=1)  # conversations kept
    max_conversation_bytes: int = Field(64 << 20, ge=1 << 16)  # their items' and metadata's JSON, in all
    compaction_max_tokens: int = Field(1024, ge=16)  # a /v1/responses/compact summary's (and a quarter of the context)
    persist_dir: str | None = Field(None, min_length=1)  # where the stores' journals are (None: memory only)

    def journal(self, store: str) -> str | None:
        """The journal file of one store ("responses", "conversations"); None where nothing is kept
        or persist_dir is not set. A relative persist_dir is taken from where this is asked (the
        app is built), so the replicas, wherever their working directory is, use the same file."""
        if not self.store or self.persist_dir is None:
            return None
        return os.path.join(os.path.abspath(os.path.expanduser(self.persist_dir)), f"{store}.jsonl")


# -- the application -----------------------------------------------------------------------------


class AppConfig(_Strict):
    served_model_name: str = Field(min_length=1)
    target: ModelSource
    draft: ModelSource | None = None  # a separate draft model, in its own worker and bundle
    drafter: ColocatedDrafter | None = None  # or a drafter inside the target worker (no draft model)
    tokenizer: str | None = None  # a local tokenizer directory; default: the target's
    # The chat template chats are rendered with instead of the tokenizer's: inline Jinja, or the path
    # of a file holding it, readable where the ingress runs (vLLM's --chat-template)
    chat_template: str | None = Field(None, min_length=1)
    # Template variables every chat gets unless it sends its own chat_template_kwargs, e.g.
    # {enable_thinking: false} (vLLM's --default-chat-template-kwargs)
    default_chat_template_kwargs: dict[str, Any] | None = None
    speculation: SpeculationConfig = SpeculationConfig()
    max_batch_size: int = Field(32, ge=1)
    max_model_len: int | None = Field(None, ge=2)  # default: the models' own limit
    # Chunked prefill: the most prompt tokens each worker prefills per step, in a forward of its own
    # beside the step, so that a long prompt delays running streams by one bounded chunk per step
    # instead of its whole prefill (docs/engine.md); 0: a new prompt is prefilled whole in its first step.
    prefill_chunk_tokens: int = Field(512, ge=0)
    # Overload, per coordinator replica: requests waiting for the running batch beyond this are
    # refused (HTTP 429 + Retry-After); 0 = no waiting at all (admit or refuse).
    max_queued_requests: int = Field(32, ge=0)
    # KV-cache budget per worker, in ALLOCATED token positions: the dense cache holds one slot per
    # running request, each sized for the longest one, so a request joins only while
    # (batch_bucket(running + 1) + 1 scratch) x capacity_for(longest prompt + max_tokens + γ) fits
    # (None: no budget).
    max_cached_tokens: int | None = Field(None, ge=2)
    # Keep each worker's KV cache by blocks of this many positions (a paged cache: every request
    # allocates its own length, admission counts blocks; with max_cached_tokens the pool is that many
    # positions, allocated once). None: the dense cache above.
    kv_block_size: int | None = Field(None, ge=1, le=4096)
    # With kv_block_size: a prompt prefix whose KV an earlier request computed (a shared system
    # prompt, a multi-turn chat) is shared block by block instead of computed again; reported in
    # usage.prompt_tokens_details.cached_tokens. A feature head's target features are kept with
    # the blocks (docs/engine.md).
    prefix_caching: bool = False
    # Per request, arrival to last token: a request still unfinished after this fails with a 504
    # (the Serve proxy's http_options.request_timeout_s should be a little longer).
    request_timeout_s: float = Field(600.0, gt=0)
    # When the coordinator replica running a request is lost (dies, or is replaced), the ingress
    # continues it on another replica from the tokens already delivered, at most this many times
    # per request (0: never; the client gets a 503, or an SSE error event once streaming).
    max_resumes: int = Field(3, ge=0)
    deadlines: Deadlines = Deadlines()
    # Bearer key (or keys) every route but /health requires (None: the environment's
    # SPECSERVE_API_KEY, comma-separated keys, if set, else no authentication). Prefer the
    # environment: a config's args are stored by Serve.
    api_key: Annotated[str, Field(min_length=1)] | tuple[Annotated[str, Field(min_length=1)], ...] | None = None
    front_door: FrontDoorConfig = FrontDoorConfig()
    reasoning: ReasoningConfig | None = None  # the target is a reasoning model (None: no split)
    fim: FimConfig | None = None  # the target fills in the middle (None: `suffix` is refused)
    responses: ResponsesConfig = ResponsesConfig()
    ingress: DeploymentConfig = DeploymentConfig(resources=Resources(num_cpus=0.1))
    coordinator: DeploymentConfig = DeploymentConfig(resources=Resources(num_cpus=0.1))
    target_worker: Resources = Resources()
    draft_worker: Resources = Resources()
    placement_group_strategy: Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"] = "PACK"

    @model_validator(mode="after")
    def _consistent(self) -> "AppConfig":
        if self.draft is not None and self.drafter is not None:
            raise ValueError("give either a draft model (draft) or a drafter (drafter), not both")
        if self.speculation.pipelined and not self.has_draft_worker:
            raise ValueError("speculation.pipelined needs a draft worker (a draft model, or a feature drafter with "
                             "worker: draft): a drafter inside the target worker cannot run while the target verifies")
        if self.speculation.planted is not None and self.draft is None:
            raise ValueError("speculation.planted needs a draft model (draft:) whose proposals it plants")
        if not getattr(self.drafter, "own_drafts", True) and self.speculation.num_speculative_tokens == 0:
            raise ValueError("drafter kind prediction drafts up to speculation.num_speculative_tokens predicted tokens "
                             "a step: set it above 0")
        if self.draft is None and self.drafter is None and self.speculation.num_speculative_tokens > 0:
            raise ValueError("speculation.num_speculative_tokens > 0 needs a draft model or a drafter (or set it to 0)")
        if self.draft is not None and self.draft.kind != self.target.kind and "tiny" in (self.draft.kind, self.target.kind):
            raise ValueError("a tiny draft only fits a tiny target (they share the byte tokenizer)")
        self._check_limits()
        self._check_failure_domains()
        bad = [k for k in self.default_chat_template_kwargs or {} if not k.isidentifier()]
        if bad:
            raise ValueError(f"default_chat_template_kwargs: {bad[0][:64]!r} is not a template variable's name")
        if self.coordinator.max_replicas_per_node is not None:
            raise ValueError("coordinator.max_replicas_per_node: a coordinator replica is a placement group, which "
                             "Serve places by its bundles (see placement_group_strategy and custom resources)")
        if self.deadlines.health_probe_s >= self.coordinator.health_check_timeout_s:
            raise ValueError("deadlines.health_probe_s must be below coordinator.health_check_timeout_s")
        return self

    @property
    def has_draft_worker(self) -> bool:
        """Whether drafts come from a draft worker of their own (a draft model, or a feature head
        placed there) rather than from inside the target worker."""
        return self.draft is not None or getattr(self.drafter, "worker", "target") == "draft"

    @property
    def worker_kv(self) -> tuple:
        """How a worker keeps its KV caches (`engine.page_runners`' arguments): block size (None:
        dense), budget, prefix caching, and the most caches at once (requests, and a pipelined
        draft side's branch forks) and widest forward that size a windowed layers' own pool."""
        from specserve.engine.admission import widest_forward

        spec = self.speculation
        forks = min(spec.branches, spec.num_speculative_tokens) if spec.pipelined else 0
        return (self.kv_block_size, self.max_cached_tokens, self.prefix_caching, self.max_batch_size * (1 + forks),
                widest_forward(self.prefill_chunk_tokens, spec.num_speculative_tokens))

    def max_ongoing(self, deployment: Literal["ingress", "coordinator"]) -> int:
        """A deployment's max_ongoing_requests, by default the larger of BURST_ONGOING and the least
        the other limits need (a coordinator: its batch and queue plus room for control calls)."""
        least = self.max_batch_size + self.max_queued_requests + CONTROL_HEADROOM if deployment == "coordinator" else 1
        return getattr(self, deployment).max_ongoing_requests or max(BURST_ONGOING, least)

    def _check_failure_domains(self) -> None:
        """Workers pinned to node kinds (custom resources) put groups on chosen GPU nodes; an
        unpinned coordinator bundle could then land on *another* group's GPU node, and one lost node
        would break two groups. Pin it (to CPU-only nodes, or a share of its target's resource)."""
        workers = [self.target_worker] + ([self.draft_worker] if self.has_draft_worker else [])
        pinned = any(w.custom_request() for w in workers)
        if pinned and not self.coordinator.resources.custom_request() and self.placement_group_strategy != "STRICT_PACK":
            raise ValueError("the workers are pinned to nodes by custom resources but the coordinator's bundle is not: "
                             "under PACK or SPREAD it may land on another group's GPU node, and one lost node would "
                             "break two groups. Set coordinator.resources.custom, e.g. {cpu_node: 0.01} with CPU-only "
                             "nodes that declare it (docs/multi-gpu.md, \"Failure domains\")")

    def _check_limits(self) -> None:
        """Limits that contradict each other make overload unbounded or the budget unusable."""
        holds = self.max_batch_size + self.max_queued_requests + CONTROL_HEADROOM
        if self.max_ongoing("coordinator") < holds:
            raise ValueError(
                f"coordinator.max_ongoing_requests ({self.max_ongoing('coordinator')}) must be >= "
                f"max_batch_size + max_queued_requests + {CONTROL_HEADROOM} ({holds}): otherwise Serve queues "
                "requests in front of the coordinator, whose own 429 never triggers, and /v1/stats and health "
                "calls find no free slot")
        if self.prefix_caching and not self.kv_block_size:
            raise ValueError("prefix_caching needs a paged cache: set kv_block_size (e.g. 16)")
        if self.max_cached_tokens is not None and self.max_model_len is not None:
            from specserve.engine.admission import allocation, worst_positions

            worst = worst_positions(self.max_model_len, self.speculation.num_speculative_tokens, self.kv_block_size)
            one = allocation([worst], self.kv_block_size)
            if one > self.max_cached_tokens:
                raise ValueError(f"max_cached_tokens ({self.max_cached_tokens}) cannot hold one request of "
                                 f"max_model_len ({self.max_model_len}): it and the scratch "
                                 f"{'block' if self.kv_block_size else 'slot'} allocate {one} positions")

    def coordinator_bundles(self) -> list[dict[str, float]]:
        """[coordinator, target worker, draft worker (only with one)]: one placement group per
        coordinator replica."""
        bundles = [self.coordinator.resources.bundle(), self.target_worker.bundle()]
        return bundles + ([self.draft_worker.bundle()] if self.has_draft_worker else [])


def load_app_config(args: dict) -> AppConfig:
    """Validate a Serve application's `args` once; raises pydantic.ValidationError."""
    return AppConfig.model_validate(args)
