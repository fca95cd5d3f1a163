"""The served system against the in-process engine on one machine: `specserve bench serve-gpu`.

    python -m specserve.bench.serve_gpu --out DIR [--mps]     # a GPU machine: 7B / 1.1B random shapes, bf16
    python -m specserve.bench.serve_gpu --tiny --out DIR      # CPU smoke test (a few minutes)
    python -m specserve.bench.serve_gpu --plot DIR/serve-gpu.json   # the PNG, from the JSON, anywhere

Both sides use the same seeded random shapes (`kind: random`, the target peaked so that its greedy
token cannot flip between kernels) and the same prompts (random token ids), greedy, every request
running to --max-tokens:

1. engine, in a subprocess (this process never holds a CUDA context, so MPS can start later):
   the in-process SpeculativeEngine with CUDA graphs, each concurrency as its batch: γ=0, whose
   outputs are the references, then fixed γ with the planted drafter at each α.
2. served: the real Serve app (ingress, coordinator, target and draft worker actors sharing the
   GPU by fractional num_gpus, CUDA graphs inside the workers, --transport between them) with
   `speculation.planted`, per mode (sequential, pipelined) and α, driven over HTTP with streamed
   completions of token-id prompts at each concurrency; the γ=0 rows are the per-request
   `num_speculative_tokens: 0` on the first app (target-only on the same replica and workers).
3. with --mps: the MPS control daemon started under a timeout, Ray restarted so that its workers
   are MPS clients, pipelined served again, the daemon stopped.

Per row: mode, α planted, acceptance (accepted / drafted), concurrency, tok/s served / in-process /
ratio, TTFT and ITL p50/p99 (ITL per request: (last chunk - first) / (tokens - 1)), coordination (step wall - time in
worker calls) and overhead (step wall - forward time) p50/p99 from /v1/stats, the workers' peak
CUDA memory, and `same`: every served token equals the in-process engine's. Each level is warmed
up first (graphs captured at every shape it meets): one pass, or on the compiled graph up to three
until a pass ran on it (`level`; the row's `warmups`), then timed; a pass starts once the replica's
graph is built, and one in which the graph changed shape is never the timed one. Prints rows as they come;
writes DIR/serve-gpu.json, and DIR/serve-gpu.png where matplotlib is installed.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from specserve.bench.soak_failover import free_port
from specserve.bench.sse import events, ms, nearest_rank

MODEL = "bench"
GPU_SHAPES = ("llama-7b", "llama-1b")
TINY_TARGET = dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
TINY_DRAFT = {**TINY_TARGET, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="specserve bench serve-gpu", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("bench-results/serve-gpu"), help="folder for JSON and PNG")
    p.add_argument("--tiny", action="store_true", help="tiny shapes, float32, on the CPU")
    p.add_argument("--alphas", default="0.8,0.6")
    p.add_argument("--concurrency", default=None, help="default 1,8,32 (tiny 1,4)")
    p.add_argument("--modes", default="sequential,pipelined")
    p.add_argument("--gamma", type=int, default=3, help="fixed γ of every speculative row")
    p.add_argument("--max-tokens", type=int, default=None, help="default 128 (tiny 16)")
    p.add_argument("--prompt-len", type=int, default=None, help="default 128 (tiny 12)")
    p.add_argument("--min-requests", type=int, default=2, help="requests per level: max(this, concurrency)")
    p.add_argument("--transport", default="compiled_graph", choices=("compiled_graph", "actor_calls"))
    p.add_argument("--execution", default="auto", choices=("auto", "eager", "graph", "fused-graph"),
                   help="how the workers and the in-process engine run their forwards (speculation.execution)")
    p.add_argument("--mps", action="store_true", help="then start MPS and serve pipelined again")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--phase", default="all", choices=("all", "engine"), help=argparse.SUPPRESS)
    p.add_argument("--plot", type=Path, default=None, help="only draw the PNG from this JSON")
    args = p.parse_args(argv)
    args.levels = [int(c) for c in (args.concurrency or ("1,4" if args.tiny else "1,8,32")).split(",")]
    args.alpha_list = [float(a) for a in args.alphas.split(",")]
    args.mode_list = [m for m in args.modes.split(",") if m]
    args.max_tokens = args.max_tokens or (16 if args.tiny else 128)
    args.prompt_len = args.prompt_len or (12 if args.tiny else 128)
    return args


# -- what both sides run ----------------------------------------------------------------------------
def sources(args) -> tuple[dict, dict]:
    """The target's and the draft's `kind: random` model sources."""
    dtype = "float32" if args.tiny else "bfloat16"
    target, draft = (TINY_TARGET, TINY_DRAFT) if args.tiny else GPU_SHAPES
    return (dict(kind="random", shape=target, dtype=dtype, seed=args.seed, peaked=True),
            dict(kind="random", shape=draft, dtype=dtype, seed=args.seed + 1))


def prompts(args, vocab_size: int) -> list[list[int]]:
    import random

    rng = random.Random(args.seed)
    count = max(args.min_requests, *args.levels)
    return [[rng.randrange(vocab_size) for _ in range(args.prompt_len)] for _ in range(count)]


def requests_at(args, concurrency: int) -> int:
    return max(args.min_requests, concurrency)


# -- phase 1: the in-process engine ---------------------------------------------------------------
def engine_phase(args) -> dict:
    """-> {"rows": [...], "references": prompt + γ=0 output per prompt, "peak_cuda_bytes"}."""
    import torch

    from specserve.bench import gpu
    from specserve.config import RandomSource
    from specserve.engine.planted import PlantedProposer
    from specserve.models.loading import load_draft, load_target

    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    gpus = [0] if device == "cuda" else []
    target_source, draft_source = sources(args)
    target = load_target(RandomSource.model_validate(target_source), gpus)
    draft = load_draft(RandomSource.model_validate(draft_source), gpus)
    vocab = target.get_output_embeddings().weight.shape[0]
    pool = prompts(args, vocab)
    runs = iter(range(1 << 30))

    def timed(proposer, gamma: int, batch: int) -> tuple[list[list[int]], float, dict]:
        """-> (outputs, tok/s, where the timed run's steps went: gpu.StepTimes.summary)."""
        layout = gpu.Layout(args.execution).for_batch(batch, args.prompt_len + args.max_tokens, args.gamma)
        # every key length ahead, as the served workers capture: its one timed run should meet no capture
        engine = gpu.build_engine(target, proposer, gamma, gamma, batch, layout, key_buckets=None)
        chosen = pool[: requests_at(args, batch)]
        for run in range(2):  # the first run is the warm-up (graphs, caches)
            ids = [f"run{next(runs)}-{i}" for i in range(len(chosen))]
            times = gpu.StepTimes(engine) if run else None
            seqs, seconds = gpu.generate(engine, chosen, ids, batch, args.max_tokens, device)
        steps = times.summary()
        del engine, times
        gpu.release_memory(device)  # ten engines one after another: only one cache at a time
        return [list(s.output) for s in seqs], len(chosen) * args.max_tokens / seconds, steps

    outputs, _, _ = timed(None, 0, max(args.levels))
    references = [p + o for p, o in zip(pool, outputs)]
    rows = []
    for batch in args.levels:
        got, speed, steps = timed(None, 0, batch)
        rows.append(dict(mode="γ=0", alpha=None, concurrency=batch, tokens_per_s=speed,
                         same=got == outputs[: len(got)], steps=steps))
        for alpha in args.alpha_list:
            proposer = PlantedProposer(draft, vocab, alpha, references, seed=args.seed, execution=args.execution)
            got, speed, steps = timed(proposer, args.gamma, batch)
            counts = proposer.counts
            rows.append(dict(mode="sequential", alpha=alpha, concurrency=batch, tokens_per_s=speed,
                             same=got == outputs[: len(got)], planted=counts.planted / max(1, counts.proposed),
                             steps=steps))
        for r in rows:
            if r["concurrency"] == batch:
                print(engine_line(r), flush=True)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    return {"device": device, "rows": rows, "references": references, "peak_cuda_bytes": peak}


def engine_line(row: dict) -> str:
    """One in-process row and where its steps went (ms per step)."""
    s = row["steps"]
    return (f"engine b={row['concurrency']} {row['mode']} α={row['alpha']}: {row['tokens_per_s']:.1f} tok/s, "
            f"same={row['same']}; per step: {s['step_ms']:.2f} wall = {s['draft_ms']:.2f} draft + "
            f"{s['verify_ms']:.2f} verify + {s['rest_ms']:.2f} rest; {s['rows_per_step']:.1f} rows, "
            f"{s['accepted_per_row_step']:.2f} accepted per row, "
            f"{s['steps']} steps, {s['graphs_captured']} graphs captured ({s['capture_s']:.1f} s) while timed")


def run_engine_subprocess(args, argv: list[str]) -> dict:
    """Phase 1 in a child process; -> its report (written to DIR/engine.json)."""
    done = subprocess.run([sys.executable, "-m", "specserve.bench.serve_gpu", *argv, "--phase", "engine"],
                          timeout=1800)
    if done.returncode:
        raise SystemExit(f"the engine phase failed (exit {done.returncode})")
    return json.loads((args.out / "engine.json").read_text())


# -- phase 2: the served system ---------------------------------------------------------------------
def app_args(args, mode: str, alpha: float, references: Path, gpu: bool) -> dict:
    target, draft = sources(args)
    share = {"num_cpus": 1.0, "num_gpus": 0.5 if gpu else 0.0}
    longest = args.prompt_len + args.max_tokens + args.gamma + 8
    return dict(
        served_model_name=MODEL, target=target, draft=draft, max_batch_size=max(args.levels),
        max_model_len=longest, max_queued_requests=max(args.levels), request_timeout_s=600.0,
        speculation=dict(num_speculative_tokens=args.gamma, adaptive=False, pipelined=mode == "pipelined",
                         transport=args.transport, execution=args.execution,
                         planted=dict(alpha=alpha, references=str(references.resolve()), seed=args.seed)),
        target_worker=share, draft_worker=share,
        deadlines=dict(target_floor_s=120.0, draft_floor_s=60.0))


async def one_stream(client: httpx.AsyncClient, prompt: list[int], max_tokens: int, gamma: int | None) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    if gamma is not None:
        body["num_speculative_tokens"] = gamma
    began, times, tokens, spec = time.perf_counter(), [], [], {}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:500]!r}")
        async for event in events(r):
            if event is None or "error" in (event or {}):
                if event:
                    raise RuntimeError(f"stream failed: {event['error']}")
                continue
            for choice in event.get("choices", []):
                if choice.get("token_ids"):
                    times.append(time.perf_counter())
                    tokens += choice["token_ids"]
            spec = event.get("speculation") or spec
    itl = (times[-1] - times[0]) / (len(tokens) - 1) if len(tokens) > 1 and len(times) > 1 else None
    return {"tokens": tokens, "ttft": times[0] - began if times else None, "itl": itl, "speculation": spec}


