"""Engine benchmark on one accelerator, no Ray: measured speedup against the Leviathan bound.

    python -m specserve.bench.gpu [--out bench-results/gpu.json]      # on a GPU machine
    python -m specserve.bench.gpu --tiny                              # CPU smoke test (< 1 min)

Every configuration (γ=0 included) is built once, warmed on the very prompts it is timed on
(graphs captured, cost model calibrated), then timed in interleaved rounds; each keeps the median.
The random section also measures anchors on the same prompts: HF generate() eager, an HF
StaticCache decode loop (under torch.compile(mode="reduce-overhead") on CUDA, eager on a CPU), and
the bandwidth limit (weight bytes / measured copy bandwidth). Efficiency above 1.05 is flagged as
a measurement error.

Two sections, each at several batch sizes, every speculative run checked token for token against
the target-only run of the same prompts:

  smollm2   the offline SmolLM2-135M-Instruct target with its trained draft (specserve.models);
            γ in --gammas plus adaptive. Skipped, with a message, when the pair cannot be loaded.
  random    random-weight Llama shapes (default a 7B-class target, a 1.1B-class draft) with a
            *controlled-acceptance drafter*: it runs the real draft forwards (so its cost is real)
            but proposes, with probability α per position, the target's true greedy token (known
            from the target-only run) and otherwise a wrong one. So α is set, not hoped for, and
            the gap between the bound and the measured speedup is the engine's own overhead.

Per run: α (target and measured), γ, c (draft/target forward time at this batch), v (target forward
over γ+1 tokens per row / over 1), the bound (1-α^(γ+1))/((1-α)(γc+1)), the same with v in place
of 1, the measured speedup over γ=0 at the same batch, and efficiency = speedup / bound_v.
--execution, --attention and --kv-block-size (a paged cache, one fixed pool per model: its storage
never moves, so graphs captured once stay valid) apply to every engine and cost runner of the run.
This module imports torch, transformers and the engine only (no ray, fastapi or pydantic).
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from specserve.bench import sync
from specserve.bench.policy import Costs
from specserve.bench.rows import SpeedAndAcceptance
from specserve.engine.model_runner import (
    ATTENTION_MODES, CALIBRATION_CONTEXT, CALIBRATION_SIZES, EXECUTION_MODES, ModelRunner, cache_kwarg,
)
from specserve.engine import RowInput, SamplingParams, SpeculativeEngine
from specserve.engine.admission import allocation
from specserve.engine.planted import PlantedProposer
from specserve.engine.proposers import DraftModelProposer
from specserve.engine.policy import expected_tokens
from specserve.models.peaked import peak

# Llama shapes (public architecture hyper-parameters); weights are random.
SHAPES: dict[str, dict] = {
    "llama2-7b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                      intermediate_size=11008, vocab_size=32000),
    "tinyllama-1.1b": dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                           intermediate_size=5632, vocab_size=32000),
    "llama3-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      intermediate_size=14336, vocab_size=128256),
    "llama3.2-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                        intermediate_size=8192, vocab_size=128256),
    "tiny-target": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=128, vocab_size=512),
    # (head dim 16: FlexAttention's GPU kernel takes no smaller)
    "tiny-draft": dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                       intermediate_size=64, vocab_size=512),
}


# -- models -------------------------------------------------------------------------------------
def random_llama(shape: str, device: str, dtype: torch.dtype, seed: int, peaked: bool) -> torch.nn.Module:
    """A Llama of the named shape with random weights, built directly on `device` in `dtype`.

    peaked: the target's greedy choice made robust to kernel noise (specserve.models.peaked), which
    the planted drafter needs: it plants the target-only run's tokens. Costs are the shape's alone.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=4096, tie_word_embeddings=False,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    if peaked:
        peak(model, seed)
    return model.eval()


def num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# -- measurements ---------------------------------------------------------------------------------
@dataclass
class Run(SpeedAndAcceptance):
    section: str
    batch: int
    gamma: int | None  # None: adaptive
    alpha_target: float | None
    identical: bool = True
    outputs: list[list[int]] = field(default_factory=list, repr=False)

    @property
    def mean_gamma(self) -> float:
        return self.drafted / self.steps if self.steps else 0.0


