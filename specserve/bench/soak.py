"""Soak tests: many concurrent streams, bounded in time, loopback only.

Two modes (`specserve bench soak ...` = `python -m specserve.bench.soak ...`):

    specserve bench soak [--streams 500] [--max-tokens 48] [--replicas 2] [--kill-at 0.3]
        Replica loss (specserve.bench.soak_failover): a local Ray on 127.0.0.1 serving
        configs/tiny.yaml with 2 coordinator replicas, N streams at once, one replica killed
        mid-run; each stream checked against the target's greedy output (lost / duplicated
        tokens), TTFT / ITL percentiles, memory before and after.

    specserve bench soak --url http://127.0.0.1:8000 --clients 100 --minutes 10
        Against a running app: N clients loop for M minutes (below).

With --url, each client loops: a streaming completion (a prompt from a small set, max_tokens drawn from
[8, --max-tokens], greedy or sampled), read to `[DONE]`; a 429 (the server's full queue: intended
back-pressure) waits Retry-After and is counted apart from errors. Every --sample-every seconds the
tool reads `/v1/stats` a few times (each read lands on one coordinator replica) for the resident
memory of every coordinator and worker process and their KV-cache storage.

Prints the outcome by kind, throughput and latency, and per process the RSS after warm-up, at the
end and at its peak; writes everything (with the time series) to --out as JSON. The run stops by
itself: no new request starts after the deadline and each request has a timeout. Loopback only
unless --allow-remote.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from pathlib import Path

import httpx

from specserve.bench.sse import events, ms, percentile, refuse_remote

PROMPTS = ["Hello", "The quick brown fox", "Speculative decoding is lossless.", "0123456789" * 3,
           "Once upon a time", "héllo wörld → ok", "a", "List three colours:"]
INTENDED = "http_429"  # back-pressure, not an error


class Tally:
    def __init__(self) -> None:
        self.outcomes: Counter[str] = Counter()
        self.tokens = 0
        self.ttft: list[float] = []
        self.latency: list[float] = []
        self.window_tokens = 0  # since the last sample

    def errors(self) -> dict[str, int]:
        return {k: v for k, v in self.outcomes.items() if k not in ("ok", INTENDED)}


async def one_request(client: httpx.AsyncClient, model: str, max_tokens: int, rng: random.Random,
                      tally: Tally, timeout: float) -> float:
    """One streaming request; returns how long to wait before the next (Retry-After on a 429)."""
    body = {"model": model, "prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(8, max_tokens),
            "temperature": rng.choice([0.0, 0.8]), "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    began = time.perf_counter()
    first = None
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    tally.outcomes[f"http_{r.status_code}"] += 1
                    return float(r.headers.get("retry-after", 1)) if r.status_code in (429, 503) else 0.5
                done, usage = False, None
                try:
                    async for event in events(r):
                        if event is None:
                            done = True
                            break
                        if "error" in event:
                            tally.outcomes[f"sse_error_{event['error'].get('code')}"] += 1
                            return 0.5
                        if first is None and event.get("choices"):
                            first = time.perf_counter()
                        if event.get("usage"):
                            usage = event["usage"]
                except json.JSONDecodeError:
                    tally.outcomes["bad_sse_event"] += 1
                    return 0.5
                if not done or usage is None:
                    tally.outcomes["incomplete_stream"] += 1
                    return 0.5
    except TimeoutError:
        tally.outcomes["timeout"] += 1
        return 0.5
    except httpx.HTTPError as err:
        tally.outcomes[f"transport_{type(err).__name__}"] += 1
        return 0.5
    tally.outcomes["ok"] += 1
    tally.tokens += usage["completion_tokens"]
    tally.window_tokens += usage["completion_tokens"]
    tally.latency.append(time.perf_counter() - began)
    if first is not None:
        tally.ttft.append(first - began)
    return 0.0


async def client_loop(i: int, client, model, args, tally: Tally, deadline: float) -> None:
    rng = random.Random(args.seed * 100003 + i)
    await asyncio.sleep(rng.random() * min(5.0, args.minutes * 6))  # ramp up over a few seconds
    while time.monotonic() < deadline:
        try:
            wait = await one_request(client, model, args.max_tokens, rng, tally, args.request_timeout)
        except Exception as err:  # count it, keep the client going
            tally.outcomes[f"client_{type(err).__name__}"] += 1
            wait = 0.5
        if wait:
            await asyncio.sleep(min(wait, max(deadline - time.monotonic(), 0)))


async def sampler(client, tally: Tally, deadline: float, every: float, began: float, samples: list) -> None:
    """Memory of every coordinator replica's processes, read through /v1/stats (several reads a
    sample, since each lands on one replica)."""
    while True:
        t = time.monotonic()
        sample = {"t_s": round(t - began, 1), "tokens_per_s": tally.window_tokens / every if samples else None,
                  "ok": tally.outcomes["ok"], "replicas": {}}
        tally.window_tokens = 0
        for _ in range(4):
            try:
                stats = (await client.get("/v1/stats", timeout=30)).json()
            except (httpx.HTTPError, ValueError):
                continue
            mem = stats.get("memory", {})
            sample["replicas"][stats.get("replica", "?")] = {
                "running": stats.get("running"), "waiting": stats.get("waiting"),
                **{f"{proc}_rss_mb": round(m["rss_bytes"] / 2**20, 1) for proc, m in mem.items()},
                **{f"{proc}_kv_cache_mb": round(m["kv_cache_bytes"] / 2**20, 2) for proc, m in mem.items()
                   if "kv_cache_bytes" in m},
            }
        samples.append(sample)
        if t >= deadline:
            return
        await asyncio.sleep(min(every, max(deadline - time.monotonic(), 0.1)))


def memory_table(samples: list, warmup_s: float) -> list[dict]:
    series: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for s in samples:
        for replica, values in s["replicas"].items():
            for key, value in values.items():
                if key.endswith("_rss_mb"):
                    series.setdefault((replica, key[: -len("_rss_mb")]), []).append((s["t_s"], value))
    rows = []
    for (replica, proc), points in sorted(series.items()):
        after = [v for t, v in points if t >= warmup_s] or [points[-1][1]]
        rows.append({"replica": replica[-8:], "process": proc, "samples": len(points),
                     "rss_mb_after_warmup": after[0], "rss_mb_end": after[-1], "rss_mb_max": max(v for _, v in points),
                     "growth_after_warmup_mb": round(after[-1] - after[0], 1)})
    return rows


async def run(args) -> dict:
    limits = httpx.Limits(max_connections=args.clients + 8, max_keepalive_connections=args.clients + 8)
    async with httpx.AsyncClient(base_url=args.url, timeout=args.request_timeout, limits=limits) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        tally, samples = Tally(), []
        began = time.monotonic()
        deadline = began + args.minutes * 60
        tasks = [asyncio.create_task(client_loop(i, client, model, args, tally, deadline)) for i in range(args.clients)]
        sampling = asyncio.create_task(sampler(client, tally, deadline, args.sample_every, began, samples))
        await asyncio.gather(*tasks)
        await sampling
        wall = time.monotonic() - began
    warmup = min(60.0, 0.2 * args.minutes * 60)
    return {
        "url": args.url, "model": model, "clients": args.clients, "minutes": args.minutes, "wall_s": round(wall, 1),
        "outcomes": dict(tally.outcomes), "errors": tally.errors(), "intended_429": tally.outcomes[INTENDED],
        "requests_ok": tally.outcomes["ok"], "requests_per_s": round(tally.outcomes["ok"] / wall, 2),
        "output_tokens_per_s": round(tally.tokens / wall, 1),
        "ttft_p50_ms": ms(percentile(tally.ttft, 50)), "ttft_p99_ms": ms(percentile(tally.ttft, 99)),
        "latency_p50_ms": ms(percentile(tally.latency, 50)),
        "latency_p99_ms": ms(percentile(tally.latency, 99)),
        "warmup_s": warmup, "memory": memory_table(samples, warmup), "samples": samples,
    }


def print_report(r: dict) -> None:
    print(f"\nsoak: {r['clients']} clients x {r['minutes']} min against {r['url']} ({r['model']}), {r['wall_s']} s")
    print(f"  ok {r['requests_ok']}  ({r['requests_per_s']} req/s, {r['output_tokens_per_s']} output tok/s)   "
          f"intended 429s {r['intended_429']}   errors {sum(r['errors'].values())} {r['errors'] or ''}")
    print(f"  TTFT p50/p99 {r['ttft_p50_ms']}/{r['ttft_p99_ms']} ms   request p50/p99 "
          f"{r['latency_p50_ms']}/{r['latency_p99_ms']} ms")
    print(f"\n  memory (RSS, MB; warm-up = first {r['warmup_s']:.0f} s)")
    print(f"  {'replica':<10}{'process':<13}{'samples':>8}{'after warm-up':>15}{'end':>9}{'max':>9}{'growth':>9}")
    for m in r["memory"]:
        print(f"  {m['replica']:<10}{m['process']:<13}{m['samples']:>8}{m['rss_mb_after_warmup']:>15.1f}"
              f"{m['rss_mb_end']:>9.1f}{m['rss_mb_max']:>9.1f}{m['growth_after_warmup_mb']:>+9.1f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specserve bench soak", description=__doc__.splitlines()[0])
    p.add_argument("--url", default=None, help="soak a running app there (default: the replica-loss soak on a "
                                               "local Ray of its own)")
    p.add_argument("--max-tokens", type=int, default=None, help="per request (default: 48; with --url: at most 64)")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON report (default: bench-results/soak_failover.json; with --url: bench-results/soak.json)")
    p.add_argument("--request-timeout", type=float, default=120.0, help="--url: per request")
    loss = p.add_argument_group("replica-loss soak (no --url)")
    loss.add_argument("--streams", type=int, default=500, help="concurrent streams, one request each")
    loss.add_argument("--replicas", type=int, default=2, help="coordinator replicas (one is killed)")
    loss.add_argument("--kill-at", type=float, default=0.3, help="kill once this share of the tokens arrived")
    loss.add_argument("--prompts", type=int, default=40, help="distinct prompts (each with its greedy reference)")
    loss.add_argument("--num-cpus", type=int, default=2, help="CPUs of the local Ray")
    loss.add_argument("--timeout-s", type=float, default=600.0, help="the whole run's bound")
    loss.add_argument("--progress-every", type=float, default=5.0, help="seconds between progress lines")
    running = p.add_argument_group("against a running app (--url)")
    running.add_argument("--clients", type=int, default=100)
    running.add_argument("--minutes", type=float, default=10.0)
    running.add_argument("--model", default=None, help="default: the first of /v1/models")
    running.add_argument("--sample-every", type=float, default=15.0, help="seconds between memory samples")
    running.add_argument("--seed", type=int, default=0)
    running.add_argument("--allow-remote", action="store_true", help="allow a non-loopback --url")
    args = p.parse_args(argv)
    if args.url is None:
        from specserve.bench import soak_failover

        if args.replicas < 2:
            p.error("--replicas must be >= 2: one of them is killed")
        args.max_tokens = args.max_tokens or 48
        args.out = args.out or Path("bench-results/soak_failover.json")
        return soak_failover.main(args)
    args.max_tokens = args.max_tokens or 64
    args.out = args.out or Path("bench-results/soak.json")
    refuse_remote(p, args)
    report = asyncio.run(run(args))
    print_report(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"\nwrote {args.out}")
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
