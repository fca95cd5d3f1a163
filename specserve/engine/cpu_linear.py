"""Linear layers over a few rows on a CPU: the fastest of equivalent GEMM calls, chosen by measuring.

A decode or verify forward multiplies each weight by 1 to γ+1 rows per request. On a CPU the weights
stream from memory once per forward at best, so such a forward should cost about the same at 1 row
as at 8. `F.linear` (x @ Wᵀ) does not: on this project's 2-core machine, SmolLM2-135M's output
head (49152 x 576) took 9.4 ms for one row, 21.8 ms for two and 31.8 ms for three, and a whole
2-token forward cost 1.6x a 1-token one, so verifying drafts cost nearly what decoding them one by
one would. The same product written as W @ xᵀ (the rows as the narrow right-hand matrix) streams
the weight once: 5.4 ms for two rows, 7.1 ms for four.

Which call is fastest depends on the shape, the row count and the machine, so each model's linear
shapes are timed once, on the model's own weights (every layer's, in order, so they stream from
memory as in a forward), for each row count of ROW_BUCKETS and each kernel in KERNELS; the fastest
is kept per (shape, bucket) unless it beats `F.linear` by less than 3%, and a row count between
buckets takes the next bucket's choice (a batch of verifies: 8 rows of γ+1 tokens). `ModelRunner`
turns the choice on for its own forwards only (`selected`); any other caller of the model gets
`F.linear`. Weights smaller than MIN_WEIGHT elements keep `F.linear` (nothing to win, and timing
noise would pick at random).
Every kernel computes the same products; only the order of additions inside a dot product may
differ, as it already does between F.linear calls over different row counts.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch
import torch.nn.functional as F

ROW_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64)
MAX_ROWS = ROW_BUCKETS[-1]
MIN_WEIGHT = 1 << 16
_MARGIN = 0.97
_ACTIVE = [0]  # > 0 while a runner's forward is inside `selected`
_PLANS: dict[tuple, dict[tuple[int, int], tuple[str, ...]]] = {}  # per process: timings are not repeated


def _linear(x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x2, weight)


def _mm(x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """W [O, I] @ x2ᵀ [I, M] -> [M, O], row-major (a transposed result would send the next layer's
    product down a slow path)."""
    return torch.mm(weight, x2.t()).t().contiguous()


def _mm_pad(x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`_mm` over a padded row count (up to even at 8 rows or fewer, else up to a multiple of 8:
    the last row repeated), the extra rows dropped."""
    rows = x2.shape[0]
    padded = rows + rows % 2 if rows <= 8 else -(-rows // 8) * 8
    if padded == rows:
        return _mm(x2, weight)
    return _mm(torch.cat([x2, x2[-1:].expand(padded - rows, -1)]), weight)[:rows]


KERNELS = {"linear": _linear, "mm": _mm, "mm_pad": _mm_pad}
_BUCKET_OF = [next(i for i, b in enumerate(ROW_BUCKETS) if b >= n) for n in range(MAX_ROWS + 1)]  # rows -> bucket


class _Dispatch:
    """A Linear's forward: the chosen kernel for this row count inside `selected`, else F.linear."""

    def __init__(self, module: torch.nn.Linear, choices: tuple[str, ...]) -> None:
        self.module = module
        self.choices = choices  # kernel name per row bucket (ROW_BUCKETS)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.module.weight, self.module.bias
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if not _ACTIVE[0] or not 0 < rows <= MAX_ROWS:
            return F.linear(x, weight, bias)
        kernel = self.choices[_BUCKET_OF[rows]]
        if kernel == "linear":
            return F.linear(x, weight, bias)
        out = KERNELS[kernel](x.reshape(rows, x.shape[-1]), weight)  # [rows, O]
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], weight.shape[0])


def _eligible(model: torch.nn.Module) -> list[torch.nn.Linear]:
    return [m for m in model.modules()
            if isinstance(m, torch.nn.Linear) and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32
            and m.weight.is_contiguous() and m.weight.numel() >= MIN_WEIGHT]


def _time(kernel, weights: list[torch.Tensor], x2: torch.Tensor) -> float:
    began = time.perf_counter()
    for w in weights:
        kernel(x2, w)
    return time.perf_counter() - began


@torch.no_grad()
def plan(model: torch.nn.Module, reps: int = 2) -> dict[tuple[int, int], tuple[str, ...]]:
    """{(out, in): kernel name per row bucket}, timed on `model`'s own weights (once per process
    for the same shapes and thread count)."""
    groups: dict[tuple[int, int], list[torch.Tensor]] = {}
    for m in _eligible(model):
        groups.setdefault(tuple(m.weight.shape), []).append(m.weight)
    key = (tuple(sorted((s, len(ws)) for s, ws in groups.items())), torch.get_num_threads())
    if key in _PLANS:
        return _PLANS[key]
    chosen = {}
    for shape, weights in groups.items():
        names = []
        for rows in ROW_BUCKETS:
            x2 = torch.randn(rows, shape[1])
            best = {name: min(_time(k, weights, x2) for _ in range(reps)) for name, k in KERNELS.items()}
            fastest = min(best, key=best.get)
            names.append(fastest if best[fastest] < _MARGIN * best["linear"] else "linear")
        chosen[shape] = tuple(names)
    _PLANS[key] = chosen
    return chosen


def install(model: torch.nn.Module, choices: dict[tuple[int, int], tuple[str, ...]] | None = None) -> dict:
    """Route `model`'s eligible linears through `_Dispatch` with `choices` (default: `plan(model)`),
    once (a model shared by two runners, e.g. a layer-skip view, keeps the first plan)."""
    choices = plan(model) if choices is None else choices
    for m in _eligible(model):
        if not isinstance(m.__dict__.get("forward"), _Dispatch) and tuple(m.weight.shape) in choices:
            m.forward = _Dispatch(m, choices[tuple(m.weight.shape)])
    return choices


def installed(model: torch.nn.Module) -> bool:
    """Whether some linear of `model` is routed through `_Dispatch` (by an eager CPU runner)."""
    return any(isinstance(m.__dict__.get("forward"), _Dispatch) for m in model.modules())


@contextmanager
def selected(enabled: bool):
    """Within the block, installed linears use their chosen kernels."""
    if not enabled:
        yield
        return
    _ACTIVE[0] += 1
    try:
        yield
    finally:
        _ACTIVE[0] -= 1
