"""How often a seeded draw changes when the logits move by float rounding, and what a sturdier draw costs.

    python -m specserve.bench.draws [--source smollm2|random] [--noise 2e-7] [--device cpu]
        [--out bench-results/draws.json]

A seeded request draws the same numbers whatever its batch, but its probabilities come from
forwards whose shapes the batch sets, which can move a logit in its last bits (docs/engine.md,
"Seeds and batch shapes"). Per position of a prompt (SmolLM2 at --temperature over a random
prompt; or random logits over --vocab), every logit is moved by relative noise --noise, and the
same uniforms are drawn from both versions:

- inverse CDF, as the engine draws (`sampling.sample_with_uniforms`, float32), and with a float64
  cumulative sum;
- Gumbel-max (the token maximising p / E, one E ~ Exp(1) per token, the same E for both).

Then the cost of a draw at --batches rows: the engine's, and Gumbel-max keyed on the device by a
counter-based hash of the draw's number (what a seeded Gumbel draw would need: no per-token
numbers from the request's generator). Prints both tables, writes JSON.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from specserve.bench import sync, write_json
from specserve.engine.sampling import sample_with_uniforms

GOLDEN, MIX1, MIX2 = -7046029254386353131, -4658895280553007687, -7723592293110705685  # splitmix64's, as int64


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _srl(z, 30)) * MIX1
    z = (z ^ _srl(z, 27)) * MIX2
    return z ^ _srl(z, 31)


def keyed_gumbel(probs: torch.Tensor, uniforms: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """probs [N, V], uniforms [N] float64 (53 bits each), offsets [V] (token k: (k + 1) * GOLDEN)
    -> ids [N]: argmax of p / E, E ~ Exp(1) per token from the hash of the draw's number."""
    key = _mix((uniforms * 2.0 ** 53).long())  # [N]
    bits = _mix(key[:, None] + offsets[None, :])  # [N, V]
    exp = -torch.log((_srl(bits, 40).float() + 0.5) * 2.0 ** -24)  # [N, V]
    return (probs / exp).argmax(-1)


def logits_of(args: argparse.Namespace, gen: torch.Generator) -> torch.Tensor:
    """-> [P, V] float32 logits at --temperature."""
    if args.source == "random":
        return 3.0 * torch.randn(args.positions, args.vocab, generator=gen) / args.temperature
    from specserve.models.smollm2 import load_smollm2_target

    model, _ = load_smollm2_target()
    ids = torch.randint(0, 5000, (1, args.positions), generator=gen)
    with torch.no_grad():
        return model(ids).logits[0].float() / args.temperature


def flips(logits: torch.Tensor, args: argparse.Namespace, gen: torch.Generator) -> list[dict]:
    moved = logits * (1 + args.noise * torch.randn(logits.shape, generator=gen))
    p, q = torch.softmax(logits, -1), torch.softmax(moved, -1)  # [P, V]
    u = torch.rand(logits.shape[0], args.uniforms, generator=gen)  # [P, U]

    def inverse(probs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        cdf = probs.to(dtype).cumsum(-1)
        return torch.searchsorted(cdf, u.to(dtype) * cdf[:, -1:], right=True)

    gumbel = 0  # (one noise value per token: fewer draws than the uniforms')
    for i in range(logits.shape[0]):
        for start in range(0, args.gumbel_draws, 200):
            exp = torch.empty(min(200, args.gumbel_draws - start), p.shape[-1]).exponential_(generator=gen)
            gumbel += int(((p[i] / exp).argmax(-1) != (q[i] / exp).argmax(-1)).sum())
    draws = logits.shape[0] * args.gumbel_draws
    rows = [dict(draw=name, flips=float((inverse(p, dtype) != inverse(q, dtype)).float().mean()))
            for name, dtype in (("inverse CDF, float32 (the engine's)", torch.float32),
                                ("inverse CDF, float64 cumulative sum", torch.float64))]
    return rows + [dict(draw="Gumbel-max, the same noise", flips=gumbel / draws)]


def costs(vocab: int, args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    offsets = torch.arange(1, vocab + 1, dtype=torch.long, device=device) * GOLDEN
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        probs = torch.softmax(torch.randn(batch, vocab, device=device), -1)
        u = torch.rand(batch, dtype=torch.float64, device=device)
        times = {}
        for name, draw in (("engine", lambda: sample_with_uniforms(probs, u.float())),
                           ("keyed Gumbel", lambda: keyed_gumbel(probs, u, offsets))):
            for _ in range(3):
                draw()
            sync(device)
            began = time.perf_counter()
            for _ in range(args.repeats):
                draw()
            sync(device)
            times[name] = 1e3 * (time.perf_counter() - began) / args.repeats
        rows.append(dict(batch=batch, vocab=vocab, engine_ms=times["engine"], gumbel_ms=times["keyed Gumbel"]))
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="specserve bench draws", description=__doc__.splitlines()[0])
    p.add_argument("--source", default="smollm2", choices=("smollm2", "random"))
    p.add_argument("--vocab", type=int, default=49152, help="random logits' vocabulary")
    p.add_argument("--positions", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--noise", type=float, default=2e-7, help="relative noise on each logit (float32 rounding: ~6e-8)")
    p.add_argument("--uniforms", type=int, default=20000, help="inverse-CDF draws per position")
    p.add_argument("--gumbel-draws", type=int, default=2000, help="Gumbel-max draws per position")
    p.add_argument("--batches", default="1,16", help="rows per draw, for the costs")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--device", default="cpu", help="where the costs are measured")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("bench-results/draws.json"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    logits = logits_of(args, gen)
    flipped = flips(logits, args, gen)
    print(f"Flips per draw, logits moved by relative noise {args.noise} ({args.source}, T={args.temperature}, "
          f"{logits.shape[0]} positions x {args.uniforms} draws, Gumbel-max {args.gumbel_draws})")
    print("| draw | flips per draw |\n|---|---|")
    for r in flipped:
        print(f"| {r['draw']} | {100 * r['flips']:.4f}% |")
    timed = costs(logits.shape[-1], args)
    print(f"\nA draw's cost on {args.device} (V={logits.shape[-1]})\n| rows | engine ms | keyed Gumbel ms | ratio |\n"
          "|---|---|---|---|")
    for r in timed:
        print(f"| {r['batch']} | {r['engine_ms']:.3f} | {r['gumbel_ms']:.3f} | {r['gumbel_ms'] / r['engine_ms']:.1f} |")
    write_json(args.out, args, flips=flipped, costs=timed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
