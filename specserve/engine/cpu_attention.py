"""Attention over a paged KV pool read where it lies, on a CPU: a small C kernel, built on first use.

A paged cache (engine/paged_cache.py) keeps each layer's keys in one pool `[N, bs, Hkv, D]`, a
request's positions scattered over its blocks. torch's CPU attention kernels take keys as one
strided tensor per batch, so the paged path gathered every row's blocks into a copy, every layer,
every forward: on this project's 2-core CPU that copy alone cost about as much as the attention
(SmolLM2-135M's shapes, batch 16, ~300 positions: the gathered path took 1.03-1.69x the time of
the dense cache's attention). `paged_attention.c` reads the pool through the block tables
instead, for forwards of up to a few query positions per row (decode, draft, verify):

- one task per (batch row, KV head), so that a single row's forward uses every thread; its keys
  a tile of at most 16 positions at a time (never across a block), every query head of the
  group over the tile while it is in cache, and the tile 16 positions on prefetched;
- online softmax (a running max and sum per query), so the pool is read once and nothing the
  size of K is written;
- a row visits its own positions only (a short row costs its own length).

It runs on torch's own OpenMP pool (the library binds to the libgomp torch loaded) with torch's
thread count. The vectorised path needs AVX-512 and a head size of 32, 64, 128 or 256; elsewhere
the kernel is not used (its plain C fallback exists for completeness and is slower than the
gather), nor where no C compiler is found, nor under SPECSERVE_CPU_KERNELS=0: the runner then
gathers as before.

The library is compiled once per machine (`-march=native`) into a cache folder
(SPECSERVE_CACHE_DIR, else ~/.cache/specserve) under a name that hashes the source, the flags and
the CPU's feature flags, written atomically so that several processes may build it at once.

How a forward reaches it (ModelRunner, `in_place="blocks"`): the cache's `update` returns the
pools themselves, and the attention mask is replaced by the rows' reads (`reads`), an int64
tensor `[B', 1, 1, 2Q + T]`: per row its Q query positions, the first position each of them sees
(0, or where a sliding window begins: key k is visible to a query iff first <= k <= its
position), then its T block ids. A row's tiles start at its queries' lowest first position, so a
windowed layer reads only its window. attention.grouped_sdpa sends such a forward here.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("paged_attention.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
VECTOR_DIMS = (32, 64, 128, 256)  # head sizes the vectorised path takes
BUILD_SECONDS = 120

log = logging.getLogger(__name__)
_library: ctypes.CDLL | None = None
_tried = False


def available(head_dim: int | None, dtype: torch.dtype) -> bool:
    """Whether a paged forward of this model should read its pool through the kernel (built now
    if it is not yet): float32, a head size the vectorised path takes, AVX-512, a compiler."""
    if os.environ.get("SPECSERVE_CPU_KERNELS", "1") == "0" or dtype != torch.float32 or head_dim not in VECTOR_DIMS:
        return False
    library = load()
    return library is not None and bool(library.paged_attention_vectorized())


def reads(positions: torch.Tensor, tables: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """positions [B', Q], tables [B', T] int64 -> the forward's reads [B', 1, 1, 2Q + T] (what it
    passes in place of a mask); window: a sliding-window layer's (attention.Windows)."""
    lows = torch.zeros_like(positions) if window is None else (positions - (window - 1)).clamp(min=0)  # [B', Q]
    return torch.cat([positions, lows, tables], dim=1)[:, None, None, :]


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor,
           scale: float | None = None) -> torch.Tensor:
    """query [B', Hq, Q, D], keys/values the pools [N, bs, Hkv, D], rows the reads [B', 1, 1, 2Q + T]
    -> attention output [B', Q, Hq, D] (what an HF attention function returns)."""
    batch, heads, width, dim = query.shape
    _, block_size, kv_heads, _ = keys.shape
    if query.dtype != torch.float32 or keys.dtype != torch.float32 or values.dtype != torch.float32:
        raise TypeError("the CPU paged attention kernel takes float32 only")
    if not (keys.is_contiguous() and values.is_contiguous() and values.shape == keys.shape):
        raise ValueError(f"keys and values must be pools [N, bs, Hkv, D] alike, got {tuple(keys.shape)}, "
                         f"{tuple(values.shape)}")
    rows = rows.reshape(batch, -1).contiguous()
    entries = rows.shape[1] - 2 * width
    library = load()
    if library is None:
        raise RuntimeError("the CPU paged attention kernel is not built (no C compiler?)")
    query = query.contiguous()
    out = torch.empty(batch, width, heads, dim, dtype=torch.float32)
    status = library.paged_attention_f32(
        query.data_ptr(), keys.data_ptr(), values.data_ptr(), rows.data_ptr(), out.data_ptr(),
        batch, heads, kv_heads, width, dim, block_size, entries, dim ** -0.5 if scale is None else scale,
        torch.get_num_threads())
    if status != 0:
        raise ValueError(f"the CPU paged attention kernel refused heads {heads} / {kv_heads}, width {width}")
    return out


def load() -> ctypes.CDLL | None:
    """The kernel's library, built on first use (None where it cannot be: logged once)."""
    global _library, _tried
    if not _tried:
        _tried = True
        try:
            _library = _open(_build())
        except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
            log.warning("CPU paged attention kernel unavailable (%s); paged forwards gather their keys", exc)
    return _library


def _build() -> Path:
    named = os.environ.get("CC")
    compiler = shutil.which(named) if named else shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError(f"no C compiler found ({'CC=' + named if named else 'cc, gcc'})")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(FLAGS).encode() + compiler.encode() + _cpu_flags()).hexdigest()[:16]
    folder = Path(os.environ.get("SPECSERVE_CACHE_DIR") or Path.home() / ".cache" / "specserve") / "kernels"
    target = folder / f"paged_attention-{key}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        built = Path(scratch) / target.name
        result = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"], capture_output=True,
                                text=True, timeout=BUILD_SECONDS)
        if result.returncode != 0:
            raise RuntimeError(f"{Path(compiler).name} failed: {result.stderr.strip()[:500]}")
        os.replace(built, target)  # atomic: a process building beside this one finds one or the other
    return target


def _open(path: Path) -> ctypes.CDLL:
    library = ctypes.CDLL(str(path))  # its libgomp is the one torch loaded already (same soname)
    library.paged_attention_vectorized.restype = ctypes.c_int
    library.paged_attention_f32.restype = ctypes.c_int
    library.paged_attention_f32.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 7 + [ctypes.c_float,
                                                                                           ctypes.c_int]
    return library


def _cpu_flags() -> bytes:
    """The CPU's feature flags (a `-march=native` build is this machine's)."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        return b""