MAX_WARMUPS = 3  # warm-up passes of a level at most before its timed one
SETTLED_GRAPH_SHARE = 0.9  # ... ended once a pass ran this share of its steps on the compiled graph
GRAPH_WAIT_S = 20.0  # the longest a pass waits for the replica to rebuild its graph (a reshape: 1-2 s)


async def level(client, args, pool, concurrency: int, gamma: int | None) -> tuple[list[dict], float, dict]:
    """Requests at this concurrency: warm-up passes, then the timed one -> (results, wall s,
    /v1/stats of the timed pass, with "bench_warmups"). One warm-up, or on the compiled graph up
    to MAX_WARMUPS until a pass ran on it: a replica whose steps stop drafting (the γ=0 rows after
    speculative ones) reshapes its graph for the target alone once 64 steps drafted nothing, and
    steps over plain calls while it rebuilds, which a timed pass should not catch. So each pass
    starts once the graph is built (`graph_reshapes`), and a pass in which the graph changed shape
    is a warm-up, never the timed one, whenever in the level the 64th step falls."""
    chosen = pool[: requests_at(args, concurrency)]
    gate = asyncio.Semaphore(concurrency)

    async def run(prompt):
        async with gate:
            return await one_stream(client, prompt, args.max_tokens, gamma)

    warmups, settled = 0, False
    while True:
        reshapes = await graph_reshapes(client, args)
        (await client.post("/v1/stats/reset")).raise_for_status()
        began = time.perf_counter()
        results = await asyncio.gather(*(run(p) for p in chosen))
        wall = time.perf_counter() - began
        stats = (await client.get("/v1/stats")).json()
        steady = stats.get("graph_reshapes", 0) == reshapes
        if (settled and steady) or warmups >= MAX_WARMUPS:
            return results, wall, {**stats, "bench_warmups": warmups}
        warmups += 1
        settled = steady and (args.transport != "compiled_graph" or graph_share(stats) >= SETTLED_GRAPH_SHARE)