def generate(engine: SpeculativeEngine, prompts: list[list[int]], ids: list[str], batch: int, max_new: int,
             device: str) -> tuple[list, float]:
    """Run prompts through the engine `batch` at a time under our own request ids -> (sequences, s)."""
    params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
    seqs = []
    sync(device)
    began = time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = []
        for rid, prompt in zip(ids[i : i + batch], prompts[i : i + batch]):
            engine.add_request(rid, prompt, params)
            chunk.append(engine.sequence(rid))
        while any(s.finish_reason is None for s in chunk):
            engine.step()
        seqs += chunk
    sync(device)
    return seqs, time.perf_counter() - began


class StepTimes:
    """Where an in-process engine's steps go, recorded while it runs (`engine.loop.executor.stepped`):
    per step its wall, the draft's and the target's device seconds (their forward logs, whose
    CUDA events are read only in `summary`, after the run), rows and γ; and graphs captured while
    recording (a capture inside a timed run is a stall the warm-up should have taken)."""

    def __init__(self, engine: SpeculativeEngine) -> None:
        self.engine, self.steps = engine, []
        self._runners = [r for r in (engine.verifier.runner, getattr(engine.proposer, "runner", None)) if r is not None]
        self._graphs = self._captured()
        engine.loop.executor.stepped = self._stepped  # (the in-process executor's own is a no-op)

    def _captured(self) -> tuple[int, float]:
        sets = [r.graphs for r in self._runners if r.graphs is not None]
        return sum(len(g) for g in sets), sum(g.capture_seconds for g in sets)

    def _stepped(self, plan, ran, policy, began: float) -> None:
        self.steps.append((time.perf_counter() - began, ran.proposal.forwards, ran.verdict.forwards,
                           len(plan.seqs), plan.gamma, sum(ran.verdict.num_accepted)))

    def summary(self) -> dict:
        """Means per step (ms): wall, draft and verify device time, the rest (host work and gaps);
        drafts accepted per row and step; graphs captured and their seconds while recording."""
        n = max(1, len(self.steps))
        row_steps = sum(s[3] for s in self.steps)
        wall = sum(w for w, *_ in self.steps) / n
        draft = sum(sum(f.seconds for f in d) for _, d, *_ in self.steps) / n
        verify = sum(sum(f.seconds for f in v) for _, _, v, *_ in self.steps) / n
        graphs, seconds = self._captured()
        return dict(steps=len(self.steps), rows_per_step=row_steps / n,
                    accepted_per_row_step=sum(s[5] for s in self.steps) / max(1, row_steps),
                    step_ms=1e3 * wall, draft_ms=1e3 * draft, verify_ms=1e3 * verify,
                    rest_ms=1e3 * (wall - draft - verify), graphs_captured=graphs - self._graphs[0],
                    capture_s=seconds - self._graphs[1])


