"""Runs one HF causal LM over a batch of requests, each with its own KV cache slot.

The runner knows requests only by id: it maps ids to cache slots, and for every id remembers how
many leading positions of its slot hold valid keys. A call names, per row, where its new tokens
start; a start below the valid length rolls the row back, a start above it is a cache miss (the
caller must resend from `valid_length`), which is how a restarted worker rebuilds its caches from
the tokens the coordinator holds.

A forward is two halves (docs/architecture.md §7):

- `stage` (host): slots, the row order, the shape bucket, and ONE host-to-device copy of a small
  int64 block [B', Q + 6] into a static buffer allocated once per (B', Q): token ids, start,
  write slot, read slot, last real token, and the two row permutations. A paged cache's block
  tables are not in it: they live on the device, and only the entries that changed travel
  (engine/paged_cache.py, `upload`), a second small copy on the steps that change any.
- `_compute` (device only): positions, the mask, the model, the logits. It reads nothing back to
  the host, so it can run eagerly, under `torch.compile(fullgraph=True, dynamic=False)`, or be
  captured as a CUDA graph and replayed (`execution`).

Rows are run in slot order (sorted on the host, un-permuted on the device): live slots are dense,
so a forward over every live request reads its keys as a view of the first B' slots instead of
gathering the batch's keys in every layer. The batch is padded up to a bucket of BATCH_BUCKETS;
padded rows write to the cache's scratch slot, which no request owns.
"""
from __future__ import annotations

import inspect
import os
import time
from collections.abc import Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from . import attention, cpu_attention, cpu_linear
from .attention import check_pageable, check_supported, dispatches, windows_of
from .fusion import BlockFusion, repeated_blocks
from .hybrid_cache import HybridPagedKVCache, window_pool_blocks
from .kv_cache import CAPACITY_STEP, SlotKVCache, capacity_for
from .paged_cache import SCRATCH, PagedKVCache, blocks_for
from .sharding import head_dim, kv_cache_bytes_per_token, kv_shape, kv_sizes

# Batch sizes a forward is padded up to: every power of two up to 8 (small batches are weight-bound
# on a GPU, so a padded row costs next to nothing, and few shapes keep few graphs), then steps of 8
# (at most 7 wasted rows; tensor-core tiles are multiples of 8), as vLLM's CUDA-graph capture sizes.
BATCH_BUCKETS = (1, 2, 4, *range(8, 257, 8))
EXECUTION_MODES = ("auto", "eager", "compile", "graph", "fused-graph")
ATTENTION_MODES = ("auto", "mask", "flex")
# a forward's fixed cost beyond reading its weights (host work, launches), as a share of their bytes:
# what splitting a paged batch into two forwards must save on top of the second weight pass
SPLIT_OVERHEAD = 0.25
# an eager forward's key length K: the longest row rounded up to this (the dense cache's 256-token
# growth step, which shapes for compiled or captured forwards keep, made a batch of 300-token rows
# attend over 512 positions)
EAGER_KEY_STEP = 16
# execution="compile": the most shapes (B', Q, K) one process's compiled forwards may take
COMPILED_SHAPES = 256
# Forwards up to this wide read a paged pool in place under attention="flex" (attention.pool_block_mask);
# wider ones (prompt chunks) gather their rows' keys: FlexAttention's kernel for long queries tiles
# keys in 64-128 at a time, more than a block may hold, where its decode kernel tiles by the block.
IN_PLACE_WIDTH = 16
_COLUMNS = 6  # after the Q token ids: start, write slot, read slot, last, caller->sorted, sorted->caller
# Positions a later row of a request may start before an earlier row's start: a rollback (drafts
# rejected, a pipelined block drafted ahead and dropped: at most 2γ + 2, γ <= 16 in a served
# config). A paged cache of a model whose every layer is windowed gives back the blocks that
# far and a window behind each row (`_forget_behind`).
FORGET_SLACK = 64


def allocation(num_requests: int, longest: int) -> int:
    """Token positions a runner's dense cache may allocate for `num_requests` live requests, the
    longest needing `longest` positions: a slot per row of the batch padded to its bucket, the
    scratch slot, each of one capacity (what admission budgets; eager runs pad less)."""
    return (batch_bucket(num_requests) + 1) * capacity_for(longest) if num_requests else 0


