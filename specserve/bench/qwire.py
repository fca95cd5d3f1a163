"""What a step's q costs to cross from the draft worker to the target: float32, 16 bits, sparse.

    python -m specserve.bench.qwire [--batches 8,32] [--gammas 3] [--top-k 0,50] [--vocab 32000] [--device cpu]
        [--repeats 30] [--out bench-results/qwire.json]

On the compiled graph the draft side sends the target the q of the rows that sample
(`wire.RowsProbs`), in its target's dtype where that is 16-bit (`sampling.q_to_send`), and only
its nonzero entries where every such row filters with top-k or top-p (`wire.SparseQ`). Per
(batch, γ, top-k, dtype), every row sampling and verifying every position: the bytes of the
message, the draft side's milliseconds (cut q, copy it off the device, pack the reply) and the
target side's (unpack, put q on the device, rebuild the whole [B, G, V] and read it as the rule
does: `q_as_read`). The channel's own copy of the bytes comes on top, in proportion to them.
Dtypes alternate within each repeat; medians. Prints a table, writes JSON.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from specserve.bench import sync, write_json
from specserve.engine import Proposal, SamplingParams
from specserve.engine.sampling import BatchSampling, logits_to_probs, q_as_read, q_to_send
from specserve.serve.wire import Reply, RowsProbs, pack, unpack

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def crossing(probs: torch.Tensor, tokens: torch.Tensor, sampling: BatchSampling, counts: torch.Tensor,
             device: torch.device) -> tuple[int, float, float]:
    """q [B, G, V] as the draft worker holds it -> (bytes, draft ms, target ms) of one crossing."""
    sync(device)
    began = time.perf_counter()
    cut = RowsProbs.of(probs, sampling, counts)
    packed = pack(Reply(Proposal(tokens, cut, []), 0.0))
    sent = time.perf_counter()
    q = unpack(packed).result.probs
    q = q.resolve(tokens, device) if isinstance(q, RowsProbs) else q.to(device)
    q_as_read(q)
    sync(device)
    return len(packed), 1e3 * (sent - began), 1e3 * (time.perf_counter() - sent)


def measure(batch: int, gamma: int, top_k: int, args: argparse.Namespace) -> list[dict]:
    """Every row sampling at temperature 1, with top-k `top_k` (0: off, q dense)."""
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(batch * 100 + gamma)
    params = SamplingParams(temperature=1.0, top_k=top_k)
    sampling = BatchSampling.from_params([params] * batch)
    logits = 4.0 * torch.randn(batch * gamma, args.vocab, generator=gen)  # [B * G, V]
    exact = logits_to_probs(logits, sampling.repeat_rows(gamma)).view(batch, gamma, -1).to(device)  # [B, G, V]
    qs = {name: q_to_send(exact, dtype).to(dtype) for name, dtype in DTYPES.items()}  # as `propose` returns it
    tokens = torch.randint(0, args.vocab, (batch, gamma), generator=gen)
    counts = torch.full((batch,), gamma)
    seen: dict[str, list] = {name: [] for name in DTYPES}
    for _ in range(args.warmup + args.repeats):
        for name, q in qs.items():
            seen[name].append(crossing(q, tokens, sampling, counts, device))
    rows = []
    for name, runs in seen.items():
        runs = runs[args.warmup:]
        rows.append(dict(batch=batch, gamma=gamma, vocab=args.vocab, top_k=top_k, dtype=name, bytes=runs[0][0],
                         draft_ms=statistics.median(r[1] for r in runs),
                         target_ms=statistics.median(r[2] for r in runs)))
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| batch | γ | top-k | q dtype | MB a step | draft side ms | target side ms | both, × dense float32 |",
             "|---|---|---|---|---|---|---|---|"]
    base = {(r["batch"], r["gamma"]): r["draft_ms"] + r["target_ms"] for r in rows
            if r["dtype"] == "float32" and not r["top_k"]}
    for r in rows:
        both = r["draft_ms"] + r["target_ms"]
        ratio = f"{both / base[r['batch'], r['gamma']]:.2f}" if (r["batch"], r["gamma"]) in base else "-"
        lines.append(f"| {r['batch']} | {r['gamma']} | {r['top_k'] or 'off'} | {r['dtype']} | {r['bytes'] / 1e6:.3f} "
                     f"| {r['draft_ms']:.2f} | {r['target_ms']:.2f} | {ratio} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="specserve bench qwire", description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="8,32")
    p.add_argument("--gammas", default="3")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--top-k", default="0,50", help="every row's top-k (0: off, q dense; else only its entries cross)")
    p.add_argument("--device", default="cpu", help="where q lives on both sides (cuda: the copies on and off it count)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=1, help="torch threads (a worker's codec work is one thread)")
    p.add_argument("--out", type=Path, default=Path("bench-results/qwire.json"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [r for g in args.gammas.split(",") for b in args.batches.split(",") for k in args.top_k.split(",")
            for r in measure(int(b), int(g), int(k), args)]
    print(table(rows))
    write_json(args.out, args, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
