"""Prometheus metrics of a coordinator replica, through Ray's metrics system (`ray.util.metrics`).

Ray exports them on every node's metrics port (`ray.init(_metrics_export_port=...)`, or the port in
`<session>/metrics_export_port`) with a `ray_` prefix, e.g. `ray_specserve_spec_decode_num_draft_tokens_total`.
Names follow vLLM's (`vllm:X` -> `specserve_X`; Ray no longer accepts ':' in metric names). Every
series carries `model_name` (the served model) and Ray's own `WorkerId` / `SessionName` labels:
sum over `WorkerId` for a deployment's total (a restarted replica starts fresh series).

    counters   spec_decode_num_drafts, spec_decode_num_draft_tokens, spec_decode_num_accepted_tokens,
               spec_decode_num_accepted_tokens_per_pos{position}, spec_decode_num_prediction_tokens,
               spec_decode_num_accepted_prediction_tokens, spec_decode_num_recalled_tokens,
               spec_decode_num_accepted_recalled_tokens, prompt_tokens, generation_tokens,
               request_success{finished_reason}, request_rejected{reason}, target_only_steps
    gauges     num_requests_running, num_requests_waiting, spec_decode_acceptance_rate,
               kv_cache_usage_tokens{worker}, kv_cache_reserved_tokens, kv_cache_usage_perc,
               draft_available
    histograms time_to_first_token_seconds, inter_token_latency_seconds
"""
from __future__ import annotations

from ray.util.metrics import Counter, Gauge, Histogram

PREFIX = "specserve_"
_LATENCY_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                    1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0]


class CoordinatorMetrics:
    """One replica's metric objects, tagged with the served model name."""

    def __init__(self, model_name: str) -> None:
        self.tags = {"model_name": model_name}
        keys = ("model_name",)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, description=doc, tag_keys=keys + extra)

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
            return Gauge(PREFIX + name, description=doc, tag_keys=keys + extra)

        self.num_drafts = counter("spec_decode_num_drafts", "Request-steps that drafted at least one token.")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed and verified.")
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position (0 = first).", ("position",))
        self.num_prediction_tokens = counter("spec_decode_num_prediction_tokens",
                                             "Drafts taken from the requests' predictions (prediction), verified.")
        self.num_accepted_prediction_tokens = counter("spec_decode_num_accepted_prediction_tokens",
                                                      "Drafts taken from the requests' predictions, accepted.")
        self.num_recalled_tokens = counter("spec_decode_num_recalled_tokens",
                                           "Drafts recalled from earlier answers (speculation.history), verified.")
        self.num_accepted_recalled_tokens = counter("spec_decode_num_accepted_recalled_tokens",
                                                    "Drafts recalled from earlier answers, accepted.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.request_success = counter("request_success", "Requests finished, by finish reason.",
                                       ("finished_reason",))
        self.request_rejected = counter("request_rejected", "Requests refused by the coordinator, by reason.",
                                        ("reason",))
        self.target_only_steps = counter("target_only_steps",
                                         "Steps run without the draft because it was restarting.")
        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting for admission.")
        self.acceptance_rate = gauge("spec_decode_acceptance_rate",
                                     "Accepted / draft tokens since this replica started.")
        self.kv_usage = gauge("kv_cache_usage_tokens", "Tokens held in each worker's KV cache.", ("worker",))
        self.kv_reserved = gauge("kv_cache_reserved_tokens", "Cache positions the running batch may allocate "
                                 "(running x capacity for the longest prompt + max_tokens + gamma).")
        self.kv_usage_perc = gauge("kv_cache_usage_perc", "Reserved positions / max_cached_tokens (0 when unset).")
        self.draft_available = gauge("draft_available", "1 when the draft worker answers, 0 while it restarts.")
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", description="Arrival to first token.",
                              boundaries=_LATENCY_BUCKETS, tag_keys=keys)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", description="Time between output tokens.",
                             boundaries=_LATENCY_BUCKETS, tag_keys=keys)

    def inc(self, counter: Counter, value: float, **extra: str) -> None:
        if value:
            counter.inc(value, tags={**self.tags, **extra})

    def set(self, gauge: Gauge, value: float, **extra: str) -> None:
        # recorded every time, changed or not: a gauge recorded only on change dropped out of the
        # export (test_prometheus_metrics_add_up)
        gauge.set(value, tags={**self.tags, **extra})

    def observe(self, histogram: Histogram, value: float) -> None:
        histogram.observe(value, tags=self.tags)