@dataclass(frozen=True)
class Layout:
    """How every engine and cost runner of a run executes, attends and keeps its KV cache."""

    execution: str = "auto"  # see ModelRunner
    attention: str = "auto"  # see ModelRunner
    kv_block_size: int | None = None  # None: the dense cache; else paged, one fixed pool of kv_pool positions
    kv_pool: int | None = None  # None: what a batch needs (`for_batch`)
    max_model_len: int | None = None  # the engines' stated context (`for_batch`); None: the model's own

    def for_batch(self, batch: int, positions: int, max_gamma: int) -> "Layout":
        """This layout for `batch` requests of at most `positions` tokens each (prompt + new).

        The engines state a context that holds them, their drafts and an adaptive engine's
        calibration forwards, so that in graph mode a dense cache is sized once when graphs are
        first captured (`ModelRunner.preallocate`) and never grows under the warm-up: a growth
        drops every graph, and the timed runs would capture them again. A paged pool left unsized
        holds what admission counts for the requests (so that it never preempts) or what the
        calibration needs (one row of up to `calibration_row` positions), whichever is more, and
        no more: every engine of a batch size is alive at once, and at 7B shapes a pool of 16k
        positions per engine would not fit 13 of them in a GPU's memory."""
        calibration_positions = calibration_row(batch, max_gamma)
        sized = replace(self, max_model_len=max(positions + 2 * max_gamma + 8, calibration_positions))
        if not self.kv_block_size or self.kv_pool is not None:
            return sized
        requests = allocation([positions + 2 * max_gamma + 3] * batch, self.kv_block_size)
        calibration = allocation([calibration_positions], self.kv_block_size)
        return replace(sized, kv_pool=max(requests, calibration))

    def runner(self, model: torch.nn.Module) -> ModelRunner:
        runner = ModelRunner(model, execution=self.execution, attention=self.attention)
        if self.kv_block_size:
            runner.page(self.kv_block_size, self.pool() // self.kv_block_size)
        return runner

    def pool(self) -> int:
        if self.kv_pool is None:
            raise ValueError("a paged layout's pool is unsized: Layout.for_batch sizes it")
        return self.kv_pool


def calibration_sizes(batch: int, max_gamma: int) -> tuple[int, ...]:
    """The forward sizes (tokens) an adaptive engine of this batch and γ is calibrated at."""
    return tuple(sorted({*CALIBRATION_SIZES, batch, batch * (max_gamma + 1)}))


def calibration_row(batch: int, max_gamma: int) -> int:
    """Positions the longest calibration forward's one row holds (`ModelRunner.time_forwards`:
    its context, the forward's tokens, a padding position)."""
    return CALIBRATION_CONTEXT + max(calibration_sizes(batch, max_gamma)) + 1


def build_engine(target: torch.nn.Module, proposer, gamma: int | None, max_gamma: int, batch: int,
                 layout: Layout = Layout(), key_buckets: int | None = 1) -> SpeculativeEngine:
    """One configuration's engine, built once and reused by its warm-up and every timed repeat (so
    its graphs are captured and its cost model calibrated before anything is timed). key_buckets:
    key lengths whose graphs are captured ahead (`capture_graphs`; None: the engine's default).
    One by default: a 7B graph takes ~0.1-0.2 s to capture, a grid holds many engines, and the
    warm-up captures the rest, which no growth drops (the context is stated, `Layout.for_batch`)."""
    engine = SpeculativeEngine(target, num_speculative_tokens=0 if proposer is None else max_gamma,
                               adaptive=gamma is None, proposer=proposer, eos_token_ids=[], max_batch_size=batch,
                               execution=layout.execution, attention=layout.attention,
                               kv_block_size=layout.kv_block_size, max_model_len=layout.max_model_len,
                               max_cached_tokens=layout.pool() if layout.kv_block_size else None)
    engine.capture_graphs(progress=False, key_buckets=key_buckets, kinds=(0.0,))  # the benches' rows are greedy
    if gamma is None:
        engine.calibrate(sizes=calibration_sizes(batch, max_gamma))
    return engine


@dataclass
class Config:
    name: str
    gamma: int | None
    alpha: float | None
    engine: SpeculativeEngine
    proposer: object
    seconds: list[float] = field(default_factory=list)
    outputs: list[list[int]] | None = None
    seqs: list = field(default_factory=list)


def measure_configs(configs: list[Config], prompts, ids, batch: int, max_new: int, device: str, repeats: int,
                    bar: tqdm) -> None:
    """Warm every configuration on these very prompts (every shape it will meet), then time
    `repeats` rounds, each running every configuration once (interleaved, so drifts in clocks or
    co-tenants hit all alike); each keeps the median. The reference run (γ=0) is one of them."""
    for config in configs:
        seqs, _ = generate(config.engine, prompts, ids, batch, max_new, device)
        config.outputs = [list(s.output) for s in seqs]
    for _ in range(repeats):
        for config in configs:
            config.seqs, seconds = generate(config.engine, prompts, ids, batch, max_new, device)
            config.seconds.append(seconds)
            if [list(s.output) for s in config.seqs] != config.outputs:
                config.outputs = None  # not even reproducible run to run: reported as not the same
    bar.update(len(configs))


def to_run(section: str, config: Config, batch: int, reference: list[list[int]]) -> Run:
    run = Run(section, batch, config.gamma, config.alpha, tokens=sum(len(s.output) for s in config.seqs),
              seconds=statistics.median(config.seconds), outputs=config.outputs or [])
    for s in config.seqs:
        run.add_metrics(s.metrics)
    run.identical = config.outputs == reference
    return run


def forward_seconds(runner: ModelRunner, batch: int, context: list[int], width: int, reps: int,
                    logits: str) -> float:
    """Median seconds of one forward of `batch` rows × `width` new tokens after `context`."""
    ids = [f"cost-{b}" for b in range(batch)]
    runner.forward([RowInput(i, 0, context) for i in ids], logits="none")
    times = []
    for _ in range(reps + 1):  # the first is a warm-up for this shape
        runner.forward([RowInput(i, len(context), [1] * width) for i in ids], logits=logits)
        times.append(runner.last_forward_seconds)
    for i in ids:
        runner.free(i)
    return statistics.median(times[1:])


def measure_costs(target, draft, batch: int, context: list[int], gammas: list[int], reps: int,
                  layout: Layout = Layout()) -> dict:
    t_runner, d_runner = layout.runner(target), layout.runner(draft)
    one = forward_seconds(t_runner, batch, context, 1, reps, "all")
    draft_one = forward_seconds(d_runner, batch, context, 1, reps, "last")
    v = {g: forward_seconds(t_runner, batch, context, g + 1, reps, "all") / one for g in gammas if g > 0}
    return {"target_forward_s": one, "draft_forward_s": draft_one, "c": draft_one / one, "v": v}


def bounds(alpha: float, gamma: int, c: float, v: float) -> tuple[float, float]:
    gain = expected_tokens(alpha, gamma)
    return gain / (gamma * c + 1.0), gain / (gamma * c + v)


# -- one section ----------------------------------------------------------------------------------
ProposerFactory = Callable[[float | None, dict[str, list[int]]], object]


def run_section(name: str, target, draft, make_proposer: ProposerFactory, prompt_sets: dict[int, list[list[int]]],
                gammas: list[int], alphas: list[float | None], max_new: int, reps: int, device: str,
                bar: tqdm, batch_layout: Layout, repeats: int, anchors: bool) -> tuple[list[dict], dict, list[dict]]:
    """For each batch size: γ=0 (the reference) and every α × (every γ, adaptive), all warmed and
    then timed interleaved; then, when `anchors`, the HF anchors on the same prompts (they need
    prompts of one length). -> table rows, costs, anchor rows."""
    rows, costs, anchor_rows = [], {}, []
    for batch, prompts in prompt_sets.items():
        ids = [f"{name}-b{batch}-{i}" for i in range(len(prompts))]
        layout = batch_layout.for_batch(batch, max(map(len, prompts)) + max_new, max(gammas, default=0))
        bar.set_postfix_str(f"{name} b={batch} costs")
        cost = measure_costs(target, draft, batch, prompts[0], gammas, reps, layout)
        costs[batch] = cost
        bar.set_postfix_str(f"{name} b={batch} reference")
        base = Config("γ=0", 0, None, build_engine(target, None, 0, 0, batch, layout), None)
        base.outputs = [list(s.output) for s in generate(base.engine, prompts, ids, batch, max_new, device)[0]]
        references = {rid: p + o for rid, p, o in zip(ids, prompts, base.outputs)}
        reference = base.outputs
        configs = [base]
        for alpha in alphas:
            for gamma in [*gammas, None]:
                proposer = make_proposer(alpha, references)
                engine = build_engine(target, proposer, gamma, gamma or max(gammas), batch, layout)
                configs.append(Config(f"α={alpha} γ={gamma}", gamma, alpha, engine, proposer))
        bar.set_postfix_str(f"{name} b={batch} timing {len(configs)} configurations × {repeats}")
        measure_configs(configs, prompts, ids, batch, max_new, device, repeats, bar)
        base_run = to_run(name, base, batch, reference)
        for config in configs:
            row = _row(to_run(name, config, batch, reference), base_run, cost)
            if isinstance(config.proposer, PlantedProposer):
                row["off_reference"] = config.proposer.counts.off_reference
            rows.append(row)
        costs[batch]["policy"] = {str(c.alpha): asdict(Costs.measured(c.engine.policy, f"{name} b={batch} α={c.alpha}"))
                                  for c in configs if c.gamma is None and c.proposer is not None}
        for config in configs:
            del config.engine
        release_memory(device)
        for row in rows[-len(configs):]:  # as they come: a run stopped later keeps these lines
            tqdm.write(f"{name} b={batch} α={row['alpha_target']} γ={row['gamma']}: {row['tokens_per_second']:.1f} tok/s, "
                       f"{row['speedup']:.3f}x, identical={row['identical']}")
        if anchors:
            bar.set_postfix_str(f"{name} b={batch} anchors")
            anchor_rows += measure_anchors(name, target, prompts, batch, max_new, device, repeats, reference,
                                           base_run.tokens_per_second)
    return rows, costs, anchor_rows


def _row(run: Run, base: Run, cost: dict) -> dict:
    row = run.as_dict("outputs")
    row.update(tokens_per_second=run.tokens_per_second, alpha=run.alpha, mean_gamma=run.mean_gamma,
               c=cost["c"], speedup=run.tokens_per_second / base.tokens_per_second)
    g = run.gamma
    if g == 0:
        row.update(v=1.0, bound=1.0, bound_v=1.0)
    elif g is None:  # adaptive: the yardstick is the best fixed γ's bound at the measured α
        candidates = [(bounds(run.alpha, k, cost["c"], cost["v"][k]), k) for k in cost["v"]]
        (b, bv), k = max(candidates, key=lambda x: x[0][1]) if candidates else ((1.0, 1.0), 0)
        if bv < 1.0:
            b, bv, k = 1.0, 1.0, 0  # γ=0 is always available
        row.update(v=cost["v"].get(k, 1.0), bound=b, bound_v=bv, bound_gamma=k)
    else:
        b, bv = bounds(run.alpha, g, cost["c"], cost["v"][g])
        row.update(v=cost["v"][g], bound=b, bound_v=bv)
    row["efficiency"] = row["speedup"] / row["bound_v"]
    return row


# -- anchors: what the same model reaches outside the engine, same prompts and shapes -------------
def hf_generate(model, prompts: list[list[int]], batch: int, max_new: int, device: str) -> tuple[list, float]:
    """HF generate(), eager, greedy, `batch` equal-length prompts at a time -> (outputs, seconds)."""
    outputs = []
    sync(device)
    began = time.perf_counter()
    for i in range(0, len(prompts), batch):
        ids = torch.tensor(prompts[i : i + batch], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             min_new_tokens=max_new, do_sample=False, pad_token_id=0)
        outputs += out[:, ids.shape[1]:].tolist()
    sync(device)
    return outputs, time.perf_counter() - began


class StaticDecode:
    """HF model + StaticCache, greedy; on CUDA the one-token decode step runs under
    torch.compile(mode="reduce-overhead") (CUDA graphs), elsewhere eagerly."""

    def __init__(self, model, batch: int, max_len: int, device: str) -> None:
        from transformers import StaticCache

        self.model, self.device = model, device
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        self.cache_arg = cache_kwarg(model)  # (read once: the step below is compiled whole)
        self.compiled = device.startswith("cuda")
        step = self._step
        self.step = torch.compile(step, mode="reduce-overhead", fullgraph=True) if self.compiled else step

    def _step(self, ids: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """ids [b, 1], position [1] -> next ids [b, 1]."""
        logits = self.model(input_ids=ids, cache_position=position, use_cache=True,
                            **{self.cache_arg: self.cache}).logits
        return logits[:, -1].argmax(-1, keepdim=True)

    @torch.no_grad()
    def __call__(self, prompts: list[list[int]], batch: int, max_new: int) -> tuple[list, float]:
        outputs = []
        sync(self.device)
        began = time.perf_counter()
        for i in range(0, len(prompts), batch):
            self.cache.reset()
            ids = torch.tensor(prompts[i : i + batch], device=self.device)
            length = ids.shape[1]
            logits = self.model(input_ids=ids, cache_position=torch.arange(length, device=self.device),
                                use_cache=True, **{self.cache_arg: self.cache}).logits
            token = logits[:, -1].argmax(-1, keepdim=True)  # [b, 1]
            tokens = [token]
            for k in range(max_new - 1):
                position = torch.tensor([length + k], device=self.device)
                # a replay rewrites the graph's output buffer: keep a copy of each step's token
                token = self.step(token, position).clone()
                tokens.append(token)
            outputs += torch.cat(tokens, dim=1).tolist()
        sync(self.device)
        return outputs, time.perf_counter() - began


def profile_run(fn: Callable[[], object], steps: int, device: str) -> tuple[dict, str]:
    """Run fn once under torch.profiler -> (per decode step: wall ms, device kernel ms, kernels
    launched, and the share of the wall the device was busy; the ops' table by their own device
    time, or on a CPU their own CPU time). `steps`: the decode steps fn runs (tokens per row).
    Where the share is near 1 the kernels are the cost; well below it, the host is."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(device)
    with profile(activities=activities) as prof:
        began = time.perf_counter()
        fn()
        sync(device)
        wall = time.perf_counter() - began
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    busy = sum(e.time_range.elapsed_us() for e in kernels) / 1e6
    summary = dict(wall_ms=1e3 * wall / steps, device_ms=1e3 * busy / steps, kernels=len(kernels) / steps,
                   busy_share=busy / wall if wall else 0.0)
    text = prof.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=30)
    return summary, text


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a large device-to-device copy (read + write counted), median of 5."""
    n = (1 << 28) if device.startswith("cuda") else (1 << 25)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(6):
        sync(device)
        began = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - began)
    return 2 * n / statistics.median(times[1:])


def measure_anchors(section: str, model, prompts: list[list[int]], batch: int, max_new: int, device: str,
                    repeats: int, reference: list[list[int]], engine_tps: float, generate: bool = True,
                    profiler: Callable[[str, Callable], dict] | None = None) -> list[dict]:
    """HF generate() eager (unless not `generate`), the StaticCache decode loop, and the bandwidth
    limit, on these prompts. profiler(name, run): called with each anchor once timed, run(prompts,
    max_new) running it on those (fewer) prompts and tokens; what it returns is the row's
    "profile"."""
    tokens = len(prompts) * max_new
    static = StaticDecode(model, batch, len(prompts[0]) + max_new, device)
    anchors = {"HF generate() eager": lambda ps, n: hf_generate(model, ps, batch, n, device)} if generate else {}
    anchors[f"HF StaticCache {'compiled (reduce-overhead)' if static.compiled else 'eager (no compile on CPU)'}"] = \
        lambda ps, n: static(ps, batch, n)
    rows = []
    for name, fn in anchors.items():
        outputs, _ = fn(prompts, max_new)  # warm-up (and, when compiled, capture)
        seconds = statistics.median(fn(prompts, max_new)[1] for _ in range(repeats))
        rows.append(dict(section=section, batch=batch, anchor=name, tokens_per_second=tokens / seconds,
                         engine_ratio=engine_tps / (tokens / seconds), identical=outputs == reference))
        if profiler is not None:
            rows[-1]["profile"] = profiler(name, fn)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = copy_bandwidth(device)
    limit = batch * bandwidth / weight_bytes  # every decode step reads every weight once
    rows.append(dict(section=section, batch=batch, tokens_per_second=limit, engine_ratio=engine_tps / limit,
                     identical=None, anchor=f"bandwidth limit ({weight_bytes / 1e9:.3g} GB at "
                                            f"{bandwidth / 1e9:.0f} GB/s)"))
    return rows


# -- report ---------------------------------------------------------------------------------------
EFFICIENCY_LIMIT = 1.05  # speedup / bound_v above this cannot be real


def report(rows: list[dict], device: str, shapes: dict[str, str], anchors: list[dict] = ()) -> str:
    lines = [f"device: {device}"] + [f"{k}: {v}" for k, v in shapes.items()]
    head = (f"{'section':<9}{'batch':>6}{'α tgt':>7}{'α meas':>8}{'γ':>7}{'c':>7}{'v':>6}{'bound':>7}"
            f"{'bound_v':>9}{'tok/s':>9}{'speedup':>9}{'eff.':>7}{'same':>6}")
    lines += [head, "-" * len(head)]
    for r in rows:
        gamma = f"{r['gamma']}" if r["gamma"] is not None else f"a{r['mean_gamma']:.1f}"
        target = f"{r['alpha_target']:.2f}" if r["alpha_target"] is not None else "-"
        measured = f"{r['alpha']:.3f}" if r["gamma"] != 0 else "-"
        lines.append(
            f"{r['section']:<9}{r['batch']:>6}{target:>7}{measured:>8}{gamma:>7}{r['c']:>7.3f}{r['v']:>6.2f}"
            f"{r['bound']:>7.2f}{r['bound_v']:>9.2f}{r['tokens_per_second']:>9.1f}{r['speedup']:>9.2f}"
            f"{r['efficiency']:>7.2f}{'!' if r['efficiency'] > EFFICIENCY_LIMIT else ' '}"
            f"{'yes' if r['identical'] else 'NO':>5}"
        )
    lines.append("γ aN.N: adaptive, mean drafts per step; its bound is the best fixed γ's at the measured α. "
                 "eff. = speedup / bound_v.")
    if any(r["efficiency"] > EFFICIENCY_LIMIT for r in rows):
        lines.append(f"! efficiency above {EFFICIENCY_LIMIT}: beyond the physical bound, a measurement error "
                     "(noise, or c / v measured on other shapes than the run met)")
    if anchors:
        head = f"{'section':<9}{'batch':>6}  {'anchor':<52}{'tok/s':>10}{'engine γ=0 / it':>17}{'same':>6}"
        lines += ["", head, "-" * len(head)]
        for a in anchors:
            same = "-" if a["identical"] is None else ("yes" if a["identical"] else "NO")
            lines.append(f"{a['section']:<9}{a['batch']:>6}  {a['anchor']:<52}{a['tokens_per_second']:>10.1f}"
                         f"{a['engine_ratio']:>17.2f}{same:>6}")
    return "\n".join(lines)


# -- main -----------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny shapes and few tokens: a CPU smoke test")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--sections", default="smollm2,random")
    p.add_argument("--gammas", default=None, help="fixed γ values (default 2,4,6; tiny 2,4)")
    p.add_argument("--alphas", default="0.5,0.7,0.9", help="controlled acceptance rates (random section)")
    p.add_argument("--batches", default=None, help="smollm2 batch sizes (default 1,4,16; tiny 1)")
    p.add_argument("--random-batches", default=None, help="random-section batch sizes (default 1,16; tiny 1,4)")
    p.add_argument("--target-shape", default=None, choices=sorted(SHAPES), help="default llama2-7b")
    p.add_argument("--draft-shape", default=None, choices=sorted(SHAPES), help="default tinyllama-1.1b")
    p.add_argument("--prompts", type=int, default=None, help="prompts at batch 1 (default 4; tiny 2)")
    p.add_argument("--prompt-len", type=int, default=None, help="random-section prompt tokens (default 128)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 128; tiny 16")
    p.add_argument("--reps", type=int, default=None, help="repetitions per cost measurement (default 10)")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds per configuration, median kept "
                   "(default 3; tiny 2)")
    p.add_argument("--execution", default="auto", choices=EXECUTION_MODES,
                   help="how the engine runs its fixed-shape forwards (auto: CUDA graphs on a GPU; fused-graph: "
                        "of decoder layers compiled first, engine/fusion.py)")
    p.add_argument("--attention", default="auto", choices=ATTENTION_MODES,
                   help="how every model attends: under a materialised mask, or FlexAttention under the rows' "
                        "positions (auto: mask; docs/engine.md)")
    p.add_argument("--kv-block-size", type=int, default=None,
                   help="a paged KV cache of blocks this size, one fixed pool per model (default: the dense cache)")
    p.add_argument("--kv-pool", type=int, default=None, help="with --kv-block-size: each pool's positions "
                   "(default: what the batch's requests need, admission's count)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-results/gpu.json")
    args = p.parse_args(argv)
    tiny = args.tiny
    defaults = dict(
        device="cuda" if torch.cuda.is_available() and not tiny else "cpu",
        gammas="2,4" if tiny else "2,4,6", batches="1" if tiny else "1,4,16",
        random_batches="1,4" if tiny else "1,16",
        target_shape="tiny-target" if tiny else "llama2-7b", draft_shape="tiny-draft" if tiny else "tinyllama-1.1b",
        prompts=2 if tiny else 4, prompt_len=8 if tiny else 128, max_new_tokens=16 if tiny else 128,
        reps=3 if tiny else 10, repeats=2 if tiny else 3,
    )
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    return args


