"""Serving pieces that need no Ray cluster: config validation, detokenisation, stop strings."""
from pathlib import Path

import pydantic
import pytest
import yaml

from specserve.config import load_app_config
from specserve.serve.text import IncrementalDetokenizer, StopStrings
from specserve.models.tiny import byte_tokenizer

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_config_validates_and_builds(path):
    from specserve.serve.app import build_app

    for app in yaml.safe_load(path.read_text())["applications"]:
        config = load_app_config(app["args"])
        assert len(config.coordinator_bundles()) == (3 if config.has_draft_worker else 2)
        build_app(app["args"])


@pytest.mark.parametrize("bad", [
    {"served_model_name": "x", "target": {"kind": "tiny"}},  # γ = 4 by default, no draft
    {"served_model_name": "x", "target": {"kind": "nope"}},
    {"served_model_name": "x", "target": {"kind": "tiny"}, "draft": {"kind": "tiny"}, "max_batch_size": 0},
    {"served_model_name": "x", "target": {"kind": "tiny"}, "draft": {"kind": "tiny"}, "typo": 1},
    {"served_model_name": "x", "target": {"kind": "tiny"}, "draft": {"kind": "tiny"},
     "coordinator": {"autoscaling": {"min_replicas": 3, "max_replicas": 2}}},
    # limits that contradict each other: the coordinator's own 429 could never trigger
    {"served_model_name": "x", "target": {"kind": "tiny"}, "draft": {"kind": "tiny"}, "max_batch_size": 64,
     "max_queued_requests": 256, "coordinator": {"max_ongoing_requests": 96}},
    # a KV budget that cannot hold one request of the advertised context
    {"served_model_name": "x", "target": {"kind": "tiny"}, "draft": {"kind": "tiny"}, "max_model_len": 512,
     "max_cached_tokens": 512},
    # a health probe that outlasts Serve's own health-check timeout
    {"served_model_name": "x", "target": {"kind": "tiny"}, "draft": {"kind": "tiny"},
     "deadlines": {"health_probe_s": 30}},
])
def test_bad_config_is_rejected(bad):
    with pytest.raises(pydantic.ValidationError):
        load_app_config(bad)


def test_custom_resources_join_the_bundles_and_the_actor_options():
    from specserve.serve.app import _options

    base = {"served_model_name": "x", "target": {"kind": "tiny"}, "draft": {"kind": "tiny"}}
    config = load_app_config({**base, "target_worker": {"num_cpus": 0.2, "custom": {"gpu_node_a": 1}},
                              "draft_worker": {"num_gpus": 1, "custom": {"accelerator_type:H100": 0.001, "z": 0}},
                              "ingress": {"resources": {"num_cpus": 0.1, "custom": {"edge": 1}}},
                              "coordinator": {"resources": {"num_cpus": 0.1, "custom": {"cpu_node": 0.01}}}})
    assert config.coordinator_bundles() == [{"CPU": 0.1, "cpu_node": 0.01}, {"CPU": 0.2, "gpu_node_a": 1.0},
                                            {"CPU": 0.25, "GPU": 1.0, "accelerator_type:H100": 0.001}]
    assert _options("ingress", config)["ray_actor_options"]["resources"] == {"edge": 1.0}
    assert _options("coordinator", config)["ray_actor_options"]["resources"] == {"cpu_node": 0.01}
    assert "resources" not in _options("coordinator", load_app_config(base))["ray_actor_options"]
    for bad in [{"GPU": 1}, {"cpu": 1}, {"memory": 1}, {"object_store_memory": 1}, {"": 1}, {"a": -1},
                {"a": float("nan")}, {"a": float("inf")}, {"a": "lots"}]:
        with pytest.raises(pydantic.ValidationError):
            load_app_config({**base, "draft_worker": {"custom": bad}})


