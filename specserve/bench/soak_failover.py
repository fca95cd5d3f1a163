"""Replica-loss soak: N concurrent greedy streams, one coordinator replica killed mid-run.

    specserve bench soak [--streams 500] [--max-tokens 48] [--replicas 2] [--kill-at 0.3]

Starts a local Ray bound to 127.0.0.1 (2 CPUs unless --num-cpus), deploys configs/tiny.yaml with
--replicas coordinator replicas (and a waiting queue deep enough that the burst waits rather than
gets 429s), sends --streams streaming completions at once (a few dozen distinct prompts, greedy,
ignore_eos), and `ray.kill`s one coordinator replica's actor once --kill-at of every expected token
has arrived. Each stream is checked against its reference, the target's own greedy output computed
in this process: a stream whose token ids (`return_token_ids`, per chunk) differ lost or duplicated
tokens (its text is compared too, and a difference counted apart). A 429 (back-pressure) is
retried after its Retry-After and counted apart. Bounded: no stream outlives --timeout-s.

Prints progress every few seconds, then a table: requests ok / failed / wrong, continuations,
TTFT and inter-chunk latency (ITL) p50/p99, the longest gap of any stream, and memory (RSS of the
Ray processes, and per replica process through /v1/stats) before the load and after it; writes
everything to --out as JSON. Exit status 1 if any request failed or any stream was wrong.
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from specserve.bench.sse import events, ms, percentile

ROOT = Path(__file__).resolve().parents[2]
PROMPT_STEMS = ["Hello", "The quick brown fox", "Speculative decoding is lossless.", "0123456789",
                "Once upon a time", "List three colours:", "a", "héllo wörld"]


@dataclass
class Stream:
    prompt: str
    sent: float = 0.0
    arrivals: list[float] = field(default_factory=list)  # one per text chunk
    text: str = ""
    token_ids: list[int] = field(default_factory=list)  # as streamed (each chunk's new ids)
    usage: dict | None = None
    outcome: str = "pending"  # ok | wrong | error kinds
    retries_429: int = 0
    text_differs: bool = False  # right ids, but the streamed text is not their one-shot decode


def prompts(n_distinct: int) -> list[str]:
    return [f"{PROMPT_STEMS[i % len(PROMPT_STEMS)]} #{i}" for i in range(n_distinct)]


def references(config_args: dict, texts: list[str], max_tokens: int) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Each prompt's greedy continuation by the target alone (HF generate, no speculation): token
    ids, and their text decoded at once."""
    import torch

    from specserve.config import load_app_config
    from specserve.models.loading import load_target, load_tokenizer

    config = load_app_config(config_args)
    target, tok = load_target(config.target), load_tokenizer(config.target, config.tokenizer)
    out = {}
    with torch.inference_mode():
        for text in texts:
            ids = torch.tensor([tok(text).input_ids])
            gen = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                  min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
            out[text] = gen[0, ids.shape[1]:].tolist()
    return out, {p: tok.decode(ids, skip_special_tokens=True) for p, ids in out.items()}


async def one_stream(client: httpx.AsyncClient, model: str, s: Stream, max_tokens: int, deadline: float) -> None:
    body = {"model": model, "prompt": s.prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    try:
        async with asyncio.timeout(max(deadline - time.monotonic(), 0.1)):
            while True:
                s.sent = time.monotonic()
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code == 429:
                        await r.aread()
                        s.retries_429 += 1
                        await asyncio.sleep(float(r.headers.get("retry-after", 1)))
                        continue
                    if r.status_code != 200:
                        await r.aread()
                        s.outcome = f"http_{r.status_code}"
                        return
                    s.outcome = await _read_events(r, s)
                    return
    except TimeoutError:
        s.outcome = "timeout"
    except httpx.HTTPError as err:
        s.outcome = f"transport_{type(err).__name__}"


async def _read_events(r: httpx.Response, s: Stream) -> str:
    done = False
    async for event in events(r):
        if event is None:
            done = True
            break
        if "error" in event:
            return f"sse_error_{event['error'].get('code')}"
        if event.get("usage"):
            s.usage = event["usage"]
        elif event.get("choices"):
            s.arrivals.append(time.monotonic())
            s.text += event["choices"][0]["text"]
            s.token_ids += event["choices"][0]["token_ids"]
    return "complete" if done and s.usage is not None else "incomplete_stream"


def ray_rss_mb() -> float:
    """Resident memory of this run's Ray processes (raylet, GCS, proxy, replicas, workers: the
    processes whose command line names this Ray session, and their descendants; other clusters on
    the machine are not counted)."""
    import psutil
    import ray

    session = ray._private.worker._global_node.session_name
    procs: dict[int, int] = {}  # pid -> rss: the session's daemons and every process they started
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if session in " ".join(proc.info["cmdline"] or []):
                for p in [proc, *proc.children(recursive=True)]:
                    procs[p.pid] = p.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return round(sum(procs.values()) / 2**20, 1)


async def replica_memory(client: httpx.AsyncClient, reads: int = 8) -> dict[str, dict[str, float]]:
    """Per coordinator replica (a few /v1/stats reads: each lands on one), each process's RSS (MB)."""
    out: dict[str, dict[str, float]] = {}
    for _ in range(reads):
        try:
            stats = (await client.get("/v1/stats", timeout=30)).json()
        except (httpx.HTTPError, ValueError):
            continue
        out[stats.get("replica", "?")[-8:]] = {proc: round(m["rss_bytes"] / 2**20, 1)
                                              for proc, m in stats.get("memory", {}).items()}
    return out


async def progress(streams: list[Stream], max_tokens: int, began: float, stop: asyncio.Event, every: float) -> None:
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), timeout=every)
        except TimeoutError:
            pass
        finished = sum(s.outcome != "pending" for s in streams)
        chunks = sum(len(s.arrivals) for s in streams)
        print(f"  [{time.monotonic() - began:6.1f} s] finished {finished}/{len(streams)}  chunks {chunks}  "
              f"not ok so far {sum(s.outcome not in ('pending', 'complete') for s in streams)}", flush=True)


