"""Overload benchmark: one burst of N concurrent completions against a running app.

    specserve serve configs/tiny.yaml --num-cpus 2 &
    python -m specserve.bench.overload --url http://127.0.0.1:8000 --requests 600 --max-tokens 128

Every request is sent at once (non-streaming, greedy, ignore_eos, max_tokens each) and timed from
when it goes out. Prints, as a markdown table: status codes (a 429 split by who sent it: the
coordinator's OpenAI-shaped `queue_full`, or Serve's own queue), the time from the burst's start to
the first 429, latency percentiles of the 429s and of the accepted (200) requests, and the burst's
wall time; appends the row to --out (JSON). Loopback only unless --allow-remote; every request
has a timeout, so the run is bounded.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections import Counter
from pathlib import Path

import httpx

from specserve.bench.sse import add_url_arguments, refuse_remote


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def burst(url: str, model: str, requests: int, max_tokens: int, timeout: float) -> dict:
    body = {"model": model, "prompt": "Overload test:", "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True}
    began = time.monotonic()

    async def sent(request):
        request.extensions["sent"] = time.monotonic()

    limits = httpx.Limits(max_connections=requests + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits, event_hooks={"request": [sent]}) as client:
        async def one() -> tuple[str, float, float]:
            try:
                r = await client.post("/v1/completions", json=body)
            except httpx.HTTPError as err:
                return f"error:{type(err).__name__}", time.monotonic() - began, float("nan")
            kind = str(r.status_code)
            if r.status_code == 429:
                try:
                    kind += " queue_full" if r.json()["error"]["code"] == "queue_full" else " other"
                except (ValueError, KeyError, TypeError):
                    kind += " serve"
            done = time.monotonic()
            return kind, done - began, done - r.request.extensions.get("sent", began)

        results = await asyncio.gather(*(one() for _ in range(requests)))
    wall = time.monotonic() - began
    accepted = [lat for kind, _, lat in results if kind == "200"]
    refused = [lat for kind, _, lat in results if kind.startswith("429")]
    first_429 = min((at for kind, at, _ in results if kind.startswith("429")), default=None)
    return {
        "requests": requests, "max_tokens": max_tokens, "codes": dict(Counter(kind for kind, _, _ in results)),
        "first_429_s": first_429, "wall_s": wall,
        "refused_p50_s": _pct(refused, 0.5), "refused_p99_s": _pct(refused, 0.99),
        "accepted_p50_s": _pct(accepted, 0.5), "accepted_p90_s": _pct(accepted, 0.9),
        "accepted_p99_s": _pct(accepted, 0.99), "accepted_max_s": max(accepted, default=None),
        "accepted_mean_s": statistics.fmean(accepted) if accepted else None,
    }


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def table(rows: list[dict]) -> str:
    head = ("| run | codes | first 429 (s) | 429 p50 / p99 (s) | accepted p50 / p90 / p99 / max (s) | wall (s) |\n"
            "|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        codes = ", ".join(f"{k}: {v}" for k, v in sorted(r["codes"].items()))
        lines.append(f"| {r.get('label', '')} | {codes} | {_fmt(r['first_429_s'])} | "
                     f"{_fmt(r['refused_p50_s'])} / {_fmt(r['refused_p99_s'])} | "
                     f"{_fmt(r['accepted_p50_s'])} / {_fmt(r['accepted_p90_s'])} / {_fmt(r['accepted_p99_s'])} / "
                     f"{_fmt(r['accepted_max_s'])} | {_fmt(r['wall_s'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_url_arguments(p)
    p.add_argument("--model", default=None, help="default: the one /v1/models lists")
    p.add_argument("--requests", type=int, default=600)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    p.add_argument("--label", default="")
    p.add_argument("--out", type=Path, default=Path("bench-results/overload.json"))
    args = p.parse_args(argv)
    refuse_remote(p, args)
    if not 1 <= args.requests <= 5000:
        p.error("--requests must lie in [1, 5000]")
    model = args.model or httpx.get(f"{args.url}/v1/models", timeout=30).json()["data"][0]["id"]
    row = {"label": args.label, "url": args.url, "model": model,
           **asyncio.run(burst(args.url, model, args.requests, args.max_tokens, args.timeout))}
    rows = json.loads(args.out.read_text()) if args.out.exists() else []
    rows.append(row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2))
    print(table([row]))
    print(f"appended to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