def test_incremental_detokenizer_never_splits_a_character():
    tok = byte_tokenizer()
    text = "héllo → 你好 🙂 done"
    ids = tok(text).input_ids
    detok = IncrementalDetokenizer(tok, tok("prompt: ").input_ids)
    pieces = [detok.push([t]) for t in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_incremental_text_does_not_depend_on_how_tokens_are_chunked():
    """Invalid UTF-8 and skipped special tokens (a tiny random model makes plenty): whatever
    chunks the ids arrive in (coordinator steps, merged deltas, a continuation on another
    replica), the streamed text is the same: the one-shot decode of the output."""
    import random

    tok = byte_tokenizer()
    for trial in range(150):
        rng = random.Random(trial)
        prompt = [rng.randrange(32, 127) for _ in range(rng.randint(1, 6))]
        output = [rng.choice([rng.randrange(0, 256), rng.randrange(128, 256), 256, rng.randrange(32, 127)])
                  for _ in range(rng.randint(1, 60))]
        want = tok.decode(output, skip_special_tokens=True)
        for seed in range(6):
            chunks, detok, i, text = random.Random(seed), IncrementalDetokenizer(tok, prompt), 0, ""
            while i < len(output):
                k = chunks.randint(1, 9)
                text += detok.push(output[i : i + k])
                i += k
            assert text + detok.flush() == want, (prompt, output, seed)


def test_stop_strings_hold_back_and_cut():
    stops = StopStrings(["END", "xyz"])
    out = [stops.feed(t, False) for t in ["abc E", "N", "D tail"]]
    assert "".join(o for o, _ in out) == "abc " and out[-1][1] is True
    plain = StopStrings(["zzz"])
    assert plain.feed("abcz", False) == ("ab", False) and plain.feed("", True) == ("cz", False)


def test_no_stop_string_ends_in_shielded_text():
    """min_tokens' first tokens: a stop string ending in them is not a hit, one ending after them is,
    even when it begins inside them."""
    stops = StopStrings(["END"])
    stops.shield("xEND E")
    assert stops.feed("N", False) == ("xEND ", False)
    assert stops.feed("D tail", False) == ("", True)
    late = StopStrings(["END"])
    late.shield("xEN")
    assert late.feed("D", False) == ("x", True)


def test_drafter_config_is_either_a_draft_model_or_a_colocated_drafter():
    from specserve.config import AppConfig
    from specserve.engine.proposers import LayerSkipSpec, PromptLookupSpec

    base = {"served_model_name": "m", "target": {"kind": "tiny"}}
    lookup = AppConfig.model_validate({**base, "drafter": {"kind": "prompt_lookup", "min_n": 2, "max_n": 4}})
    assert lookup.drafter.engine_spec() == PromptLookupSpec(2, 4) and len(lookup.coordinator_bundles()) == 2
    skip = AppConfig.model_validate({**base, "drafter": {"kind": "layer_skip", "skip_layers": [3, 1]}})
    assert skip.drafter.engine_spec() == LayerSkipSpec((1, 3))
    with_draft = AppConfig.model_validate({**base, "draft": {"kind": "tiny", "noise": 0.1}})
    assert len(with_draft.coordinator_bundles()) == 3
    for bad in ({"draft": {"kind": "tiny"}, "drafter": {"kind": "prompt_lookup"}},
                {"drafter": {"kind": "prompt_lookup", "min_n": 3, "max_n": 2}},
                {"drafter": {"kind": "layer_skip", "skip_layers": []}},
                {"drafter": {"kind": "medusa"}}):
        with pytest.raises(ValueError):
            AppConfig.model_validate({**base, **bad})


# -- coordinator logic without Ray: health checks, deadlines, failure isolation ---------------------
class _Method:
    """A stand-in for an actor method: `.remote()` gives an awaitable that answers, hangs or raises."""

    def __init__(self, log: list, name: str, behaviour) -> None:
        self.log, self.name, self.behaviour = log, name, behaviour

    def remote(self, *args):
        self.log.append(self.name)
        return self.behaviour(*args)


def _bare_coordinator(**attrs):
    from specserve.serve.coordinator import Coordinator

    coordinator = object.__new__(Coordinator.func_or_class)
    coordinator.__dict__.update(attrs)
    return coordinator


def test_check_health_raises_after_repeated_misses_and_probes_each_actor_once():
    import asyncio
    import types

    from specserve.config import Deadlines

    log: list = []
    hang = {"on": True}

    async def ready():
        await asyncio.sleep(3600 if hang["on"] else 0)
        return True

    target = types.SimpleNamespace(ready=_Method(log, "target", ready))
    # a colocated drafter: the draft side IS the target actor, so there is no draft worker to probe
    coordinator = _bare_coordinator(deadlines=Deadlines(health_probe_s=0.05, health_misses=3), target=target,
                                    draft_worker=None, _health_misses={"target": 0, "draft": 0})

    async def run():
        await coordinator.check_health()
        await coordinator.check_health()
        hang["on"] = False  # answering again resets the count
        await coordinator.check_health()
        hang["on"] = True
        for _ in range(2):
            await coordinator.check_health()
        with pytest.raises(RuntimeError, match="target worker unanswered for 3 health checks"):
            await coordinator.check_health()

    asyncio.run(run())
    assert log == ["target"] * 6


def test_call_deadline_grows_with_the_tokens_a_call_carries():
    import torch

    from specserve.config import Deadlines
    from specserve.engine import RowInput
    from specserve.engine.model_runner import ForwardTiming
    from specserve.engine.policy import SpeculationPolicy
    from specserve.serve.calls import WorkerCalls

    policy = SpeculationPolicy(4)
    policy.observe_costs("target", [ForwardTiming(n, 0.001 * n) for n in (1, 8, 32, 64)])
    policy.observe_costs("draft", [ForwardTiming(n, 0.0001 * n) for n in (1, 8, 32, 64)])
    calls = WorkerCalls(None, Deadlines(multiple=10, target_floor_s=2, draft_floor_s=0.5), policy, {})
    decode = [RowInput(f"r{i}", 100, [1]) for i in range(8)]
    prefill = decode + [RowInput("long", 0, [1] * 4001)]
    drafts = torch.zeros(8, 4, dtype=torch.long)
    short = calls.deadline("target", decode, drafts)
    assert short == pytest.approx(2 + 10 * 0.001 * 40)  # 8 rows x (1 + 4) tokens
    long = calls.deadline("target", prefill, torch.zeros(9, 4, dtype=torch.long))
    assert long >= 2 + 10 * 0.001 * 4000  # the prefill is priced in: 40 s, not mistaken for a hang
    assert calls.deadline("draft", decode, 4) == pytest.approx(0.5 + 10 * 4 * 0.0001 * 8)
    assert calls.deadline("draft", prefill, 4) > 0.5 + 10 * 0.0001 * 4000


def test_a_failed_step_fails_only_the_request_it_fails_on():
    import asyncio
    import types

    from specserve.engine.sampling import SamplingParams
    from specserve.engine.policy import SpeculationPolicy
    from specserve.engine.step import StepOutput, new_sequence
    from specserve.engine.admission import Admission
    from specserve.engine.loop import StepLoop
    from specserve.serve.coordinator import Failed

    seqs = [new_sequence(rid, [1, 2], SamplingParams(max_tokens=4), vocab_size=10, max_model_len=64,
                         eos_token_ids=frozenset()) for rid in ("a", "bad", "c")]
    admission = Admission(8, None, 0)
    for seq in seqs:
        admission.enqueue(seq)
    admission.admit()
    freed: list = []

    async def step(batch, policy):
        if any(s.request_id == "bad" for s in batch):
            raise RuntimeError("CUDA out of memory; internal detail")
        return [StepOutput(s.request_id, [5], None) for s in batch]

    executor = types.SimpleNamespace(step=step, target_only=SpeculationPolicy(0, adaptive=False),
                                     free=lambda ids: freed.append("target"))
    coordinator = _bare_coordinator(
        admission=admission, _aborted=set(), executor=executor, loop=StepLoop(admission, executor, None, None),
        _queues={s.request_id: asyncio.Queue() for s in seqs}, _totals={"requests_failed": 0})
    outputs = asyncio.run(coordinator._isolate(seqs, RuntimeError("the whole step failed")))
    assert [o.request_id for o in outputs] == ["a", "c"]
    failed = coordinator._queues["bad"].get_nowait()
    assert isinstance(failed, Failed) and failed.code == "engine_error"
    assert "error id" in failed.message and "memory" not in failed.message and "internal" not in failed.message
    assert set(admission.running) == {"a", "c"} and coordinator._totals["requests_failed"] == 1
    assert freed == ["target"]


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_bound_every_queue_and_timeout(path):
    from specserve.serve.app import _options

    spec = yaml.safe_load(path.read_text())
    for app in spec["applications"]:
        config = load_app_config(app["args"])
        # Serve's HTTP timeout outlasts the request deadline, so the coordinator's 504 arrives first
        assert spec["http_options"]["request_timeout_s"] > config.request_timeout_s
        assert config.max_ongoing("coordinator") >= config.max_batch_size + config.max_queued_requests + 8
        for name in ("ingress", "coordinator"):
            options = _options(name, config)
            assert options["max_queued_requests"] >= 0  # Serve's queue is bounded (-1 would be unbounded)
            assert options["backpressure_config"]["status_code"] == 429
            assert options["graceful_shutdown_timeout_s"] >= config.request_timeout_s
def test_a_public_bind_needs_a_key(monkeypatch, tmp_path):
    from specserve.cli import main, unauthenticated_public

    monkeypatch.delenv("SPECSERVE_API_KEY", raising=False)
    app = {"name": "a", "args": {}}
    public = {"http_options": {"host": "0.0.0.0"}, "applications": [app]}
    assert unauthenticated_public(public) == ["a"]
    assert unauthenticated_public({**public, "http_options": {"host": "127.0.0.1"}}) == []
    assert unauthenticated_public({**public, "http_options": {"host": "::1"}}) == []
    assert unauthenticated_public(public, allow=True) == []
    assert unauthenticated_public({**public, "applications": [{"name": "a", "args": {"api_key": "k"}}]}) == []
    opt_out = {"name": "a", "args": {"front_door": {"allow_unauthenticated_public": True}}}
    assert unauthenticated_public({**public, "applications": [opt_out]}) == []
    monkeypatch.setenv("SPECSERVE_API_KEY", "k")
    assert unauthenticated_public(public) == []
    monkeypatch.delenv("SPECSERVE_API_KEY")
    # the CLI refuses before starting anything
    path = tmp_path / "public.yaml"
    path.write_text(yaml.safe_dump(public))
    assert main(["serve", str(path)]) == 2


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_bind_loopback_or_require_a_key(path):
    from specserve.serve.front_door import is_loopback

    spec = yaml.safe_load(path.read_text())
    if not is_loopback(spec.get("http_options", {}).get("host", "127.0.0.1")):
        for app in spec["applications"]:
            assert load_app_config(app["args"]).front_door.require_api_key, app["name"]



def test_a_worker_calls_seconds_include_its_queued_gpu_work(monkeypatch):
    """A worker method's result may still be computing on the GPU when it returns (a draft's
    tokens stay on the device until the reply is pickled). Its seconds must wait for that work, or
    the coordinator counts GPU time as coordination (`rpc_overhead`; the first H200 run read
    10.4 ms p50 at one stream, on steps of about 19 ms)."""
    import threading
    import time

    import torch

    from specserve.serve.workers import _Worker

    waited = []

    def synchronize():
        time.sleep(0.05)  # the device finishing what the method queued
        waited.append(True)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    worker = _Worker.__new__(_Worker)
    worker._lock, worker._torch_threads, worker._thread_state = threading.RLock(), None, threading.local()
    reply = worker._run([], lambda: "queued", holder=object())
    assert reply.result == "queued" and waited and reply.seconds >= 0.05


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_replica_has_its_workers_capture_their_graphs_before_any_request(local_coordinator, monkeypatch, pipelined):
    """Served workers capture the usual step shapes at start, as the in-process engine does (on
    the first H200 run they captured only as shapes came, inside requests): the target its
    verifier's, the draft worker its proposer's, for the replica's batch size and γ (γ + 1 for a
    pipelined replica's draft worker: its ahead calls draft one more)."""
    import specserve.serve.workers as workers
    from specserve.config import AppConfig
    from specserve.engine import DraftModelProposer, TargetVerifier

    calls = []
    monkeypatch.setattr(workers, "capture_graphs", lambda *a, **kw: calls.append((*a, kw["budget"])) or 0.0)
    tiny = {"kind": "tiny", "seed": 0, "layers": 2, "hidden_size": 64}
    config = AppConfig.model_validate(dict(
        served_model_name="tiny", target=tiny, draft={**tiny, "noise": 0.15, "noise_seed": 1}, max_batch_size=6,
        max_cached_tokens=4096,
        speculation=dict(num_speculative_tokens=3, execution="eager", transport="actor_calls", pipelined=pipelined),
        max_model_len=256))
    local_coordinator(config)
    (verifier, none, *sizes), (none_too, proposer, *drafts) = calls
    assert isinstance(verifier, TargetVerifier) and isinstance(proposer, DraftModelProposer)
    assert none is None and none_too is None and sizes == [6, 3, 4096] and drafts == [6, 3 + pipelined, 4096]


def test_a_worker_says_when_its_graphs_sit_on_a_cache_that_will_grow(monkeypatch, caplog):
    """CUDA graphs over a dense cache not sized up front are dropped at every growth (each
    256-position step of context): a served worker warns at start unless its cache holds the whole
    stated max_model_len."""
    import logging

    import specserve.engine.model_runner as model_runner
    import specserve.serve.workers as workers
    from specserve.engine import ModelRunner
    from specserve.models.tiny import tiny_llama

    model = tiny_llama(0, max_position_embeddings=1024)
    free = {"bytes": 1 << 40}
    monkeypatch.setattr(model_runner, "free_memory_bytes", lambda device: free["bytes"])

    def graph_runner(max_model_len):
        runner = ModelRunner(model, max_model_len)
        runner.execution, runner.graphs = "graph", object()  # (as a runner made on a GPU: preallocate's rule)
        return runner

    sized = graph_runner(300)
    assert sized.preallocate(4) and sized.sized_up_front
    assert not graph_runner(None).sized_up_front  # nothing stated: it grows as contexts do
    free["bytes"] = 1
    squeezed = graph_runner(300)
    assert not squeezed.preallocate(4) and not squeezed.sized_up_front  # stated, but did not fit

    worker = workers.TargetWorker.__new__(workers.TargetWorker)
    monkeypatch.setattr(workers, "capture_graphs", lambda *a, **kw: 0.0)
    for runner, warned in ((sized, False), (squeezed, True)):
        verifier = type("Verifier", (), {"runner": runner})()
        monkeypatch.setattr(worker, "_graph_sides", lambda: (verifier, None), raising=False)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=workers.__name__):
            workers.TargetWorker.capture_graphs.__wrapped__(worker, 4, 3)
        assert ("not sized up front (it did not fit)" in caplog.text) == warned