async def graph_reshapes(client, args) -> int:
    """The replica's graph reshapes so far, once its graph is built: a graph torn down by a reshape
    or a break is waited for (at most GRAPH_WAIT_S) while it had been built before."""
    if args.transport != "compiled_graph":
        return 0  # (no graph: nothing to ask for)
    deadline = time.monotonic() + GRAPH_WAIT_S
    while True:
        stats = (await client.get("/v1/stats")).json()
        if stats.get("graph_ready", True) or not stats.get("graph_builds") or time.monotonic() > deadline:
            return stats.get("graph_reshapes", 0)
        await asyncio.sleep(0.1)


def graph_share(stats: dict) -> float:
    """The share of the steps in these /v1/stats that ran on the compiled graph (0 without steps)."""
    return stats.get("graph_steps", 0) / stats["steps"] if stats.get("steps") else 0.0


def served_row(mode: str, alpha, concurrency: int, results: list[dict], wall: float, stats: dict,
               references: list[list[int]], prompt_len: int) -> dict:
    tokens = sum(len(r["tokens"]) for r in results)
    drafted = sum(r["speculation"].get("num_draft_tokens", 0) for r in results)
    accepted = sum(r["speculation"].get("num_accepted_tokens", 0) for r in results)
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    itls = [r["itl"] for r in results if r["itl"] is not None]
    memory = stats.get("memory", {})
    peak = sum(memory.get(w, {}).get("cuda_peak_allocated_bytes", 0) for w in ("target", "draft")) or None
    return dict(
        mode=mode, alpha=alpha, concurrency=concurrency, requests=len(results), tokens_per_s=tokens / wall,
        acceptance=accepted / drafted if drafted else None,  # accepted / drafted, not α itself
        ttft_p50_ms=ms(nearest_rank(ttfts, 0.5)), ttft_p99_ms=ms(nearest_rank(ttfts, 0.99)),
        itl_p50_ms=ms(nearest_rank(itls, 0.5), 2), itl_p99_ms=ms(nearest_rank(itls, 0.99), 2),
        **{f"{name}_{q}_ms": stats.get(f"{key}_{q}_ms") for name, key in
           (("coordination", "rpc_overhead"), ("overhead", "overhead")) for q in ("p50", "p99")},
        step_p50_ms=stats.get("step_wall_p50_ms"), forward_p50_ms=stats.get("forward_p50_ms"),
        transport=stats.get("transport"), cuda_peak_bytes=peak,
        # the timed steps that ran on the compiled graph (the rest: plain actor calls)
        graph_share=graph_share(stats) if stats.get("steps") else None, warmups=stats.get("bench_warmups"),
        graph_breaks=stats.get("graph_breaks"), worker_restarts=stats.get("worker_restarts"),
        graph_solo=stats.get("graph_solo"),  # the graph was the target's alone (steps that stopped drafting)
        graph_spins=stats.get("graph_spins"),  # the graph's readers spin (many cores) rather than nap
        q_placed=stats.get("q_placed"),  # the workers' placement handshake passed (the same GPU: CUDA IPC)
        same=all(r["tokens"] == ref[prompt_len:] for r, ref in zip(results, references)))