async def killer(streams: list[Stream], max_tokens: int, kill_at: float, app: str, log: dict) -> None:
    """Kill one coordinator replica's actor once kill_at of the expected tokens (~chunks) arrived."""
    import ray

    expected = len(streams) * max_tokens
    while True:
        got = sum(len(s.token_ids) for s in streams)
        if got >= kill_at * expected:
            break
        if all(s.outcome != "pending" for s in streams):
            log["killed"] = None
            return
        await asyncio.sleep(0.05)
    victims = [a for a in ray.util.list_named_actors(all_namespaces=True)
               if a["namespace"] == "serve" and f"{app}#Coordinator#" in a["name"]]
    handle = ray.get_actor(victims[0]["name"], namespace="serve")
    ray.kill(handle, no_restart=True)
    log.update(killed=victims[0]["name"], at_fraction=round(got / expected, 3),
               in_flight=sum(s.outcome == "pending" for s in streams))
    print(f"  killed coordinator replica {victims[0]['name']} at {100 * got / expected:.0f}% of the tokens "
          f"({log['in_flight']} streams in flight)", flush=True)


async def drive(url: str, model: str, app: str, args, refs: dict[str, list[int]], ref_texts: dict[str, str]) -> dict:
    texts = list(refs)
    streams = [Stream(texts[i % len(texts)]) for i in range(args.streams)]
    limits = httpx.Limits(max_connections=args.streams + 16, max_keepalive_connections=args.streams + 16)
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout_s, limits=limits) as client:
        memory_before = {"ray_processes_rss_mb": ray_rss_mb(), "replicas": await replica_memory(client)}
        ingress_before = (await client.get("/v1/stats")).json().get("ingress", {})
        began = time.monotonic()
        deadline = began + args.timeout_s
        stop, kill_log = asyncio.Event(), {}
        reporter = asyncio.create_task(progress(streams, args.max_tokens, began, stop, args.progress_every))
        kill = asyncio.create_task(killer(streams, args.max_tokens, args.kill_at, app, kill_log))
        await asyncio.gather(*(one_stream(client, model, s, args.max_tokens, deadline) for s in streams))
        wall = time.monotonic() - began
        stop.set()
        await reporter
        kill.cancel()
        ingress_after = (await client.get("/v1/stats")).json().get("ingress", {})
        memory_after = {"ray_processes_rss_mb": ray_rss_mb(), "replicas": await replica_memory(client)}
    for s in streams:
        if s.outcome == "complete":
            good = s.token_ids == refs[s.prompt] and s.usage["completion_tokens"] == args.max_tokens
            s.outcome = "ok" if good else "wrong"
            s.text_differs = s.text != ref_texts[s.prompt]
    report = summarize(streams, args, wall, kill_log, memory_before, memory_after,
                       {k: ingress_after.get(k, 0) - ingress_before.get(k, 0) for k in ingress_after})
    for w in report["wrong_streams"]:
        w["expected"] = refs[w["prompt"]]
    return report