def workers_in_graph_mode(monkeypatch) -> None:
    """Workers made from now on put their runners in graph mode (emulated on the CPU) when the
    coordinator has them capture their graphs, then capture as on a GPU."""
    import specserve.serve.workers as workers
    from test_engine_static import emulate_graphs

    capture = workers.capture_graphs

    def in_graph_mode(verifier, proposer, *args, **kwargs):
        for side in (verifier, proposer):
            if side is not None:
                emulate_graphs(side.runner)
                if hasattr(side, "host_stop"):
                    side.host_stop = False  # a feature head's setting on a GPU
        return capture(verifier, proposer, *args, **kwargs)

    monkeypatch.setattr(workers, "capture_graphs", in_graph_mode)


@pytest.mark.parametrize("pipelined", [False, True])
def test_served_sampled_requests_meet_draft_loops_captured_before_the_first_request(local_coordinator, monkeypatch,
                                                                                    pipelined):
    """Served workers in graph mode (emulated), a stated context: greedy and sampled requests
    together (OpenAI clients sample at temperature 1 unless told otherwise) meet every draft loop
    already captured; each captured one would have been a stall inside some request. The sampled
    tokens equal the same requests run eagerly."""
    import specserve.engine.model_runner as model_runner
    from specserve.engine import SamplingParams
    from test_pipeline import config, generate

    monkeypatch.setattr(model_runner, "free_memory_bytes", lambda device: 1 << 40)
    prompts = [[(5 * i + k) % 90 + 1 for i in range(6 + 3 * k)] for k in range(3)]
    params = [SamplingParams(max_tokens=20, temperature=t, seed=k, ignore_eos=True)
              for k, t in enumerate((1.0, 0.0, 0.7))]
    eager = generate(local_coordinator(config(pipelined, gamma=3, max_batch_size=4)), prompts, params)
    workers_in_graph_mode(monkeypatch)
    coordinator = local_coordinator(config(pipelined, gamma=3, max_batch_size=4))
    draft = coordinator.draft_worker._obj.model.runner
    ahead = len(draft.graphs)
    assert generate(coordinator, prompts, params) == eager
    assert len(draft.graphs) == ahead > 0


