"""HTTP benchmark against a running specserve app: speculative vs γ=0 in one run.

    python -m specserve.bench.http --url http://127.0.0.1:8000 [--concurrency 1,4,16,64]

For each γ setting ("default" = the server's configured γ; "0" = the per-request extension field
`num_speculative_tokens: 0`, i.e. target-only decoding on the same replica and workers) and each
concurrency level, it sends `--requests` streaming completions (default: as many as the
concurrency, at least 4) with `ignore_eos` so every request makes exactly `--max-tokens` tokens.

Per level: output tokens/s (all tokens / wall time), TTFT p50/p99, inter-token latency p50/p99
(per request: (last chunk - first chunk) / (tokens - 1); a speculative step delivers several
tokens in one chunk, so per-chunk gaps would overstate it), the acceptance rate, and the
coordinator's per-step timings from /v1/stats (step wall p50; overhead p50 = step wall - model
forward time; rpc p50 = step wall - time inside the worker calls). Stats are per coordinator
replica: run against a single-replica app for exact figures. With `--system-words N` every
request starts with the same system prompt of N words (a system message with `--chat`), and the
table reports the prompt tokens per request and how many of them the server took from its prefix
cache (`usage.prompt_tokens_details.cached_tokens`). With `--rounds N` each level runs N passes,
the γ settings side by side in every round (their order reversed every other round): a row sums its
passes, and the speedup over γ=0 is given summed and round by round. Prints a table, writes JSON.
Loopback only unless --allow-remote.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx

from specserve.bench.sse import add_url_arguments, events, ms, nearest_rank, refuse_remote

PROMPTS = [
    "Explain what speculative decoding is in two sentences.",
    "Write a short poem about the sea.",
    "List three uses of a hash table.",
    "What is the capital of France? Answer briefly.",
    "Describe how a bicycle works.",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
    "Summarise the plot of Hamlet.",
]
# the shared system prompt's words (`--system-words`), repeated as far as asked
SYSTEM = ("You are a support assistant for a company that sells bicycles, spare parts and repairs. Answer in "
          "plain English, briefly, and only about the company's products and services. Prices are in euros "
          "and include tax. Opening hours are nine to six on weekdays and ten to four on Saturdays. Never "
          "promise a delivery date; say that the shop confirms it by email. If a question is about safety, "
          "advise the customer to visit a workshop.").split()


def system_prompt(words: int) -> str:
    return " ".join(SYSTEM[i % len(SYSTEM)] for i in range(words))


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_url_arguments(p)
    p.add_argument("--model", default=None, help="default: the server's only model")
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--requests", type=int, default=None, help="per level (default: max(concurrency, 4))")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--gammas", default="default,0", help="comma list: 'default' and/or integers")
    p.add_argument("--rounds", type=int, default=1,
                   help="passes per level, the γ settings interleaved (their order reversed every other round)")
    p.add_argument("--chat", action="store_true", help="use /v1/chat/completions")
    p.add_argument("--out", type=Path, default=Path("bench-results/http.json"))
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--system-words", type=int, default=0,
                   help="a system prompt of this many words shared by every request (0: none)")


async def _one(client: httpx.AsyncClient, args, model: str, prompt: str, gamma: int | None) -> dict:
    body = {"model": model, "max_tokens": args.max_tokens, "temperature": args.temperature, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    system = system_prompt(args.system_words) if args.system_words else None
    if args.chat:
        messages = [{"role": "system", "content": system}] if system else []
        path, body["messages"] = "/v1/chat/completions", messages + [{"role": "user", "content": prompt}]
    else:
        path, body["prompt"] = "/v1/completions", f"{system}\n\n{prompt}" if system else prompt
    if gamma is not None:
        body["num_speculative_tokens"] = gamma
    began, chunk_times, usage, spec = time.perf_counter(), [], None, None
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {await r.aread()!r}")
        async for event in events(r):
            if event is None:
                continue
            if event.get("usage"):
                usage, spec = event["usage"], event.get("speculation")
            elif event.get("choices"):
                chunk_times.append(time.perf_counter())
    tokens = usage["completion_tokens"] if usage else 0
    ttft = chunk_times[0] - began if chunk_times else None
    itl = (chunk_times[-1] - chunk_times[0]) / (tokens - 1) if tokens > 1 and len(chunk_times) > 1 else None
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"tokens": tokens, "ttft": ttft, "itl": itl, "speculation": spec or {},
            "prompt_tokens": (usage or {}).get("prompt_tokens", 0), "cached_tokens": cached}


async def _pass(client, args, model: str, concurrency: int, gamma: int | None) -> dict:
    """One timed pass of a level: its requests' results, the wall time and the coordinator's stats."""
    n = args.requests or max(concurrency, 4)
    await client.post("/v1/stats/reset")
    gate = asyncio.Semaphore(concurrency)

    async def run(i: int) -> dict:
        async with gate:
            return await _one(client, args, model, PROMPTS[i % len(PROMPTS)], gamma)

    began = time.perf_counter()
    results = await asyncio.gather(*(run(i) for i in range(n)))
    wall = time.perf_counter() - began
    return {"results": results, "wall_s": wall, "coordinator": (await client.get("/v1/stats")).json()}


def _level(gamma: int | None, concurrency: int, passes: list[dict]) -> dict:
    """A level's row over its passes (one per round): tokens over wall time summed, latency percentiles
    over every request, and each pass's tok/s (`round_tokens_per_s`); `coordinator`: the last pass's stats."""
    results = [r for p in passes for r in p["results"]]
    tokens, wall = sum(r["tokens"] for r in results), sum(p["wall_s"] for p in passes)
    drafted = sum(r["speculation"].get("num_draft_tokens", 0) for r in results)
    accepted = sum(r["speculation"].get("num_accepted_tokens", 0) for r in results)
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    itls = [r["itl"] for r in results if r["itl"] is not None]
    return {
        "gamma": "default" if gamma is None else gamma, "concurrency": concurrency, "requests": len(results),
        "wall_s": wall, "output_tokens": tokens, "tokens_per_s": tokens / wall,
        "round_tokens_per_s": [sum(r["tokens"] for r in p["results"]) / p["wall_s"] for p in passes],
        "ttft_p50_ms": ms(nearest_rank(ttfts, 0.5), None), "ttft_p99_ms": ms(nearest_rank(ttfts, 0.99), None),
        "itl_p50_ms": ms(nearest_rank(itls, 0.5), None), "itl_p99_ms": ms(nearest_rank(itls, 0.99), None),
        "acceptance_rate": accepted / drafted if drafted else None, "draft_tokens": drafted,
        "accepted_tokens": accepted, "prompt_tokens_mean": sum(r["prompt_tokens"] for r in results) / len(results),
        "cached_tokens_mean": sum(r["cached_tokens"] for r in results) / len(results),
        "coordinator": passes[-1]["coordinator"],
    }


def _fmt(x, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def _table(rows: list[dict]) -> str:
    head = (f"{'gamma':>7} {'conc':>4} {'req':>4} {'tok/s':>8} {'ttft50':>7} {'ttft99':>7} {'itl50':>6} "
            f"{'itl99':>6} {'alpha':>5} {'step50':>7} {'ovh50':>6} {'rpc50':>6} {'prompt':>6} {'cached':>6}   (ms)")
    lines = [head]
    for r in rows:
        c = r["coordinator"]
        lines.append(
            f"{r['gamma']!s:>7} {r['concurrency']:>4} {r['requests']:>4} {r['tokens_per_s']:>8.1f} "
            f"{_fmt(r['ttft_p50_ms']):>7} {_fmt(r['ttft_p99_ms']):>7} {_fmt(r['itl_p50_ms']):>6} "
            f"{_fmt(r['itl_p99_ms']):>6} {_fmt(r['acceptance_rate'], '.2f'):>5} "
            f"{_fmt(c.get('step_wall_p50_ms')):>7} {_fmt(c.get('overhead_p50_ms')):>6} "
            f"{_fmt(c.get('rpc_overhead_p50_ms')):>6} {r['prompt_tokens_mean']:>6.0f} {r['cached_tokens_mean']:>6.0f}")
    return "\n".join(lines)


def _speedups(rows: list[dict]) -> dict[int, dict]:
    """Per concurrency: the default γ's tok/s over γ=0's, summed over rounds ("speedup"), and round by
    round ("rounds": the ratio of the two passes each round ran side by side)."""
    base = {r["concurrency"]: r for r in rows if r["gamma"] == 0}
    out = {}
    for r in rows:
        zero = base.get(r["concurrency"])
        if r["gamma"] == "default" and zero:
            out[r["concurrency"]] = {
                "speedup": r["tokens_per_s"] / zero["tokens_per_s"],
                "rounds": [a / b for a, b in zip(r["round_tokens_per_s"], zero["round_tokens_per_s"])]}
    return out


def _order(gammas: list, round_: int) -> list:
    """The γ settings in a round's order: as given in even rounds, reversed in odd ones, so that neither
    setting always runs first (the first pass after the other setting finds its caches and costs)."""
    return gammas if round_ % 2 == 0 else gammas[::-1]


async def _main(args) -> dict:
    levels = [int(c) for c in args.concurrency.split(",")]
    # each setting once: `--rounds` repeats and interleaves them
    gammas = list(dict.fromkeys(None if g.strip() == "default" else int(g) for g in args.gammas.split(",")))
    limits = httpx.Limits(max_connections=max(levels) + 4, max_keepalive_connections=max(levels) + 4)
    async with httpx.AsyncClient(base_url=args.url, timeout=args.timeout, limits=limits) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        await _one(client, args, model, PROMPTS[0], None)  # warm-up
        passes: dict[tuple, list[dict]] = {(g, c): [] for g in gammas for c in levels}
        for round_ in range(args.rounds):
            for c in levels:
                for gamma in _order(gammas, round_):
                    passes[gamma, c].append(await _pass(client, args, model, c, gamma))
                    row = _level(gamma, c, passes[gamma, c][-1:])
                    print(f"round {round_ + 1}: " + _table([row]).splitlines()[1], flush=True)
        rows = [_level(g, c, passes[g, c]) for g in gammas for c in levels]
    return {"url": args.url, "model": model, "max_tokens": args.max_tokens, "temperature": args.temperature,
            "chat": args.chat, "system_words": args.system_words, "rounds": args.rounds, "rows": rows,
            "speedup_vs_gamma0": _speedups(rows)}


def run(args: argparse.Namespace) -> int:
    report = asyncio.run(_main(args))
    print()
    print(_table(report["rows"]))
    for c, s in report["speedup_vs_gamma0"].items():
        each = ", ".join(f"{x:.2f}" for x in s["rounds"])
        print(f"speedup vs gamma=0 at concurrency {c}: {s['speedup']:.2f}x (round by round: {each})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specserve bench http", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    refuse_remote(parser, args)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