def layout_of(args: argparse.Namespace) -> Layout:
    return Layout(args.execution, args.attention, args.kv_block_size, args.kv_pool)


def prompt_sets(pool: list[list[int]], batches: list[int], at_batch_one: int) -> dict[int, list[list[int]]]:
    """Batch 1 runs `at_batch_one` prompts one after the other; batch B runs B prompts together."""
    return {b: [pool[i % len(pool)] for i in range(at_batch_one if b == 1 else b)] for b in batches}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    try:
        return _main(args)
    finally:
        torch.set_num_threads(threads)


def _main(args: argparse.Namespace) -> int:
    device, dtype = args.device, getattr(torch, args.dtype)
    gammas = sorted({int(g) for g in args.gammas.split(",") if int(g) > 0})
    alphas = [float(a) for a in args.alphas.split(",")]
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    batches = [int(b) for b in args.batches.split(",")]
    random_batches = [int(b) for b in args.random_batches.split(",")]
    torch.manual_seed(args.seed)
    if args.tiny and device == "cpu":
        torch.set_num_threads(1)  # tiny shapes gain nothing from threads, and shared CPUs lose a lot
    if device.startswith("cuda"):
        device_name = torch.cuda.get_device_name()
    else:
        device_name = f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    total = (len(batches) * (1 + len(gammas) + 1) if "smollm2" in sections else 0)
    total += len(random_batches) * (1 + len(alphas) * (len(gammas) + 1)) if "random" in sections else 0
    bar = tqdm(total=total, desc="gpu bench", unit="run")
    rows, costs, shapes, notes, anchors = [], {}, {}, [], []

    if "smollm2" in sections:
        pair = _load_smollm2(device, dtype)
        if isinstance(pair, str):
            notes.append(f"smollm2 section skipped: {pair}")
            tqdm.write(notes[-1])
            bar.total -= len(batches) * (len(gammas) + 2)
            bar.refresh()
        else:
            section_rows, costs["smollm2"], shapes["smollm2"] = _smollm2_section(args, pair, gammas, batches, bar)
            rows += section_rows
            del pair
            release_memory(device)
    if "random" in sections:
        section_rows, costs["random"], shapes["random"], anchors = _random_section(
            args, gammas, alphas, random_batches, bar)
        rows += section_rows
        if not device.startswith("cuda"):
            notes.append("anchors: on a CPU the StaticCache loop runs eagerly (torch.compile's reduce-overhead "
                         "mode is CUDA graphs); anchors need prompts of one length, so the random section only")
    bar.close()

    table = report(rows, device_name, shapes, anchors)
    print(table)
    for note in notes:
        print(note)
    out = {"device": device_name, "dtype": args.dtype, "torch": torch.__version__, "args": vars(args),
           "shapes": shapes, "costs": costs, "rows": rows, "anchors": anchors, "notes": notes, "table": table}
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2, default=str))
    print(f"wrote {path}")
    return 0