def summarize(streams, args, wall, kill_log, memory_before, memory_after, ingress) -> dict:
    outcomes: dict[str, int] = {}
    for s in streams:
        outcomes[s.outcome] = outcomes.get(s.outcome, 0) + 1
    ttft = [s.arrivals[0] - s.sent for s in streams if s.arrivals]
    gaps = [b - a for s in streams for a, b in zip(s.arrivals, s.arrivals[1:])]
    return {
        "streams": args.streams, "max_tokens": args.max_tokens, "replicas": args.replicas, "wall_s": round(wall, 1),
        "requests_ok": outcomes.get("ok", 0), "requests_wrong": outcomes.get("wrong", 0),
        "requests_failed": sum(v for k, v in outcomes.items() if k not in ("ok", "wrong")),
        "ok_but_text_differs": sum(s.outcome == "ok" and s.text_differs for s in streams),
        "outcomes": outcomes, "retries_429": sum(s.retries_429 for s in streams), "kill": kill_log,
        "ingress_continuations": ingress,
        "ttft_p50_ms": ms(percentile(ttft, 50, "inclusive")), "ttft_p99_ms": ms(percentile(ttft, 99, "inclusive")),
        "itl_p50_ms": ms(percentile(gaps, 50, "inclusive")), "itl_p99_ms": ms(percentile(gaps, 99, "inclusive")),
        "max_gap_ms": ms(max(gaps, default=None)),
        "streams_with_a_gap_over_5s": sum(any(b - a > 5.0 for a, b in zip(s.arrivals, s.arrivals[1:])) for s in streams),
        "output_tokens_per_s": round(sum((s.usage or {}).get("completion_tokens", 0) for s in streams) / wall, 1),
        "memory_before": memory_before, "memory_after": memory_after,
        "wrong_streams": [{"prompt": s.prompt, "got": s.token_ids, "usage": s.usage} for s in streams
                          if s.outcome == "wrong"][:20],
    }


def app_args(args) -> dict:
    """configs/tiny.yaml's app, with --replicas coordinator replicas and a queue deep enough for
    the whole burst (the point is replica loss, not 429s)."""
    import yaml

    spec = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())["applications"][0]
    a = dict(spec["args"])
    a["max_queued_requests"] = max(a.get("max_queued_requests", 32), args.streams)
    coordinator = dict(a.get("coordinator", {}))
    coordinator["autoscaling"] = {"min_replicas": args.replicas, "max_replicas": args.replicas}
    a["coordinator"] = coordinator
    return a


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(args) -> dict:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a throwaway cluster on loopback only
    import ray
    from ray import serve

    from specserve.serve.app import build_app

    spec_args = app_args(args)
    print(f"references: greedy output of {args.prompts} prompts x {args.max_tokens} tokens (target alone)", flush=True)
    refs, ref_texts = references(spec_args, prompts(args.prompts), args.max_tokens)
    port = free_port()
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             namespace="specserve-soak")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = "specserve-soak"
        began = time.monotonic()
        serve.run(build_app(spec_args), name=app, route_prefix="/")
        while serve.status().applications[app].deployments["Coordinator"].replica_states.get("RUNNING", 0) \
                < args.replicas:
            time.sleep(0.5)
        print(f"deployed {app} ({args.replicas} coordinator replicas) in {time.monotonic() - began:.0f} s; "
              f"{args.streams} streams of {args.max_tokens} tokens", flush=True)
        return asyncio.run(drive(f"http://127.0.0.1:{port}", spec_args["served_model_name"], app, args, refs, ref_texts))
    finally:
        serve.shutdown()
        ray.shutdown()


def print_report(r: dict) -> None:
    kill = r["kill"]
    where = (f"killed 1 of {r['replicas']} coordinator replicas at {100 * kill['at_fraction']:.0f}% of the tokens, "
             f"{kill['in_flight']} streams in flight" if kill.get("killed") else "no replica killed (run ended first)")
    print(f"\nsoak: {r['streams']} streams x {r['max_tokens']} tokens, {where}; {r['wall_s']} s, "
          f"{r['output_tokens_per_s']} output tok/s")
    rows = [("requests ok", r["requests_ok"]), ("requests failed", r["requests_failed"]),
            ("streams wrong (lost / duplicated tokens)", r["requests_wrong"]),
            ("right ids, text not their one-shot decode", r["ok_but_text_differs"]),
            ("continuations on another replica", r["ingress_continuations"].get("continuations")),
            ("given up (no replica left)", r["ingress_continuations"].get("given_up")),
            ("429s retried", r["retries_429"]),
            ("TTFT p50 / p99 (ms)", f"{r['ttft_p50_ms']} / {r['ttft_p99_ms']}"),
            ("ITL p50 / p99 (ms, between chunks)", f"{r['itl_p50_ms']} / {r['itl_p99_ms']}"),
            ("longest gap in any stream (ms)", r["max_gap_ms"]),
            ("streams with a gap over 5 s", r["streams_with_a_gap_over_5s"]),
            ("RSS of Ray processes before / after (MB)",
             f"{r['memory_before']['ray_processes_rss_mb']} / {r['memory_after']['ray_processes_rss_mb']}")]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    print(f"  outcomes: {r['outcomes']}")
    for when in ("before", "after"):
        for replica, procs in r[f"memory_{when}"]["replicas"].items():
            print(f"  replica {replica} {when}: " + ", ".join(f"{p} {mb} MB" for p, mb in procs.items()))


def main(args) -> int:
    report = run(args)
    print_report(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"\nwrote {args.out}")
    return 1 if report["requests_failed"] or report["requests_wrong"] else 0