@contextlib.contextmanager
def local_serve(gpu: bool, out: Path):
    """Ray on this machine (its CPUs, and the GPU when there is one) with Serve's proxy on loopback;
    at the end, the warnings and errors its processes logged are appended to out/ray-warnings.txt."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a throwaway cluster on loopback only
    import ray
    from ray import serve

    port = free_port()
    ray.init(num_cpus=max(4, os.cpu_count() or 1), num_gpus=1 if gpu else 0, include_dashboard=False,
             _node_ip_address="127.0.0.1", log_to_driver=False, namespace="specserve-serve-gpu")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        harvest_warnings(out / "ray-warnings.txt")
        serve.shutdown()
        ray.shutdown()


def harvest_warnings(path: Path, limit: int = 400) -> None:
    """Lines of this Ray session's worker logs that warn or fail, each distinct one once (the
    workers log to files, not to this driver): what a run on a machine one cannot log into says."""
    try:
        from ray._private.worker import _global_node

        logs = Path(_global_node.get_logs_dir_path())
    except Exception as err:  # (a private API: a Ray without it just leaves no harvest)
        with path.open("a") as f:
            f.write(f"no logs: {type(err).__name__}: {err}\n")
        return
    seen, kept = set(), []
    for log in sorted(logs.glob("worker-*.err")) + sorted(logs.glob("worker-*.out")):
        for line in log.read_text(errors="replace").splitlines():
            if any(w in line for w in ("WARNING", "ERROR", "Error", "failed", "broken")) and " INFO " not in line:
                text = line.strip()[:400]
                if text not in seen and len(kept) < limit:
                    seen.add(text)
                    kept.append(f"{log.name[:40]}: {text}")
    with path.open("a") as f:
        f.write("\n".join(kept) + "\n")


class Progress:
    """The served rows so far: each printed as it comes and the report rewritten with it (a run cut
    short by its time limit still leaves DIR/serve-gpu.json, marked partial)."""

    def __init__(self, args, engine: dict, began: float) -> None:
        self.args, self.engine, self.began = args, engine, began
        self.rows: list[dict] = []
        self.notes: dict = {}

    def add(self, row: dict) -> None:
        self.rows.append(row)
        print(row_line(row), flush=True)
        self.save(partial=True)

    def save(self, partial: bool) -> dict:
        report = report_of(self.args, self.engine, self.rows, self.notes, time.monotonic() - self.began)
        report["partial"] = partial
        (self.args.out / "serve-gpu.json").write_text(json.dumps(report, indent=1))
        return report


def serve_mode(url: str, args, mode: str, alpha: float, engine: dict, references: Path, gpu: bool,
               tag: str, progress: Progress) -> None:
    """Deploy the app for (mode, α), drive every level (and the γ=0 rows when asked), add rows. A
    deploy or a level that fails is a row with its error; the app's later levels are skipped."""
    from ray import serve

    from specserve.serve.app import build_app

    began = time.monotonic()
    try:
        serve.run(build_app(app_args(args, mode, alpha, references, gpu)), name="bench", route_prefix="/")
    except Exception as err:
        progress.add(dict(mode=mode + tag, alpha=alpha, concurrency=None, same=False,
                          error=f"deploy: {type(err).__name__}: {str(err)[:400]}"))
        return
    print(f"deployed {mode} α={alpha} in {time.monotonic() - began:.0f} s", flush=True)
    refs = engine["references"]
    pool = [r[: args.prompt_len] for r in refs]
    gammas = [(mode, None)] + ([("γ=0", 0)] if tag == "" and mode == args.mode_list[0] and alpha == args.alpha_list[0]
                               else [])

    async def drive():
        limits = httpx.Limits(max_connections=max(args.levels) + 4)
        async with httpx.AsyncClient(base_url=url, timeout=600.0, limits=limits) as client:
            for name, gamma in gammas:
                for c in args.levels:
                    planted = None if gamma == 0 else alpha
                    try:
                        results, wall, stats = await level(client, args, pool, c, gamma)
                    except Exception as err:
                        progress.add(dict(mode=name + tag, alpha=planted, concurrency=c, same=False,
                                          error=f"{type(err).__name__}: {str(err)[:400]}"))
                        return
                    row = served_row(name + tag, planted, c, results, wall, stats, refs, args.prompt_len)
                    progress.add(with_engine(row, engine["rows"], name, planted))

    asyncio.run(drive())
    with contextlib.suppress(Exception):
        serve.delete("bench")