def _smollm2_section(args, pair, gammas: list[int], batches: list[int], bar: tqdm):
    target, draft, pool = pair
    shape = (f"SmolLM2-135M target ({num_params(target) / 1e6:.0f}M), "
             f"trained draft ({num_params(draft) / 1e6:.0f}M), {args.dtype}")
    vocab = target.get_output_embeddings().weight.shape[0]

    def make(alpha, references):
        return DraftModelProposer(draft, vocab, execution=args.execution, attention=args.attention)

    _warm_up(target, args.device)
    rows, costs, _ = run_section("smollm2", target, draft, make, prompt_sets(pool, batches, args.prompts), gammas,
                                 [None], args.max_new_tokens, args.reps, args.device, bar, layout_of(args),
                                 args.repeats, anchors=False)
    return rows, costs, shape


def _random_section(args, gammas: list[int], alphas: list[float], batches: list[int], bar: tqdm):
    dtype = getattr(torch, args.dtype)
    target = random_llama(args.target_shape, args.device, dtype, args.seed, peaked=True)
    draft = random_llama(args.draft_shape, args.device, dtype, args.seed + 1, peaked=False)
    shape = (f"target {args.target_shape} ({num_params(target) / 1e9:.2f}B), "
             f"draft {args.draft_shape} ({num_params(draft) / 1e9:.2f}B), {args.dtype}, random weights")
    vocab = target.get_output_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(args.seed)
    pool = torch.randint(0, vocab, (max(args.prompts, *batches), args.prompt_len), generator=generator).tolist()
    seeds = iter(range(args.seed, args.seed + (1 << 30)))

    def make(alpha, references):
        return PlantedProposer(draft, vocab, alpha, references.values(), seed=next(seeds), execution=args.execution,
                               attention=args.attention)

    _warm_up(target, args.device)
    rows, costs, anchors = run_section("random", target, draft, make, prompt_sets(pool, batches, args.prompts),
                                       gammas, alphas, args.max_new_tokens, args.reps, args.device, bar,
                                       layout_of(args), args.repeats, anchors=True)
    return rows, costs, shape, anchors


def _load_smollm2(device: str, dtype: torch.dtype):
    """(target, draft, prompt token ids) on `device`, or a string saying why not."""
    try:
        from specserve.bench.engine import load_prompts
        from specserve.models.smollm2 import load_smollm2_draft, load_smollm2_target

        target, tokenizer = load_smollm2_target(dtype=dtype)
        target = target.to(device)
        draft = load_smollm2_draft(target).to(device)  # shares the target's embedding
        prompts, _ = load_prompts(tokenizer, None)
    except Exception as exc:  # a missing package, checkpoint or module: report and go on
        return f"{type(exc).__name__}: {exc}"
    return target, draft, prompts


def _warm_up(model: torch.nn.Module, device: str) -> None:
    runner = ModelRunner(model, execution="eager")
    runner.forward([RowInput("warm", 0, [1, 2, 3, 4])], logits="last")
    runner.free("warm")
    sync(device)


def release_memory(device: str) -> None:
    """Give back what dropped engines and models held (collected first: an object in a reference
    cycle would otherwise keep its GPU memory until the collector's next full pass)."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


if __name__ == "__main__":
    raise SystemExit(main())