@pytest.mark.parametrize("pipelined", [False, True])
def test_served_caches_without_a_stated_length_grow_as_requests_join_not_mid_decode(local_coordinator, monkeypatch,
                                                                                  pipelined):
    """Served workers in graph mode (emulated) with no max_model_len: the coordinator has their
    dense caches sized for the running requests' worst case when requests join, as the in-process
    engine does, so no storage moves while they decode (a move drops every captured graph, and each
    is captured again mid-request). Before, their caches grew as contexts passed 256 positions.
    Tokens are the target's."""
    import specserve.engine.model_runner as model_runner
    from models import hf_greedy
    from specserve.config import AppConfig
    from specserve.engine import SamplingParams
    from test_pipeline import TINY, generate

    monkeypatch.setattr(model_runner, "free_memory_bytes", lambda device: 1 << 40)
    workers_in_graph_mode(monkeypatch)
    coordinator = local_coordinator(AppConfig.model_validate(dict(
        served_model_name="tiny", target=TINY, draft={**TINY, "noise": 0.15, "noise_seed": 1}, max_batch_size=4,
        speculation=dict(num_speculative_tokens=3, adaptive=False, pipelined=pipelined, execution="eager",
                         transport="actor_calls"))))
    assert coordinator.executor.growing == [coordinator.target, coordinator.draft_worker]
    runners = [coordinator.target._obj.model.runner, coordinator.draft_worker._obj.model.runner]
    steps = []  # per step: (requests that joined, whether either cache's storage moved)
    step = coordinator.executor.step

    async def recorded(seqs, policy):
        before = [r.cache.generation for r in runners]
        joined = {s.request_id for s in seqs} - {rid for step_ids, *_ in steps for rid in step_ids}
        outputs = await step(seqs, policy)
        steps.append(({s.request_id for s in seqs}, joined, [r.cache.generation for r in runners] != before))
        return outputs

    coordinator.executor.step = recorded
    prompts = [[(7 * i + k) % 200 + 1 for i in range(240 + 5 * k)] for k in range(3)]
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * 3
    target = coordinator.target._obj.model.runner.model
    assert generate(coordinator, prompts, params) == [hf_greedy(target, p, 24) for p in prompts]
    assert len(steps) > 10
    assert not any(moved for _, joined, moved in steps if not joined)  # contexts passed 256: nothing moved
    assert [r.cache.allocated()[1] for r in runners] == [512, 512]