def with_engine(row: dict, engine_rows: list[dict], mode: str, alpha) -> dict:
    """The row with the in-process engine's tok/s at the same γ, α and batch, and the ratio."""
    want = "γ=0" if mode == "γ=0" else "sequential"
    match = [r for r in engine_rows if r["mode"] == want and r["alpha"] == alpha and r["concurrency"] == row["concurrency"]]
    engine = match[0]["tokens_per_s"] if match else None
    return {**row, "engine_tokens_per_s": engine, "ratio": row["tokens_per_s"] / engine if engine else None}


# -- phase 3: MPS -----------------------------------------------------------------------------------
def mps(command: str, timeout: float = 20.0) -> str | None:
    """Start ("-d") or stop ("quit") the MPS control daemon -> None, or why it could not."""
    try:
        if command == "-d":
            done = subprocess.run(["nvidia-cuda-mps-control", "-d"], capture_output=True, text=True, timeout=timeout)
        else:
            done = subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", capture_output=True, text=True,
                                  timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"{type(err).__name__}: {err}"
    return None if done.returncode == 0 else f"exit {done.returncode}: {(done.stderr or done.stdout).strip()[:300]}"


# -- report -------------------------------------------------------------------------------------------
# (row key, heading, width, format)
COLUMNS = (("mode", "mode", 14, "s"), ("alpha", "α", 4, ".1f"), ("acceptance", "acc", 5, ".2f"),
           ("concurrency", "conc", 4, "d"), ("tokens_per_s", "tok/s", 8, ".1f"),
           ("engine_tokens_per_s", "engine", 8, ".1f"), ("ratio", "ratio", 5, ".2f"),
           ("ttft_p50_ms", "ttft50", 7, ".1f"), ("ttft_p99_ms", "ttft99", 7, ".1f"),
           ("itl_p50_ms", "itl50", 6, ".2f"), ("itl_p99_ms", "itl99", 6, ".2f"),
           ("coordination_p50_ms", "crd50", 6, ".2f"), ("coordination_p99_ms", "crd99", 6, ".2f"),
           ("overhead_p50_ms", "ovh50", 6, ".2f"), ("overhead_p99_ms", "ovh99", 6, ".2f"),
           ("step_p50_ms", "step50", 6, ".2f"), ("graph_share", "graph", 5, ".2f"), ("warmups", "wu", 2, "d"),
           ("cuda_peak_gib", "GiB", 5, ".1f"), ("same", "same", 5, "s"))