def batch_bucket(rows: int) -> int:
    for size in BATCH_BUCKETS:
        if size >= rows:
            return size
    return -(-rows // 8) * 8


class ForwardTiming(NamedTuple):
    """One model forward, for the cost model: tokens it processed, seconds, and whether it was a
    prefill (a backlog of known tokens, timed but kept out of the per-step cost fit)."""

    tokens: int
    seconds: float
    prefill: bool = False


class ForwardLog(Sequence):
    """ForwardTimings of a run of forwards. On CUDA each forward is bracketed by device events,
    read only when the log is first looked at (after the step's one result copy, so reading them
    waits for nothing); on a CPU the seconds are known at once. Pickles as a plain tuple."""

    def __init__(self, pending: list[tuple]) -> None:
        self._pending = pending  # (tokens, prefill, began, ended, parts): floats or CUDA events
        self._timings: tuple[ForwardTiming, ...] | None = None

    def _resolved(self) -> tuple[ForwardTiming, ...]:
        if self._timings is None:
            self._timings = tuple(ForwardTiming(n, _elapsed(b, e) / k, p) for n, p, b, e, k in self._pending)
        return self._timings

    def __getitem__(self, i):
        return self._resolved()[i]

    def __len__(self) -> int:
        return len(self._pending)

    def __reduce__(self):
        return (tuple, (self._resolved(),))

    def __repr__(self) -> str:
        return f"ForwardLog({list(self._resolved())!r})"


def _elapsed(began, ended) -> float:
    if isinstance(began, float):
        return ended - began
    ended.synchronize()
    return began.elapsed_time(ended) / 1000.0


@dataclass(frozen=True)
class RowInput:
    """One request's row in a call: its new tokens, written from position `start` on."""

    request_id: str
    start: int
    tokens: list[int]


# The most unseen tokens a row feeds to the forward that drafts (a draft model's first forward of
# a propose: its last token, and the one before it after a step that accepted every draft) or that
# verifies (the target: its last token, then the drafts). A row holding more tokens catches up
# first, all but its last token in a forward of their own that computes no logits.
DRAFT_ROW_TOKENS = 2
VERIFY_ROW_TOKENS = 1


def cache_kwarg(model: torch.nn.Module) -> str:
    """The keyword a causal LM's forward takes its KV cache by: `cache` (transformers >= 5.24,
    where `past_key_values` is deprecated) or `past_key_values` (older versions, our own heads, a
    wrapper passing **kwargs on). A transformers model whose forward takes neither keeps a state
    of its own (RWKV and other recurrent models): a cache handed to it would be ignored and its
    outputs wrong, so it is refused."""
    from transformers import PreTrainedModel

    taken = inspect.signature(model.forward).parameters
    if "cache" in taken:
        return "cache"
    if "past_key_values" not in taken and isinstance(model, PreTrainedModel):
        raise ValueError(f"{type(model).__name__} takes no KV cache (it keeps a state of its own, or cannot "
                         "decode incrementally): only attention models with a KV cache are supported")
    return "past_key_values"


def returned_cache(outputs):
    """The KV cache a causal LM's forward returned (`cache`, or `past_key_values` before 5.24)."""
    cache = getattr(outputs, "cache", None)
    return cache if cache is not None else outputs.past_key_values


def catch_up(tokens: list[int], row_tokens: int) -> int:
    """How many of a row's unseen tokens a catch-up forward takes first (0: none)."""
    return len(tokens) - 1 if len(tokens) > row_tokens else 0


class CacheMiss(RuntimeError):
    """The runner holds fewer valid positions for a request than a call assumed."""

    def __init__(self, request_id: str, valid_length: int, start: int) -> None:
        super().__init__(f"request {request_id!r}: cache holds {valid_length} tokens, call starts at {start}")
        self.request_id = request_id
        self.valid_length = valid_length
        self.start = start

    def __reduce__(self):  # survives pickling across processes (Ray)
        return (CacheMiss, (self.request_id, self.valid_length, self.start))


@dataclass
class Staged:
    """One forward's layout, decided on the host, and its inputs on the device.

    Sorted row i is caller row order[i]; rows B..B'-1 are padding (scratch slot)."""

    request_ids: list[str]  # caller order
    ends: list[int]  # caller order: each row's valid length once this forward has run
    order: list[int]  # sorted row -> caller row
    padded: int  # B'
    width: int  # Q
    key_length: int  # K
    gather: bool  # rows are not slots 0..B-1: gather their keys
    tokens: int  # real tokens in the forward
    block: torch.Tensor  # [B', Q + 6] int64 on the device: a static buffer

    @property
    def rows(self) -> int:
        return len(self.request_ids)

    @property
    def real(self) -> torch.Tensor:  # [B'] bool on the device: the real rows (padding rows last)
        return torch.arange(self.padded, device=self.block.device) < self.rows

    @property
    def ids(self) -> torch.Tensor:  # [B', Q]
        return self.block[:, : self.width]

    @property
    def sorted_to_caller(self) -> torch.Tensor:  # [B']
        return self.block[:, self.width + 5]

    @property
    def caller_to_sorted(self) -> torch.Tensor:  # [B']
        return self.block[:, self.width + 4]

    @property
    def static_key(self) -> tuple[int, int, int]:
        return self.padded, self.width, self.key_length


# Graph mode: a dense cache sized up front for the whole batch at max_model_len takes at most this
# share of the device's free memory (`ModelRunner.preallocate`); above it, the cache grows instead.
PREALLOCATE_SHARE = 0.5


def free_memory_bytes(device: torch.device) -> int:
    """Memory free on the device now (a CPU's: what the OS reports available)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available


CALIBRATION_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64)
CALIBRATION_CONTEXT = 16  # tokens before each calibration forward


class ModelRunner:
    compile_backend = "inductor"  # execution="compile": torch.compile's backend

    def __init__(
        self,
        model: torch.nn.Module,
        max_model_len: int | None = None,
        execution: str = "auto",
        attention: str = "auto",
    ) -> None:
        """execution: "eager"; "compile" (torch.compile fullgraph of the fixed-shape forward);
        "graph" (CUDA graphs, one per shape bucket, replayed); "fused-graph" (graph, the model's
        repeated blocks compiled first: engine/fusion.py); "auto" = graph on a single CUDA
        device, eager otherwise.
        attention: "mask" (the model's own attention, or grouped SDPA for a GQA model, under a
        [B', 1, Q, K] mask); "flex" (FlexAttention under the rows' positions, no mask:
        engine/attention.py); "auto" = mask (flex is not yet measured on a GPU)."""
        self.model = model.eval()
        attn = getattr(model.config, "_attn_implementation", None) or "eager"
        if attn not in ("sdpa", "eager"):
            raise ValueError(f"attention implementation {attn!r} cannot take a per-row mask; load with sdpa or eager")
        check_supported(model.config)  # (model types the runner cannot serve as they compute themselves)
        self.cache_arg = cache_kwarg(model)
        self._float_mask = attn == "eager"
        self.device = model.get_input_embeddings().weight.device
        self.dtype = model.get_input_embeddings().weight.dtype
        self.execution = _resolve_execution(execution, model, self.device)
        self.fusion: BlockFusion | None = None  # the model's blocks compiled (`fuse`)
        self.in_place: str | None = None  # how a paged cache's pool is read where it lies (`page`)
        self.attention = _resolve_attention(attention, model)
        # batches padded up to BATCH_BUCKETS (fixed shapes to compile or capture); not in eager
        # mode, where a padded row costs a real row's compute on a CPU
        self.pad_batches = self.execution != "eager"
        # (only where the model's layers call the attention interface: `attention.dispatches`)
        self.grouped_attention = grouped_attention_on(self.device) and dispatches(model)
        # linears over a few rows through the fastest measured GEMM call (engine/cpu_linear.py)
        self.linear_kernels = cpu_kernels_on(self.device) and self.execution == "eager"
        if self.linear_kernels:
            cpu_linear.install(model)
        # what the tapped modules output in the last forward (`tap`): [B', Q, F], sorted row order
        self.last_features: torch.Tensor | None = None
        self._taps: list[torch.Tensor | None] = []  # per tapped module, its output in the forward running
        self._tapped_modules: list[int] = []  # ids of the tapped modules
        # who reads them, per request and position (`tap`); with prefix caching, prefills also keep
        # them beside their keys, so that a request taking a cached prefix gets its features
        self._feature_sinks: list[Callable[[str, int, torch.Tensor], None]] = []
        self.tapped: str | None = None  # what taps this runner's forwards (None: nothing)
        self.cached_tokens: dict[str, int] = {}  # request -> prompt tokens its prefills took from shared blocks
        self._bytes: int | None = None  # the weights' bytes (`_weight_bytes`)
        limit = getattr(model.config, "max_position_embeddings", None)
        self.max_model_len = min(p for p in (max_model_len, limit) if p) if (max_model_len or limit) else None
        self.stated_max_model_len = max_model_len  # what the caller asked for (None: the model's limit only)
        # sliding-window layers: the forward's masks hide keys past their window (attention.Windows)
        self.windows = windows_of(model.config, self.max_model_len)
        self.forget_slack = FORGET_SLACK  # (paged, every layer windowed: `_forget_behind`)
        self.read_windows = True  # (paged, gathered: windowed layers read only their windows, `_window_reads`)
        self.window_pool = True  # (paged, windowed and full layers: a pool per kind, `page`)
        self.cache = SlotKVCache(self.max_model_len, self._key_step())
        self.token_map: torch.Tensor | None = getattr(model, "draft_token_map", None)  # [K] target ids, or None
        self._slot_of: dict[str, int] = {}
        self._valid: dict[str, int] = {}
        self._slot_owner: list[str] = []  # slot -> request id, dense
        self._forked_at: dict[str, tuple[str, int]] = {}  # fork -> (its request, positions copied from it)
        self._blocks: dict[tuple[int, int], torch.Tensor] = {}  # (B', Q) -> static input block
        # (B', Q, logits) -> where captured forwards of that shape leave their outputs (`_into_shared`)
        self._outputs: dict[tuple[int, int, str], tuple[torch.Tensor | None, ...]] = {}
        self._pending: list[tuple] = []  # every forward since the log was last taken
        self._compiled: Callable | None = None
        self.graphs = GraphSet(self.device) if self.execution == "graph" else None
        # graph mode: replay single forwards as graphs (off for a model fed through side channels
        # a replay would not see, e.g. a feature head's features: its caller captures whole loops)
        self.capture_forwards = True
        if execution == "fused-graph":
            self.fuse()

    def fuse(self, backend: str = "inductor") -> None:
        """From now on this runner's forwards run the model's repeated blocks compiled
        (engine/fusion.py; `execution="fused-graph"`; CPU tests call it on eager runners). A
        model without repeated blocks (a feature head's one layer) runs as it is. Not with
        execution="compile", which compiles the whole forward already."""
        if self.execution == "compile":
            raise ValueError("execution='compile' compiles the whole forward; fusing its blocks adds nothing")
        if cpu_linear.installed(self.model):  # each linear's own dispatcher: a compile per layer
            raise ValueError("this model's linears run through CPU kernels (engine/cpu_linear.py): "
                             "fuse a model no eager CPU runner has set up (or set SPECSERVE_CPU_KERNELS=0)")
        blocks = repeated_blocks(self.model)
        self.fusion = None if blocks is None else BlockFusion(blocks, backend)
        self._stack_cache()
        self.linear_kernels = False
        if self.in_place == "blocks":  # compiled blocks would break their graphs at the kernel's call
            self.in_place = None

    def _stack_cache(self) -> None:
        """Fused blocks over a dense cache on one device: every layer's storage stacked, so that
        the blocks compile their cache writes in (engine/kv_cache.py, `stack_layers`)."""
        if self.fusion is None or self.paged or len({p.device for p in self.model.parameters()}) != 1:
            return
        try:
            layers, heads, size = kv_shape(self.model.config)
            same = len(set(kv_sizes(self.model.config))) == 1  # (one storage shape for keys and values)
        except AttributeError:  # a config that does not say its attention's shape
            return
        if size and same:
            self.cache.stack_layers(layers, heads, size, self.dtype, self.device)

    def page(self, block_size: int, num_blocks: int | None = None, prefix_caching: bool = False,
             rows: int | None = None, widest: int | None = None) -> None:
        """Keep keys and values by block (engine/paged_cache.py) from now on: blocks of
        `block_size` positions from one pool of `num_blocks` (None: a pool that grows), sharing
        computed prompt prefixes when prefix_caching (a tapped runner's features shared with them).
        A model with both windowed and full layers keeps its windowed layers' keys in a pool of
        their own (engine/hybrid_cache.py), sized for `rows` requests at once each at a forward
        of up to `widest` positions (a prefill chunk; None: as large as the full pool).
        Before the first request only."""
        if self._slot_of:
            raise RuntimeError("the cache layout changes only while no request is cached")
        check_pageable(self.model.config)
        window = self.windows.window
        if self.window_pool and window is not None and self.windows.horizon is None:
            sized = None if rows is None or widest is None else \
                window_pool_blocks(rows, self._kept_behind(window, block_size), widest, block_size)
            self.cache = HybridPagedKVCache(self.windows.windowed, block_size, self.max_model_len, num_blocks,
                                            prefix_caching, self._key_step(), sized)
        else:
            self.cache = PagedKVCache(block_size, self.max_model_len, num_blocks, prefix_caching, self._key_step())
            self.cache.windowed_layer = self.windows.windowed
        self.in_place = self._in_place_layout()

    @property
    def hybrid(self) -> bool:
        """Paged, with a pool for the windowed layers and one for the full ones (`page`)."""
        return getattr(self.cache, "hybrid", False)

    def _in_place_layout(self) -> str | None:
        """How a paged forward up to IN_PLACE_WIDTH wide reads the pool where it lies: "flat" under
        FlexAttention (attention.pool_block_mask), "blocks" through the CPU kernel where it serves
        this model (engine/cpu_attention.py: eager float32 forwards under grouped SDPA); None:
        its rows' blocks are gathered."""
        if self.attention == "flex":
            return "flat"
        config = self.model.config
        kernel = (self.grouped_attention and self.device.type == "cpu" and self.execution == "eager"
                  and self.fusion is None and getattr(config, "_attn_implementation", None) == "sdpa")
        key_size, value_size = kv_sizes(config)  # (the kernel reads keys and values of one size)
        fits = key_size == value_size and cpu_attention.available(key_size, self.dtype)
        return "blocks" if kernel and fits else None

    def _key_step(self) -> int:
        """What a forward's key length K is rounded up to: the cache's growth step where forwards
        are compiled or captured (few shapes), EAGER_KEY_STEP where they run eagerly."""
        return EAGER_KEY_STEP if self.execution == "eager" else CAPACITY_STEP

    @property
    def paged(self) -> bool:
        return getattr(self.cache, "paged", False)

    # -- bookkeeping ------------------------------------------------------------------------
    def valid_length(self, request_id: str) -> int:
        return self._valid.get(request_id, 0)

    def num_cached(self) -> int:
        return len(self._slot_of)

    def free(self, request_id: str) -> None:
        """Forget a request; the last live slot moves into its place so that live slots stay dense."""
        slot = self._slot_of.pop(request_id, None)
        freed_length = self._valid.pop(request_id, 0)
        self.cached_tokens.pop(request_id, None)
        self._forked_at.pop(request_id, None)
        if slot is None:
            return
        if self.paged:
            self.cache.release(slot)
        last = len(self._slot_owner) - 1
        if slot != last:
            moved = self._slot_owner[last]
            self.cache.move_slot(last, slot)
            self._slot_of[moved] = slot
            self._slot_owner[slot] = moved
        self._slot_owner.pop()
        self._maybe_shrink(freed_length)

    def fork(self, request_id: str, branch_id: str, length: int) -> None:
        """A new cache `branch_id` holding a copy of request_id's first `length` positions (a
        pipelined step's branch drafts past a guessed rejection point from there; `adopt` keeps it
        if the verdict matches, `free` drops it)."""
        if length > self.valid_length(request_id):
            raise CacheMiss(request_id, self.valid_length(request_id), length)
        self.free(branch_id)
        dst = self._slot(branch_id)
        if length:
            self.cache.copy_positions(self._slot_of[request_id], dst, 0, length)
        self._valid[branch_id] = length
        self._forked_at[branch_id] = (request_id, length)

    def adopt(self, branch_id: str, request_id: str) -> None:
        """request_id goes on from its fork branch_id (whose guess the verdict confirmed): the
        positions the fork wrote past its fork point are copied into the request's slot (the
        request's own slot holds the same prefix), and the fork is freed. Freeing forks newest
        first keeps them the last live slots, so no slot moves."""
        owner, at = self._forked_at.get(branch_id, (None, 0))
        if owner != request_id or branch_id not in self._slot_of:
            raise KeyError(f"no branch {branch_id!r} of {request_id!r} to adopt")
        end = self._valid[branch_id]
        self.cache.copy_positions(self._slot_of[branch_id], self._slot_of[request_id], at, end)
        self._valid[request_id] = end
        self.free(branch_id)

    def _maybe_shrink(self, freed_length: int) -> None:
        """Give memory back once the live requests use under a quarter of the cache's allocation.
        O(1) unless a quarter of the slots emptied or the freed request was among the longest.
        Never in graph mode: captured graphs hold the storage's addresses (nor when paged: blocks
        go back to the pool as requests end)."""
        if self.execution == "graph" or self.paged:
            return
        slots, positions = self.cache.allocated()
        live_slots = len(self._slot_owner)
        if live_slots * 4 >= slots and freed_length * 2 < positions:
            return
        live_positions = max(self._valid.values(), default=0) + 1
        if slots * positions and live_slots * live_positions * 4 < slots * positions:
            self.cache.shrink(max(live_slots, 1), live_positions)

    def preallocate(self, num_slots: int, budget: int | None = None, max_model_len: int | None = None) -> bool:
        """Graph mode over a dense cache, before any request: size the storage now for `num_slots`
        rows (and the scratch slot) at max_model_len, where the caller stated one (here, or when
        the runner was made) and that is at most `budget` positions and PREALLOCATE_SHARE of the
        device's free memory. Such a cache never grows, so no captured graph is ever dropped for
        it (a growth drops them all, and each is captured again when next met, mid-request).
        -> whether it did; else the cache grows as requests need (as it does without a stated
        length: a model's own limit is often far longer than what is served, and benches keep many
        engines alive at once; `reserve_ahead` then sizes it for the requests admitted)."""
        stated = max_model_len or self.stated_max_model_len
        if stated is None or self._slot_of:
            return False
        return self._size_ahead(num_slots, stated, budget)

    @property
    def sized_up_front(self) -> bool:
        """Whether the cache already holds the whole context stated when the runner was made
        (`preallocate`): then it never grows."""
        return self.stated_max_model_len is not None and self.cache.allocated()[1] >= self.max_model_len

    def reserve_ahead(self, num_requests: int, longest: int, budget: int | None = None) -> bool:
        """Graph mode over a dense cache: size the storage now for `num_requests` live requests
        the longest of which may come to need `longest` positions (admission's worst case:
        prompt + max_tokens + γ), under the same limits as `preallocate`. Called when requests
        are admitted, so the cache grows then, before their first forward, and not in the middle
        of their decoding, where a growth would drop every captured graph and have each captured
        again as it is next met (a stall per shape, every time contexts pass a capacity step).
        -> whether the storage is (or will be, at the next forward) that large."""
        if num_requests <= 0:
            return False
        slots = max(batch_bucket(num_requests), len(self._slot_owner))
        return self._size_ahead(slots, longest, budget)

    def _size_ahead(self, num_slots: int, positions: int, budget: int | None) -> bool:
        """Reserve `num_slots` rows (and the scratch slot) at `positions` (capped at max_model_len)
        in a graph-mode dense cache, where that is at most `budget` positions as admission counts
        them and the storage it comes to (never less than it is) at most PREALLOCATE_SHARE of the
        device's memory, the cache's own included; the next forward allocates (a stacked cache, now)."""
        if self.paged or self.execution != "graph":
            return False
        if self.max_model_len is not None:
            positions = min(positions, self.max_model_len)
        slots, capacity = self.cache.allocated()
        new_slots, new_capacity = max(num_slots + 1, slots), max(capacity_for(positions, self.max_model_len), capacity)
        if (new_slots, new_capacity) == (slots, capacity):
            return True  # already that large
        try:
            per_position = kv_cache_bytes_per_token(self.model.config, self.dtype)
        except (AttributeError, TypeError):  # a config that does not say its attention's shape
            return False
        room = free_memory_bytes(self.device) + self.cache.memory_bytes()  # (the old storage is let go)
        if (budget is not None and allocation(num_slots, positions) > budget) or \
                new_slots * new_capacity * per_position > PREALLOCATE_SHARE * room:
            return False
        self.cache.reserve(num_slots, positions)  # (the next forward allocates every layer; a stacked cache, now)
        return True

    def _fit(self, num_slots: int, needed: int) -> None:
        """Before the cache grows, drop what no live request uses (slots past those a forward needs,
        positions past the longest live row): the allocation then stays within what admission
        budgets, `allocation(live requests, longest)`. Growth moves the storage anyway, so this
        costs captured graphs nothing extra. (A paged cache grows by the block instead.)"""
        if self.paged:
            return
        slots, capacity = self.cache.allocated()
        if num_slots + 1 <= slots and capacity_for(needed, self.max_model_len) <= capacity:
            return  # no growth
        keep = max(needed, max(self._valid.values(), default=0))
        if slots > num_slots + 1 or capacity > capacity_for(keep, self.max_model_len):
            self.cache.shrink(num_slots, keep)

    def _slot(self, request_id: str) -> int:
        if request_id not in self._slot_of:
            self._slot_of[request_id] = len(self._slot_owner)
            self._slot_owner.append(request_id)
            self._valid[request_id] = 0
        return self._slot_of[request_id]

    def check(self, rows: list[RowInput]) -> None:
        """Raise CacheMiss for the first row that starts past its valid cache."""
        for row in rows:
            if row.start > self.valid_length(row.request_id):
                raise CacheMiss(row.request_id, self.valid_length(row.request_id), row.start)

    # -- forward ----------------------------------------------------------------------------
    @torch.no_grad()
    def forward(
        self, rows: list[RowInput], logits: str = "last", tail: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Write every row's tokens into its cache and return logits (on the device).

        logits="last": [B, V'] at each row's last token; "all": [B, Q, V'] (Q = longest row; a
        shorter row's padded positions hold junk); "none": None. V' is the model's output size
        (K for a draft with a token map). tail [B, T] (device ids, or None): tokens appended to
        every row after its own (all rows must then hold the same number). Rows are right-padded;
        padding is written past a row's end, where the causal mask hides it and the next call
        overwrites it.
        """
        self.check(rows)
        if logits == "none" and getattr(self.cache, "prefix_caching", False):
            for _ in self._prefill_sharing(rows, "none"):
                pass
            return None
        return self._forward_groups(rows, logits, tail, prefill=logits == "none")

    @torch.no_grad()
    def prefill_last(self, rows: list[RowInput]) -> torch.Tensor:
        """Cache rows of committed tokens as a prefill does (a prompt's last chunk, through the
        prompt's last token) and return the logits at each row's last token, [B, V'] in caller
        order: the prompt's last forward also gives the request's first output token. Eager, its
        timing a prefill's; the output head runs only at the positions rows end at. Under prefix
        caching, shared blocks are taken for all but each row's last token, which is always computed."""
        self.check(rows)
        if not getattr(self.cache, "prefix_caching", False):
            return self._forward_groups(rows, "last", None, prefill=True)
        where = {row.request_id: b for b, row in enumerate(rows)}
        out: list = [None] * len(rows)
        for computed, logits in self._prefill_sharing(rows, "last"):
            for row, row_logits in zip(computed, logits):
                out[where[row.request_id]] = row_logits
        return torch.stack(out)

    def _forward_groups(self, rows: list[RowInput], logits: str, tail: torch.Tensor | None,
                        prefill: bool = False) -> torch.Tensor | None:
        """One forward per length group of rows (`length_groups`: usually one), the results put
        back in caller order ([B, Q, V'] with Q the longest group's: a shorter group's extra
        positions are zeros). prefill: the rows are committed tokens (a prompt's), forwarded eagerly."""
        groups = self.length_groups(rows, 0 if tail is None else tail.shape[1])
        if len(groups) == 1:
            return self._forward_rows(rows, logits, tail, prefill)
        outs = []
        for group in groups:
            picked = None if tail is None else tail[torch.tensor(group, device=tail.device)]
            outs.append(self._forward_rows([rows[b] for b in group], logits, picked, prefill))
        return None if outs[0] is None else regroup(outs, groups, len(rows))

    def _forward_rows(self, rows: list[RowInput], logits: str, tail: torch.Tensor | None,
                      prefill: bool = False) -> torch.Tensor | None:
        staged = self.stage(rows, tail_width=0 if tail is None else tail.shape[1])
        if tail is not None:
            staged.ids[:, staged.width - tail.shape[1]:] = tail.to(self.device).index_select(0, staged.sorted_to_caller)
        ends = self._row_ends(rows, staged) if prefill and logits == "last" else None
        out = self.run(staged, logits, prefill=prefill, ends=ends)
        if self._feature_sinks:
            self._hand_features(rows, staged, 0 if tail is None else tail.shape[1], keep=prefill)
        if prefill:  # committed tokens: the blocks they filled may be shared
            for row in rows:
                self.register_prefix(row)
        return None if out is None else self.unsort(staged, out)

    def _row_ends(self, rows: list[RowInput], staged: Staged) -> tuple[torch.Tensor, torch.Tensor]:
        """For a prefill's logits at each row's last token: (the positions some row ends at [k],
        each sorted row's index among them [B']), so that the output head runs at k <= B'
        positions instead of all Q (a prompt's Q can be hundreds; the head is [V, H])."""
        lasts = [len(rows[b].tokens) - 1 for b in staged.order] + [0] * (staged.padded - staged.rows)
        kept = sorted(set(lasts))
        picks = [kept.index(last) for last in lasts]
        # (the positions on the host: a model split over devices indexes its last device's hidden states)
        return torch.tensor(kept), torch.tensor(picks, device=self.device)

    def _hand_features(self, rows: list[RowInput], staged: Staged, tail_width: int, keep: bool) -> None:
        """After a forward of a tapped runner: each row's positions (its tokens and the tail) go to
        the sinks; a prefill under prefix caching (`keep`) also keeps them by block with its keys."""
        features = self.last_features  # [B', Q, F] sorted row order
        keep = keep and getattr(self.cache, "prefix_caching", False)
        for i, b in enumerate(staged.order):
            row = rows[b]
            mine = features[i, : len(row.tokens) + tail_width]  # [n, F]
            for sink in self._feature_sinks:
                sink(row.request_id, row.start, mine)
            if keep:
                self.cache.keep_features(self._slot_of[row.request_id], row.start, mine)

    def length_groups(self, rows: list[RowInput], tail_width: int = 0, extra_positions: int = 0) -> list[list[int]]:
        """A paged cache's rows (caller indices) in two forwards, short ones and long ones, where
        the key positions the short rows would otherwise attend over (up to the longest row's)
        cost more than a second pass over the weights; else one group. Dense, or read in place
        (each row visits its own blocks only): always one group."""
        if not self.paged or len(rows) < 2:
            return [list(range(len(rows)))]
        if self._reads_in_place(max(len(r.tokens) for r in rows) + tail_width):
            return [list(range(len(rows)))]
        ends = [r.start + len(r.tokens) + tail_width + 1 + extra_positions for r in rows]
        order = sorted(range(len(rows)), key=ends.__getitem__)
        keys = [self.cache.reserve_length(ends[b]) for b in order]  # K each row alone would need
        per_position, weights = self.cache.bytes_per_position(), self._weight_bytes()
        saving, split = max(((i * (keys[-1] - keys[i - 1]) * per_position, i) for i in range(1, len(rows))),
                            default=(0, 0))
        if saving <= (1 + SPLIT_OVERHEAD) * weights:
            return [list(range(len(rows)))]
        return [sorted(order[:split]), sorted(order[split:])]

    def _reads_in_place(self, width: int) -> bool:
        """A forward this wide reads a paged pool in place (each row only its own blocks)."""
        return self.paged and self.in_place is not None and width <= IN_PLACE_WIDTH

    def _weight_bytes(self) -> int:
        """Bytes of the model's weights (what each forward reads once), counted once."""
        if self._bytes is None:
            self._bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return self._bytes

    def _prefill_sharing(self, rows: list[RowInput], logits: str):
        """A prefill under prefix caching: each row takes what shared blocks hold; rows whose first
        block repeats an earlier row's (n choices of one prompt, a batch of prompts with a common
        head) wait for that row's forward, so that they take its blocks instead of computing them too.
        Yields each forward's (rows it computed, their logits: None, or [b, V'] for "last", where
        no row's last token is ever taken from the cache)."""
        spare = logits == "last"
        rows = self._take_cached_prefixes(rows, spare)
        while rows:
            first, later, seen = [], [], set()
            for row in rows:
                head = (row.start, tuple(row.tokens[: self.cache.block_size]))
                repeats = len(row.tokens) >= self.cache.block_size and head in seen
                (later if repeats else first).append(row)
                seen.add(head)
            yield first, self._forward_groups(first, logits, None, prefill=True)
            rows = self._take_cached_prefixes(later, spare)

    def _take_cached_prefixes(self, rows: list[RowInput], spare_last: bool = False) -> list[RowInput]:
        """A prefill's rows less the leading tokens whose keys shared blocks already hold (their
        requests take those blocks and their valid lengths move past them): rows left to compute.
        spare_last: each row's last token is computed whatever the cache holds (its logits are wanted)."""
        left = []
        for row in rows:
            taken = self.take_cached_prefix(row, spare_last=spare_last)
            if taken < len(row.tokens):
                left.append(RowInput(row.request_id, row.start + taken, row.tokens[taken:]))
        return left

    def take_cached_prefix(self, row: RowInput, root: int | None = None, spare_last: bool = False) -> int:
        """Before computing a row of committed tokens at its request's valid length (prefix
        caching): the request takes the cached blocks that hold a leading part of them, and its
        valid length moves past them -> how many tokens they hold (0: none, or no prefix caching).
        root: what the cache's hash chain starts from (`register_prefix`'s for the same rows).
        spare_last: the row's last token is computed whatever the cache holds (its logits are wanted)."""
        if not getattr(self.cache, "prefix_caching", False) or row.start != self.valid_length(row.request_id):
            return 0
        tokens = row.tokens[:-1] if spare_last else row.tokens
        taken = self.cache.match(self._slot(row.request_id), row.start, tokens, root, self._match_reach())
        if taken:
            self._valid[row.request_id] = row.start + taken
            self.cached_tokens[row.request_id] = self.cached_tokens.get(row.request_id, 0) + taken
            self._hand_kept_features(row.request_id, row.start, row.start + taken)
        return taken

    def _match_reach(self) -> int | None:
        """How far back the layers whose cache gives blocks back read (`PagedKVCache.match`: a
        prefix match then needs only the blocks a forward after it reads): the windowed layers'
        window in a `hybrid` cache, every layer's where all are windowed and no tap keeps
        features at every position (a feature drafter reads them all); None: every block."""
        if self.hybrid:
            return self.windows.window
        return self.windows.horizon if self.tapped is None else None

    def register_prefix(self, row: RowInput, root: int | None = None) -> None:
        """After a forward wrote a row of committed tokens (paged): the blocks they filled may be
        shared from now on (with prefix caching), their prefix hashed as a chain from `root`: a
        model whose position p depends on more than tokens 0..p (a feature head's on token p + 1
        and the target's features of 0..p) names here what else its first block depends on."""
        if self.paged:
            self.cache.register(self._slot_of[row.request_id], row.start, row.tokens, root)

    def _hand_kept_features(self, request_id: str, start: int, end: int) -> None:
        """Positions [start, end) of a request were taken from cached blocks, not computed: the
        features kept with them go to the sinks, as a forward's would."""
        if self._feature_sinks:
            features = self.cache.kept_features(self._slot_of[request_id], start, end)  # [end - start, F]
            for sink in self._feature_sinks:
                sink(request_id, start, features)

    def stage(self, rows: list[RowInput], tail_width: int = 0, extra_positions: int = 0,
              min_width: int = 0) -> Staged:
        """Host half of a forward: slots, row order, shapes, and one copy of the inputs to the
        device. tail_width: ids the caller writes into `ids[:, -tail_width:]` itself (on the
        device); extra_positions: later single-token forwards (`advance`) the key length covers;
        min_width: pad every row to at least this many tokens (one shape for several widths: the
        padding lands just past each row's end, as a shorter row's does, and costs no position)."""
        lengths = [len(r.tokens) + tail_width for r in rows]
        width = max(*lengths, min_width)
        if tail_width and len(set(lengths)) > 1:
            raise ValueError("rows with a tail must hold the same number of tokens")
        slots = [self._slot(r.request_id) for r in rows]
        order = sorted(range(len(rows)), key=slots.__getitem__)  # sorted row -> caller row
        padded = batch_bucket(len(rows)) if self.pad_batches else len(rows)
        gather = not self.paged and any(slots[b] != i for i, b in enumerate(order))
        # + 1: a shorter row's padding lands just past its own tokens (see _compute)
        needed = max(r.start + n for r, n in zip(rows, lengths)) + 1 + extra_positions
        if self.max_model_len is not None:
            needed = min(needed, self.max_model_len)
        num_slots = max(padded, len(self._slot_owner))
        self._fit(num_slots, needed)
        key_length = self.cache.reserve(num_slots, needed)
        if self.paged:  # each row's blocks up to its padding position and later single-token forwards
            self._forget_behind(rows, slots)
            for r, n, slot in zip(rows, lengths, slots):
                end = min(r.start + n + 1 + extra_positions, key_length)
                self.cache.place(slot, end)
                self.cache.writable(slot, r.start, end)
            self.cache.upload(self.device, key_length)
            if self._reads_in_place(width) and self.in_place == "flat":
                key_length = self.cache.whole_length()
        host = self._host_block(rows, slots, order, padded, width, tail_width)
        block = self._block(padded, width)
        block.copy_(host, non_blocking=True)
        ends = [r.start + n for r, n in zip(rows, lengths)]
        return Staged([r.request_id for r in rows], ends, order, padded, width, key_length, gather,
                      sum(lengths), block)

    def _forget_behind(self, rows: list[RowInput], slots: list[int]) -> None:
        """Paged, where every layer reads a window (`Windows.horizon`), or into the windowed
        layers' own pool (`hybrid`): each row's blocks wholly more than the window and
        `forget_slack` behind its start go back to the pool, so that a request holds about a
        window of positions however long it runs. A row starting where its window reaches into
        blocks given back (a rollback past the slack) loses its cache and is a CacheMiss from
        position 0 (a worker's caller then sends its tokens again)."""
        window = self.windows.window if self.hybrid else self.windows.horizon
        if window is None:
            return
        for r, slot in zip(rows, slots):
            if max(r.start - window + 1, 0) < self.cache.forgotten(slot):
                self._valid[r.request_id] = 0
                self.cache.release(slot)
                raise CacheMiss(r.request_id, 0, r.start)
        for r, slot in zip(rows, slots):
            self.cache.forget(slot, r.start - window + 1 - self.forget_slack)

    def kept_behind(self) -> int | None:
        """Paged, every layer windowed: the most positions before a row's start that the request
        still holds once its forward ran (the window and the slack behind the start, rounded
        down to a block: `_forget_behind`); None: it holds every position (admission counts them)."""
        window = self.windows.horizon
        if window is None or not self.paged:
            return None
        return self._kept_behind(window, self.cache.block_size)

    def _kept_behind(self, window: int, block_size: int) -> int:
        """Positions before a row's start a cache that gives back behind `window` still holds."""
        return window + self.forget_slack + block_size - 2

    def _host_block(self, rows, slots, order, padded, width, tail_width) -> torch.Tensor:
        """[B', Q + 6] int64 on the host (pinned on CUDA), sorted order, padding rows last."""
        scratch = self.cache.scratch_slot
        caller_to_sorted = [0] * padded
        block = []
        for i, b in enumerate(order):
            caller_to_sorted[b] = i
            row = rows[b]
            ids = row.tokens + [0] * (width - len(row.tokens))
            block.append(ids + [row.start, slots[b], slots[b], len(row.tokens) + tail_width - 1, 0, b])
        for i in range(len(rows), padded):
            caller_to_sorted[i] = i
            block.append([0] * width + [0, scratch, i, 0, 0, 0])
        for i in range(padded):
            block[i][width + 4] = caller_to_sorted[i]
        host = torch.tensor(block, dtype=torch.long)
        # Pinned through torch's caching host allocator, which reuses a block only once the copy
        # that read it has finished: the copy below can then run asynchronously.
        return host.pin_memory() if self.device.type == "cuda" else host

    def _block(self, padded: int, width: int) -> torch.Tensor:
        """The static device block for (B', Q) [B', Q + 6], allocated once (graphs read it at fixed
        addresses)."""
        key = (padded, width)
        if key not in self._blocks:
            self._blocks[key] = torch.zeros(padded, width + _COLUMNS, dtype=torch.long, device=self.device)
        return self._blocks[key]

    def advance(self, staged: Staged, tokens: torch.Tensor) -> Staged:
        """The next forward after `staged`: one token per row (tokens [B'] int64, sorted order, on
        the device), written right after each row's last real token. Device ops only; its key
        length is the one `stage(..., extra_positions=...)` reserved."""
        q = staged.width
        block = self.advance_block(staged)
        starts = staged.block[:, q] + staged.block[:, q + 3] + 1  # [B']
        block[:, 0] = tokens
        block[:, 1] = starts
        block[:, 2:4] = staged.block[:, q + 1 : q + 3]
        block[:, 4] = 0
        block[:, 5:7] = staged.block[:, q + 4 : q + 6]
        ends = [e + 1 for e in staged.ends]
        return Staged(staged.request_ids, ends, staged.order, staged.padded, 1, staged.key_length, staged.gather,
                      staged.rows, block)

    def advance_block(self, staged: Staged) -> torch.Tensor:
        """The static block `advance` writes: [B', 1 + 6]."""
        return self._block(staged.padded, 1)

    def run(self, staged: Staged, logits: str = "last", prefill: bool = False,
            ends: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
        """Device half of a forward, timed: logits in sorted order ([B', V'] or [B', Q, V']) or None.
        ends: a prefill's "last" logits computed at those positions only (`_row_ends`)."""
        began = self.clock()
        out, self.last_features = self.execute(staged, logits, prefill, ends)
        self.commit(staged)
        self.record(staged.tokens, began, prefill)
        return out

    def execute(
        self, staged: Staged, logits: str, prefill: bool = False, ends: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """`_compute` as this runner's execution mode says: eager for prefills, for a gathered
        batch, for one that would allocate cache storage and for widths above 16; else compiled
        or replayed. The model's own code runs within `running()`; a replayed graph runs none
        and skips it (entering it swaps every fused block in and out: 0.17 ms of host time per
        forward at 32 layers on the 2-core CPU, in the gap between a step's graphs)."""
        if prefill:
            with self.running():
                return self._compute(staged.block, staged.width, staged.key_length, staged.gather, logits, ends)
        return self._execute(staged, logits)

    def forward_in_capture(self, staged: Staged, logits: str) -> torch.Tensor | None:
        """The forward itself, as a loop being captured runs it: `_compute` in this runner's
        context (`running`), no dispatch, no timing -> logits in sorted order."""
        with self.running():
            return self._compute(staged.block, staged.width, staged.key_length, False, logits)[0]

    def _execute(self, staged: Staged, logits: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        static = self.execution != "eager" and self.fixed_shape(staged)
        if static and self.execution == "graph" and self.capture_forwards:
            key = ("forward", *staged.static_key, logits, self.cache.generation)
            shape = (staged.padded, staged.width, logits)
            return self.graphs.run(key, lambda: self._into_shared(
                shape, self._compute_running(self._compute, staged, logits, False)))
        if static and self.execution == "compile":
            if self._compiled is None:
                # one graph per shape bucket (B', Q, K): more than dynamo's default of 8 per code
                # object, past which a fullgraph compile fails outright
                torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, COMPILED_SHAPES)
                self._compiled = torch.compile(
                    self._compute, fullgraph=True, dynamic=False, backend=self.compile_backend)
            return self._compute_running(self._compiled, staged, logits, False)
        return self._compute_running(self._compute, staged, logits, staged.gather)

    def _into_shared(self, shape: tuple[int, int, str], outputs: tuple) -> tuple:
        """A captured forward's outputs (logits, features) copied into buffers that every key
        length of its (B', Q, logits) shares -> those buffers. A graph's own outputs stay
        allocated for as long as the graph: for a 128k vocabulary, batch buckets up to 64 and
        widths up to 6 that is 0.7 GB of bf16 logits per key length, on one GPU. Callers copy a
        forward's outputs before the next forward (`unsort`, the feature sinks). The buffers are
        made by the warm-up run, outside the capture."""
        if shape not in self._outputs:
            self._outputs[shape] = tuple(None if t is None else torch.empty_like(t) for t in outputs)
        for buffer, t in zip(self._outputs[shape], outputs):
            if t is not None:
                buffer.copy_(t)
        return self._outputs[shape]

    def _compute_running(self, compute, staged: Staged, logits: str, gather: bool):
        """compute (`_compute` or its compiled form) of the staged rows, within `running()`."""
        with self.running():
            return compute(staged.block, staged.width, staged.key_length, gather, logits)

    def fixed_shape(self, staged: Staged) -> bool:
        """Whether forwards of this layout may be compiled or replayed: rows that are slots
        0..B'-1 (nothing gathered), cache storage already allocated, at most 16 tokens wide."""
        return not staged.gather and self.cache.ready and staged.width <= 16

    def commit(self, staged: Staged, advanced: int = 0) -> None:
        """Host bookkeeping once a forward's work is queued (and `advanced` single-token forwards
        after it): valid lengths, the cache's sizes."""
        for request_id, end in zip(staged.request_ids, staged.ends):
            self._valid[request_id] = end + advanced
        self.cache.built()

    def unsort(self, staged: Staged, x: torch.Tensor | None) -> torch.Tensor | None:
        """[B', ...] in sorted order -> [B, ...] in caller order (device gather)."""
        return None if x is None else x.index_select(0, staged.caller_to_sorted[: staged.rows])

    def _compute(
        self, block: torch.Tensor, width: int, key_length: int, gather: bool, logits: str,
        ends: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The forward itself, device only. block [B', Q + 6] -> (logits in sorted order, [B', V']
        or [B', Q, V'] or None; the tapped modules' outputs [B', Q, F] or None: `tap`).
        ends (logits "last" only): (positions [k], each row's index among them [B']): the output
        head runs at those k positions only."""
        ids = block[:, :width]  # [B', Q]
        starts, write_slots, read_slots, last = block[:, width : width + 4].unbind(1)  # [B'] each
        positions = starts[:, None] + torch.arange(width, device=block.device)  # [B', Q]
        # a shorter row's padding all goes to the position just past its own tokens (junk the mask
        # hides), never past the longest row's end: the cache grows only as far as real rows need
        positions = torch.minimum(positions, (starts + last + 1)[:, None])
        if self.max_model_len is not None:
            # Real tokens stay below max_model_len - 1 (the caller's invariant); padding and
            # unused drafts past that all land on the last position, which nothing real attends.
            positions = positions.clamp(max=self.max_model_len - 1)
        # a paged cache's rows' block tables [B', K / bs] (read in place: whole, K the pool's)
        tables = self.cache.tables_of(write_slots, key_length // self.cache.block_size) if self.paged else None
        in_place = self.in_place if self._reads_in_place(width) else None
        # a hybrid cache's windowed layers' own tables [B', K / bs] (they write and read there)
        own = self.cache.window_tables_of(write_slots, tables.shape[1]) if self.hybrid else None
        window_tables, window_start = self._window_reads(positions, tables if own is None else own, in_place)
        self.cache.bind(write_slots, positions, read_slots if gather else None, tables, in_place, window_tables,
                        *(() if own is None else (own,)))
        mask = self.windows.masks(lambda window: self._mask_for(positions, key_length, tables, in_place, window,
                                                                window_tables, window_start))
        with cpu_linear.selected(self.linear_kernels):
            out = self.model(
                input_ids=ids,
                position_ids=positions,
                attention_mask=mask,
                **{self.cache_arg: self.cache if self.fusion is None else self.fusion.cache(self.cache)},
                use_cache=True,
                logits_to_keep=ends[0] if ends is not None else {"last": width, "all": width, "none": 1}[logits],
            )
        features = self._take_taps()
        if logits == "none":
            return None, features
        result = out.logits  # [B', Q, V'] ([B', k, V'] with ends)
        if logits == "last":
            at = last if ends is None else ends[1]
            result = result[torch.arange(result.shape[0], device=result.device), at]  # [B', V']
        return result, features

    def tap(self, modules: Sequence[torch.nn.Module], why: str,
            sink: Callable[[str, int, torch.Tensor], None]) -> None:
        """From now on each forward also yields what `modules` output (a drafter's features), as
        `last_features` [B', Q, F] (sorted row order; F their widths together): an output of the
        forward itself, so compiled and captured forwards keep it (a replayed graph's static
        buffer, valid until the next forward). After each forward, sink(request id, start,
        features [n, F]) gets every row's positions (its tokens and any tail), and, for a prompt
        prefix taken from cached blocks (prefix caching), the features a prefill kept with them.
        why: what taps (`tapped`). Tapping the same modules again adds a sink (two readers share
        the features); other modules are refused. Before the first request only."""
        if self._slot_of or (self.paged and self.cache.num_registered_blocks):
            raise RuntimeError("a runner is tapped only while its cache holds no request and no prefix")
        if self.tapped is not None and [id(m) for m in modules] != self._tapped_modules:
            raise RuntimeError(f"this runner is tapped already, at other modules ({self.tapped})")
        self._feature_sinks.append(sink)
        if self.tapped is not None:
            return
        self.tapped = why
        self._tapped_modules = [id(m) for m in modules]
        self._taps = [None] * len(modules)
        for i, module in enumerate(modules):
            module.register_forward_hook(self._keeper(i))

    def _keeper(self, i: int) -> Callable:
        def keep(module, args, output):
            self._taps[i] = output[0] if isinstance(output, tuple) else output
        return keep

    def _take_taps(self) -> torch.Tensor | None:
        """The tapped outputs of the forward just run, together [B', Q, F] (None: nothing tapped)."""
        if not self._taps:
            return None
        taps, self._taps = self._taps, [None] * len(self._taps)
        first = taps[0]  # a sharded model keeps its layers on several devices
        return first if len(taps) == 1 else torch.cat([t.to(first.device) for t in taps], dim=-1)

    @contextmanager
    def running(self):
        """A context in which the model runs as this runner's forwards do: it attends as they do
        (engine/attention.py) and runs its fused blocks if any (engine/fusion.py). Entered on the
        host around `_compute` or a captured loop of them, never inside one: a config switch
        inside a compiled graph is not reliably undone after it (seen with flex under
        torch.compile, torch 2.13)."""
        with self._attending(), (self.fusion.active() if self.fusion is not None else nullcontext()):
            yield

    def _attending(self):
        if self.attention == "flex":
            return attention.selected(self.model, attention.FLEX_NAME)
        sdpa = getattr(self.model.config, "_attn_implementation", None) == "sdpa"
        return attention.selected(self.model, attention.NAME if self.grouped_attention and sdpa else None)

    def _window_reads(self, positions: torch.Tensor, tables: torch.Tensor | None,
                      in_place: str | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """A paged forward that gathers its keys (under a mask, or flex's BlockMask past its
        in-place width), or any paged forward of a `hybrid` cache (whose windowed layers always
        gather, from their own pool: tables are then theirs): what its windowed layers read instead
        of every block up to K (device ops, shapes fixed by Q and the window). A row's queries
        sit at positions[b, 0] onward, so none of them sees a key before s_b = positions[b, 0] -
        window + 1: such a layer gathers E entries from s_b's block, E * bs >= window + Q + bs - 2
        positions reaching past the row's last query. -> (window tables [B', E] (entries past a
        table's end clamp to its last: their positions lie past K, past every query, and the mask
        hides them), the positions they start at [B']), or (None, None) where every block up to
        K is no more."""
        window = self.windows.window
        if window is None or tables is None or (in_place is not None and not self.hybrid):
            return None, None
        if not self.read_windows:  # (for comparison: every block up to K, as a full layer reads)
            return None, None
        size = self.cache.block_size
        entries = blocks_for(window + positions.shape[1] + size - 2, size)
        if entries >= tables.shape[1]:
            return None, None
        first = torch.div((positions[:, 0] - window + 1).clamp(min=0), size, rounding_mode="floor")  # [B']
        index = (first[:, None] + torch.arange(entries, device=tables.device)).clamp(max=tables.shape[1] - 1)
        return tables.gather(1, index), first * size  # [B', E], [B']

    def _mask_for(self, positions: torch.Tensor, key_length: int, tables: torch.Tensor | None,
                  in_place: str | None, window: int | None, window_tables: torch.Tensor | None = None,
                  window_start: torch.Tensor | None = None):
        """What a forward's layers attend under (of one window: attention.Windows): a mask, a
        BlockMask, or the CPU kernel's reads of a pool in place. A windowed layer given window
        tables (`_window_reads`) gets a mask over just the keys those hold; one of a `hybrid`
        cache always gathers its keys."""
        if window is not None and self.hybrid:
            in_place = None
        if in_place == "flat":
            return attention.pool_block_mask(positions, tables, self.cache.block_size, self.cache.num_blocks,
                                             SCRATCH, window)
        if in_place == "blocks":
            return cpu_attention.reads(positions, tables, window)  # [B', 1, 1, 2Q + T] int64, in place of a mask
        if window is not None and window_tables is not None:  # (its keys: the window's blocks)
            key_length, start = window_tables.shape[1] * self.cache.block_size, window_start
        else:
            start = None
        if self.attention == "flex":
            return attention.block_mask(positions, key_length, window, start)
        return self._mask(positions, key_length, window, start)

    def _mask(self, positions: torch.Tensor, key_length: int, window: int | None = None,
              start: torch.Tensor | None = None) -> torch.Tensor:
        """positions [B', Q] -> [B', 1, Q, K] on the device: the key at position k is visible to a
        query at position p iff k <= p (and k > p - window, for a sliding-window layer). Key j of
        row b is at position j, or start[b] + j where the row's keys start there ([B'],
        `_window_reads`). Boolean for SDPA, additive for eager attention."""
        keys = torch.arange(key_length, device=positions.device)[None, None, :]  # [1, 1, K]
        if start is not None:
            keys = keys + start[:, None, None]  # [B', 1, K]
        visible = keys <= positions[:, :, None]  # [B', Q, K]
        if window is not None:
            visible = visible & (keys > positions[:, :, None] - window)
        visible = visible[:, None]  # [B', 1, Q, K]
        if not self._float_mask:
            return visible
        return (~visible).to(self.dtype) * torch.finfo(self.dtype).min

    # -- timing -----------------------------------------------------------------------------
    def clock(self):
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def record(self, tokens: int, began, prefill: bool = False, forwards: int = 1) -> None:
        """Book `forwards` forwards of `tokens` tokens each, run back to back from `began` (a
        `clock()`) until now (a replayed graph of several is timed as a whole, and split evenly)."""
        ended = self.clock()
        self._pending.extend([(tokens, prefill, began, ended, forwards)] * forwards)

    @property
    def last_forward_seconds(self) -> float:
        """Seconds of the last forward (waits for it on a GPU)."""
        _, _, began, ended, parts = self._pending[-1]
        return _elapsed(began, ended) / parts

    @property
    def last_forward_tokens(self) -> int:
        return self._pending[-1][0]

    def take_forward_log(self) -> ForwardLog:
        """Every forward since the last call, for the cost model (read lazily, see ForwardLog)."""
        log, self._pending = ForwardLog(self._pending), []
        return log

    @torch.no_grad()
    def prefill(self, rows: list[RowInput]) -> ForwardLog:
        """Cache rows' tokens (prompt chunks), computing no logits -> the forward's timing."""
        self.check(rows)
        self.take_forward_log()
        self.forward(rows, logits="none")
        return self.take_forward_log()

    def time_forwards(self, sizes: tuple[int, ...] = CALIBRATION_SIZES) -> list[ForwardTiming]:
        """One forward of each size (tokens) after a short context, twice, keeping the faster:
        seeds a cost model. Sizes 1..8 cover the verify widths where a CPU's cost jumps most. A
        fixed paged pool times only the sizes its free blocks hold (a small budget: the policy
        extrapolates the rest, as it does past the largest size)."""
        context = [0] * CALIBRATION_CONTEXT
        timings = []
        # the context once: each timed forward rewrites the positions after it (no row starts
        # before another, which a windowed paged cache that gave blocks back could not take)
        fitting = self._sizes_that_fit(sizes, len(context))
        self.forward([RowInput("__calibrate__", 0, context)], logits="none")
        for n in fitting:
            best = float("inf")
            for _ in range(2):
                self.forward([RowInput("__calibrate__", len(context), [0] * n)], logits="last")
                best = min(best, self.last_forward_seconds)
            timings.append(ForwardTiming(n, best))
        self.free("__calibrate__")
        self.take_forward_log()
        return timings

    def _sizes_that_fit(self, sizes: tuple[int, ...], context: int) -> list[int]:
        """The sizes whose forward after `context` tokens the cache can place now (+ 1: the
        padding position a forward writes past a row's end, see `stage`)."""
        if not (self.paged and self.cache.fixed):
            return list(sizes)
        room, size = self.cache.num_free_blocks, self.cache.block_size
        return [n for n in sizes if blocks_for(context + n + 1, size) <= room]

    def map_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """Ids in the model's output space -> target vocabulary ids."""
        return ids if self.token_map is None else self.token_map.to(ids.device)[ids]


class GraphSet:
    """CUDA graphs of device-only functions, captured on first use per key and replayed after;
    one memory pool for all of them. A function's outputs are static: valid until its next
    replay. Capture runs the function once on a side stream first (lazy inits, allocations)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = None  # the graphs' memory pool, taken at the first capture (`_pool_for_capture`)
        self._entries: dict[tuple, tuple[torch.cuda.CUDAGraph, object]] = {}
        self.capture_seconds = 0.0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: tuple) -> bool:
        return key in self._entries

    def drop_stale(self, generation: int) -> None:
        """Forget graphs captured over cache storage that has since moved. Where none is left, the
        next capture takes a new pool: the allocator keeps a pool whose graphs are all gone as a
        dead entry until `empty_cache`, and capturing into it again fails an internal assert
        (`use_count > 0`); empty_cache also gives the dead pool's memory back."""
        kept = {k: v for k, v in self._entries.items() if k[-1] == generation}
        if self._entries and not kept:
            self._entries.clear()  # the graphs go before their pool's memory is released
            self.pool = None
            torch.cuda.empty_cache()
        self._entries = kept

    def _pool_for_capture(self):
        """The pool every live graph shares (a new one where no graph is alive)."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        return self.pool

    def run(self, key: tuple, fn: Callable[[], object], inputs: tuple[torch.Tensor, ...] = ()):
        """Replay key's graph (capturing fn first if new) -> its static outputs. key[-1] is the KV
        cache's generation. inputs: static buffers fn itself overwrites (they are put back after
        the warm-up run, so that the first replay reads what the caller staged)."""
        entry = self._entries.get(key)
        if entry is None:
            self.drop_stale(key[-1])
            entry = self._entries[key] = self._capture(fn, inputs)
        graph, out = entry
        graph.replay()
        return out

    def _capture(self, fn: Callable[[], object], inputs: tuple[torch.Tensor, ...]):
        began = time.perf_counter()
        saved = [t.clone() for t in inputs]
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            fn()  # warm-up: its cache writes are the ones the replay makes again, from the same inputs
            for t, s in zip(inputs, saved):
                t.copy_(s)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool_for_capture()):
            out = fn()
        self.capture_seconds += time.perf_counter() - began
        return graph, out


def _resolve_execution(execution: str, model: torch.nn.Module, device: torch.device) -> str:
    if execution not in EXECUTION_MODES:
        raise ValueError(f"execution must be one of {EXECUTION_MODES}, got {execution!r}")
    devices = {p.device for p in model.parameters()}
    if execution == "auto":
        return "graph" if device.type == "cuda" and len(devices) == 1 else "eager"
    if execution in ("graph", "fused-graph") and (device.type != "cuda" or len(devices) != 1):
        raise ValueError(f"execution={execution!r} needs the whole model on one CUDA device")
    return "graph" if execution == "fused-graph" else execution


def grouped_attention_on(device: torch.device) -> bool:
    """Whether a runner's masked forwards run grouped-query attention without copying the cache once
    per query head (engine/attention.py `grouped_sdpa`). HF's SDPA path, given a mask, repeats every
    layer's keys and values for each query head of their group (`repeat_kv`) on a CPU and on CUDA
    alike: on a GPU, for a 1.1B draft of 32 query heads over 4 KV heads, eight copies of its whole
    cache per forward, 44 extra kernels, and eight times the key reads of one kernel per KV head.
    On a CPU SPECSERVE_CPU_KERNELS=0 keeps HF's path (with the other CPU kernels)."""
    return device.type == "cuda" or cpu_kernels_on(device)


def cpu_kernels_on(device: torch.device) -> bool:
    """Whether a runner on this device uses the CPU kernels: a CPU, unless SPECSERVE_CPU_KERNELS=0."""
    return device.type == "cpu" and os.environ.get("SPECSERVE_CPU_KERNELS", "1") != "0"


def _resolve_attention(mode: str, model: torch.nn.Module) -> str:
    if mode not in ATTENTION_MODES:
        raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {mode!r}")
    if mode == "flex" and not dispatches(model):
        raise ValueError(f"attention='flex' needs a model whose layers attend through transformers' attention "
                         f"interface; {type(model).__name__}'s do not: use attention='mask'")
    if mode == "flex" and len({p.device for p in model.parameters()}) > 1:
        # the BlockMask's mask_mod reads tensors on the first device; layers elsewhere cannot
        raise ValueError("attention='flex' needs the whole model on one device (a sharded model attends under a mask)")
    width = head_dim(model.config)
    if mode == "flex" and width is not None and width < 16 and any(p.is_cuda for p in model.parameters()):
        raise ValueError(f"attention='flex' on a GPU needs a head dimension of at least 16 (FlexAttention's "
                         f"kernel); this model's is {width}: use attention='mask'")
    return "mask" if mode == "auto" else mode


def regroup(parts: list[torch.Tensor | None], groups: list[list[int]], batch: int) -> torch.Tensor | None:
    """Per-group results [B_g, ...] (leading dims may differ past the first: padded with zeros)
    -> one [B, ...] in caller order."""
    if parts[0] is None:
        return None
    shape = [max(p.shape[d] for p in parts) for d in range(1, parts[0].dim())]
    out = parts[0].new_zeros(batch, *shape)
    for part, group in zip(parts, groups):
        index = torch.tensor(group, device=part.device)
        out[(index, *(slice(0, n) for n in part.shape[1:]))] = part
    return out
