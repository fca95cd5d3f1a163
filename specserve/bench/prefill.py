"""Prefill benchmark: inter-token latency of running streams while long prompts arrive, with chunked
prefill off (a prompt prefilled whole inside its first step) and on, side by side in one run.

    python -m specserve.bench.prefill [--model smollm2|tiny] [--out bench-results/prefill.json]

`--streams` requests decode without end (ignore_eos); every `--interval` seconds a `--long`-token
prompt arrives (the shipped prompts concatenated), takes `--long-max-tokens` tokens and leaves.
Each mode runs `--seconds` per round, rounds alternate off/on (a shared machine's load bursts hit
every mode; `--chunks` may list several budgets). A running stream's tokens from one step share its wait evenly (as the serving metrics do):
ITL samples are (now - its previous step's end) / tokens. Also: the long prompts' TTFT (arrival to
first token) and the running streams' tokens per second. A speed figure, so a benchmark, not a test.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specserve import prompts as prompt_sets
from specserve.engine import SamplingParams, SpeculativeEngine


@dataclass
class Mode:
    label: str
    chunk: int  # prefill_chunk_tokens, 0 = off
    itl: list[float] = field(default_factory=list)  # seconds per token, running streams
    ttft: list[float] = field(default_factory=list)  # seconds, long prompts
    stream_tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    long_prompts: int = 0

    def summary(self) -> dict:
        q = percentiles(self.itl)
        return {"mode": self.label, "prefill_chunk_tokens": self.chunk, "itl_p50_ms": 1e3 * q[50],
                "itl_p90_ms": 1e3 * q[90], "itl_p99_ms": 1e3 * q[99], "itl_max_ms": 1e3 * max(self.itl),
                "long_ttft_p50_s": statistics.median(self.ttft) if self.ttft else None,
                "long_ttft_max_s": max(self.ttft) if self.ttft else None,
                "stream_tok_per_s": self.stream_tokens / self.seconds if self.seconds else 0.0,
                "steps": self.steps, "long_prompts": self.long_prompts, "itl_samples": len(self.itl)}


def percentiles(xs: list[float]) -> dict[int, float]:
    ordered = sorted(xs)
    return {p: ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))] for p in (50, 90, 99)}


def load(kind: str, long_len: int):
    """(target, draft, tokenizer) sized for prompts of long_len tokens."""
    if kind == "smollm2":
        from specserve.models.smollm2 import load_smollm2_draft, load_smollm2_target

        target, tokenizer = load_smollm2_target()
        return target, load_smollm2_draft(target), tokenizer
    if kind == "tiny":
        from specserve.models.tiny import byte_tokenizer, tiny_llama

        positions = 2 * long_len + 1024
        return (tiny_llama(0, layers=4, max_position_embeddings=positions),
                tiny_llama(0, layers=4, max_position_embeddings=positions, noise=0.5), byte_tokenizer())
    raise SystemExit(f"unknown model kind {kind!r}")


def workload(tokenizer, streams: int, long_len: int) -> tuple[list[list[int]], list[int]]:
    """(the running streams' prompts, the long prompt): shipped prompts, the long one concatenated."""
    records = prompt_sets.interleaved(prompt_sets.load_records(prompt_sets.GENERAL), None)
    prompts = [prompt_sets.encode(tokenizer, r) for r in records]
    long_prompt: list[int] = []
    while len(long_prompt) < long_len:
        long_prompt += prompts[len(long_prompt) % len(prompts)]
    return [prompts[i % len(prompts)] for i in range(streams)], long_prompt[:long_len]


def run_round(engine: SpeculativeEngine, mode: Mode, running: list[list[int]], long_prompt: list[int],
              args: argparse.Namespace, tag: str) -> None:
    """One timed window: the streams decode, long prompts arrive on schedule; all aborted after."""
    stream_params = SamplingParams(max_tokens=args.stream_max_tokens, temperature=0.0, ignore_eos=True)
    long_params = SamplingParams(max_tokens=args.long_max_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"{tag}-s{i}" for i in range(len(running))]
    for rid, prompt in zip(ids, running):
        engine.add_request(rid, prompt, stream_params)
    while not all(engine.sequence(r).output for r in ids):  # every stream decoding before the clock starts
        engine.step()
    last = dict.fromkeys(ids, time.perf_counter())
    arrivals: dict[str, float] = {}
    waiting: dict[str, float] = {}  # long prompts before their first token -> arrival
    began = time.perf_counter()
    next_arrival, n = began + args.interval / 2, 0
    while (now := time.perf_counter()) < began + args.seconds:
        if now >= next_arrival:
            rid = f"{tag}-long{n}"
            engine.add_request(rid, long_prompt, long_params)
            arrivals[rid] = waiting[rid] = now
            n, next_arrival = n + 1, next_arrival + args.interval
        outputs = engine.step()
        ended = time.perf_counter()
        mode.steps += 1
        for out in outputs:
            k = len(out.new_token_ids)
            if out.request_id in last and k:
                mode.itl += [(ended - last[out.request_id]) / k] * k
                mode.stream_tokens += k
                last[out.request_id] = ended
            elif out.request_id in waiting and k:
                mode.ttft.append(ended - waiting.pop(out.request_id))
    mode.seconds += time.perf_counter() - began
    mode.long_prompts += n
    for rid in [*ids, *arrivals]:
        engine.abort(rid)


def report(modes: list[Mode], args: argparse.Namespace) -> str:
    head = (f"{'prefill':<14}{'ITL p50 ms':>11}{'p90 ms':>9}{'p99 ms':>9}{'max ms':>9}"
            f"{'long TTFT p50 s':>16}{'stream tok/s':>13}{'steps':>7}{'long':>6}")
    lines = [f"{args.model}: {args.streams} running streams, a {args.long}-token prompt every {args.interval:g} s "
             f"({args.rounds} x {args.seconds:g} s per mode)", head, "-" * len(head)]
    for m in modes:
        s = m.summary()
        ttft = f"{s['long_ttft_p50_s']:>16.2f}" if s["long_ttft_p50_s"] is not None else f"{'-':>16}"
        lines.append(f"{m.label:<14}{s['itl_p50_ms']:>11.1f}{s['itl_p90_ms']:>9.1f}{s['itl_p99_ms']:>9.1f}"
                     f"{s['itl_max_ms']:>9.1f}{ttft}{s['stream_tok_per_s']:>13.1f}{s['steps']:>7}{s['long_prompts']:>6}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"])
    parser.add_argument("--streams", type=int, default=8, help="running streams")
    parser.add_argument("--long", type=int, default=2000, help="tokens of each arriving prompt")
    parser.add_argument("--interval", type=float, default=4.0, help="seconds between long prompts")
    parser.add_argument("--long-max-tokens", type=int, default=8)
    parser.add_argument("--stream-max-tokens", type=int, default=1500)
    parser.add_argument("--chunks", default="512", help="prefill_chunk_tokens of each chunked mode, comma-separated")
    parser.add_argument("--gamma", type=int, default=4, help="num_speculative_tokens (adaptive)")
    parser.add_argument("--seconds", type=float, default=20.0, help="seconds per mode and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (0: torch's default); 1 by default: on a shared CPU, threads that "
                             "wait for each other at every op make small forwards 10-50x slower")
    parser.add_argument("--out", default="bench-results/prefill.json")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    target, draft, tokenizer = load(args.model, args.long)
    running, long_prompt = workload(tokenizer, args.streams, args.long)
    modes = [Mode("off (whole)", 0)] + [Mode(f"chunked {c}", c) for c in map(int, args.chunks.split(","))]
    engines = [SpeculativeEngine(target, draft, args.gamma, max_batch_size=args.streams + 4,
                                 prefill_chunk_tokens=m.chunk) for m in modes]
    for engine in engines:  # measured costs, a learnt α, and the long prompt's kernels warmed up
        engine.calibrate()
        engine.generate([running[0], long_prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    for r in range(args.rounds):
        for mode, engine in zip(modes, engines):
            run_round(engine, mode, running, long_prompt, args, f"r{r}")
            print(f"round {r + 1}/{args.rounds} {mode.label}: {mode.steps} steps", flush=True)
    print(report(modes, args))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": vars(args), "torch_threads": torch.get_num_threads(),
                               "modes": [m.summary() for m in modes],
                               "samples": [asdict(m) for m in modes]}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