def test_a_receive_serve_cancelled_is_a_disconnect():
    """A client gone mid-stream: Serve cancels the request and its receive raises
    TaskCancelledError, which the front door's receive hands on as the disconnect it is (Serve
    logged each as a future whose exception was never retrieved); other errors still raise."""
    import asyncio

    from ray.exceptions import TaskCancelledError

    from specserve.serve.front_door import _replay

    async def cancelled():
        raise TaskCancelledError()

    async def broken():
        raise RuntimeError("the proxy is gone")

    async def run(receive):
        replay = _replay(b"{}", receive)
        return await replay(), await replay()

    first, then = asyncio.run(run(cancelled))
    assert first == {"type": "http.request", "body": b"{}", "more_body": False}
    assert then == {"type": "http.disconnect"}
    with pytest.raises(RuntimeError, match="proxy"):
        asyncio.run(run(broken))


def test_the_cli_s_imports_before_ray_s_auth_mode_leave_ray_unimported():
    """`specserve serve` sets Ray's auth mode (RAY_AUTH_MODE, token) and then imports Ray, which
    reads it once: what it imports before (the front door's loopback check) must not import Ray,
    or the driver starts without the token its own cluster then asks for."""
    import subprocess
    import sys

    code = "import sys, specserve.cli, specserve.serve.front_door; print('ray' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"