def format_row(row: dict) -> str:
    row = {**row, "cuda_peak_gib": None if row.get("cuda_peak_bytes") is None else row["cuda_peak_bytes"] / 2**30}
    cells = []
    for key, _, width, spec in COLUMNS:
        value = row.get(key)
        text = "-" if value is None else format(str(value) if spec == "s" else value, spec)
        cells.append(text.ljust(width) if key == "mode" else text.rjust(width))
    return " ".join(cells)


def row_line(row: dict) -> str:
    """A measured row's cells, or what failed."""
    if "error" in row:
        return f"{row['mode']} α={row['alpha']} c={row['concurrency']}: FAILED {row['error']}"
    return format_row(row)


def table(rows: list[dict]) -> str:
    head = " ".join(h.ljust(w) if k == "mode" else h.rjust(w) for k, h, w, _ in COLUMNS)
    return "\n".join([head, *map(row_line, rows)]) + (
        "\n(ms; crd: coordination = step wall - time in worker calls; graph: share of the timed steps on the "
        "compiled graph; wu: warm-up passes before the timed one)")


def plot(report: dict, path: Path) -> str | None:
    """tok/s and ITL p50 against concurrency, one line per (mode, α) -> None, or why not drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed here: draw it elsewhere with --plot " + str(path.with_suffix(".json"))
    fig, (speed, itl) = plt.subplots(1, 2, figsize=(11, 4))
    lines: dict[str, list[dict]] = {}
    for row in (r for r in report["served"] if "error" not in r):
        lines.setdefault(f"{row['mode']} α={row['alpha']}" if row["alpha"] is not None else row["mode"], []).append(row)
    for label, rows in lines.items():
        rows.sort(key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in rows]
        speed.plot(xs, [r["tokens_per_s"] for r in rows], marker="o", label=label)
        itl.plot(xs, [r["itl_p50_ms"] for r in rows], marker="o", label=label)
    for axis, name in ((speed, "output tok/s"), (itl, "ITL p50 (ms)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrent streams")
        axis.set_ylabel(name)
        axis.grid(alpha=0.3)
    speed.legend(fontsize=7)
    fig.suptitle(f"served over HTTP: {report['shapes']}, γ {report['gamma']}, {report['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return None


# -- main ---------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.plot is not None:
        why = plot(json.loads(args.plot.read_text()), args.plot.with_suffix(".png"))
        print(why or f"wrote {args.plot.with_suffix('.png')}")
        return 0 if why is None else 1
    args.out.mkdir(parents=True, exist_ok=True)
    if args.phase == "engine":
        (args.out / "engine.json").write_text(json.dumps(engine_phase(args)))
        return 0
    return run(args, argv)


def run(args, argv: list[str]) -> int:
    from specserve.engine.planted import write_references

    began = time.monotonic()
    engine = run_engine_subprocess(args, argv)
    references = args.out / "references.jsonl"
    write_references(references, engine["references"])
    gpu = engine["device"] == "cuda"
    progress = Progress(args, engine, began)
    notes = progress.notes
    with local_serve(gpu, args.out) as url:
        for mode in args.mode_list:
            for alpha in args.alpha_list:
                serve_mode(url, args, mode, alpha, engine, references, gpu, "", progress)
    if args.mps and gpu:
        notes["mps_start"] = mps("-d")
        if notes["mps_start"] is None:
            try:
                with local_serve(gpu, args.out) as url:
                    for alpha in args.alpha_list:
                        serve_mode(url, args, "pipelined", alpha, engine, references, gpu, "+mps", progress)
            finally:
                notes["mps_stop"] = mps("quit")
        print(f"MPS: {notes}", flush=True)
    return write_report(args, progress.save(partial=False))


def report_of(args, engine: dict, rows: list[dict], notes: dict, seconds: float) -> dict:
    target, draft = sources(args)
    shapes = "tiny" if args.tiny else f"{target['shape']} / {draft['shape']} {target['dtype']}"
    return {"device": engine["device"], "shapes": shapes, "gamma": args.gamma, "max_tokens": args.max_tokens,
            "prompt_len": args.prompt_len, "transport": args.transport, "levels": args.levels,
            "engine": engine["rows"], "engine_peak_cuda_bytes": engine["peak_cuda_bytes"], "served": rows,
            "notes": notes, "wall_s": round(seconds, 1), "all_same": all(r["same"] for r in rows + engine["rows"])}


def write_report(args, report: dict) -> int:
    """Print the table, draw the PNG (DIR/serve-gpu.json is already written) -> exit status."""
    print()
    print(table(report["served"]))
    path = args.out / "serve-gpu.json"
    why = plot(report, path.with_suffix(".png"))
    print(f"wrote {path}" + ("" if why else f" and {path.with_suffix('.png')}") + (f" ({why})" if why else ""))
    print(f"every served and in-process token the same: {report['all_same']}; {report['wall_s']} s")
    return 0 if report["all_same"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
