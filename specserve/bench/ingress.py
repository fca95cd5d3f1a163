"""Front-door benchmark against a running app: does one huge request stall the others?

    python -m specserve.bench.ingress --url http://127.0.0.1:8000 [--huge-mb 20,3] [--small 20]

For each huge size: the latency of a small request (`POST /v1/completions`, prompt "hi", 4 tokens)
alone, then while huge prompts of that size are in flight (one at a time, back to back, each
overlapped by small requests sent one after another), and how long the server takes to refuse
each huge prompt (with its status: 413 past the body limit, 400 from the length pre-check under
it). Prints a table (medians and p90), writes JSON (default bench-results/ingress.json).
Loopback only unless --allow-remote.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

from specserve.bench.sse import add_url_arguments, nearest_rank, refuse_remote


async def _small(client: httpx.AsyncClient, model: str) -> float:
    began = time.perf_counter()
    r = await client.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 4,
                                                   "temperature": 0.0})
    if r.status_code != 200:
        raise RuntimeError(f"small request: HTTP {r.status_code}: {r.text[:200]}")
    return time.perf_counter() - began


async def _huge(client: httpx.AsyncClient, body: bytes) -> tuple[float, int]:
    began = time.perf_counter()
    try:
        r = await client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        status = r.status_code
    except httpx.TransportError:  # the server answered and closed before the upload finished
        status = -1
    return time.perf_counter() - began, status


async def _measure(args, model: str, mb: float) -> dict:
    body = json.dumps({"model": model, "prompt": "h" * int(mb * (1 << 20)), "max_tokens": 4}).encode()
    limits = httpx.Limits(max_connections=4)
    async with httpx.AsyncClient(base_url=args.url, timeout=args.timeout, headers=args.headers, limits=limits) as c:
        for _ in range(3):
            await _small(c, model)  # warm-up
        alone = [await _small(c, model) for _ in range(args.small)]
        during, refusals, statuses = [], [], []
        for _ in range(args.huge_count):
            task = asyncio.ensure_future(_huge(c, body))
            while not task.done() or not during:
                during.append(await _small(c, model))
            took, status = await task
            refusals.append(took)
            statuses.append(status)
    alone_p50, during_p50 = statistics.median(alone), statistics.median(during)
    return {"huge_mb": mb, "huge_bytes": len(body), "alone_p50_s": alone_p50, "alone_p90_s": nearest_rank(alone, 0.9),
            "during_p50_s": during_p50, "during_p90_s": nearest_rank(during, 0.9), "during_n": len(during),
            "ratio_p50": during_p50 / alone_p50, "refuse_p50_s": statistics.median(refusals),
            "refuse_max_s": max(refusals), "huge_statuses": sorted(set(statuses))}


def print_report(rows: list[dict]) -> None:
    print("| request | alone (p50 / p90) | while huge prompts are in flight (p50 / p90, n) | ratio p50 "
          "| huge prompt refused in (p50 / max) | huge status |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| `POST /v1/completions` \"hi\", 4 tokens, vs {r['huge_mb']:g} MB prompts "
              f"| {r['alone_p50_s']:.3f} / {r['alone_p90_s']:.3f} s "
              f"| {r['during_p50_s']:.3f} / {r['during_p90_s']:.3f} s ({r['during_n']}) | {r['ratio_p50']:.2f}x "
              f"| {r['refuse_p50_s']:.3f} / {r['refuse_max_s']:.3f} s | {', '.join(map(str, r['huge_statuses']))} |")


async def run(args) -> list[dict]:
    async with httpx.AsyncClient(base_url=args.url, timeout=30, headers=args.headers) as c:
        model = args.model or (await c.get("/v1/models")).json()["data"][0]["id"]
    return [await _measure(args, model, mb) for mb in args.huge_mb]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specserve.bench.ingress", description=__doc__.splitlines()[0])
    add_url_arguments(p)
    p.add_argument("--model", default=None, help="default: the server's only model")
    p.add_argument("--api-key", default=None, help="sent as a Bearer token")
    p.add_argument("--huge-mb", default="20,3", help="comma list of huge prompt sizes in MiB")
    p.add_argument("--huge-count", type=int, default=5, help="huge prompts per size, one after another")
    p.add_argument("--small", type=int, default=20, help="small requests measured alone")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--out", type=Path, default=Path("bench-results/ingress.json"))
    args = p.parse_args(argv)
    refuse_remote(p, args)
    args.huge_mb = [float(x) for x in args.huge_mb.split(",") if x]
    args.headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rows = asyncio.run(run(args))
    print_report(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"url": args.url, "rows": rows}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
