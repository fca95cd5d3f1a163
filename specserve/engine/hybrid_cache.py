"""A paged KV cache for a model whose layers mix full attention and a sliding window: a pool per
layer type.

Gemma 2 and 3, gpt-oss and Qwen2/3 with `max_window_layers` attend their whole context in some
layers and only a window in the others (Gemma 3: five windowed layers of 1024 positions to each
full one). In one `PagedKVCache` a block holds a position in every layer, so a request must keep
every block its full layers read, and its windowed layers' keys of positions no window reaches
any more stay allocated with them: a 32k-token Gemma 3 request keeps 32k positions in all its
layers where its windowed layers need about one window.

Here the two kinds of layer keep their keys in two `PagedKVCache`s, each with its own pool, free
list and block tables, over the same slots and positions:

- `full`, for the full layers, holds every position of every request, as the one cache did: the
  server's budget (`max_cached_tokens`) is its pool, and admission counts it as before.
- `window`, for the windowed layers, gives a slot's leading blocks back as its window passes them
  (`forget`, as a model whose every layer is windowed does), so a request holds about a window,
  the slack behind it and its next forward there. Its pool is sized for that (`window_pool_blocks`:
  the most requests at once, each at its widest forward, a prefill chunk), never more than the
  full pool's blocks (a slot holds no more blocks in it than in the full one); short of blocks it
  grows, up to that.

Both are placed, released, moved, copied and bound together, so a slot's position p has its
entry in both tables; `update` sends each layer's keys to its own pool. A windowed layer reads
its keys gathered by the window tables the runner looks up in the window cache's tables
(`ModelRunner._window_reads`), while a full layer may read its pool in place (under flex or the
CPU kernel): the two kinds of layer take different masks already (`attention.Windows.masks`).

Prefix sharing (`prefix_caching`) registers a prefill's blocks in both. A later prompt takes the
blocks both still hold: the full cache matches first, the window cache as far as that, needing
only the blocks a forward right after the match reads (its registered blocks are given back, and
so evicted, first: a prompt's leading ones, which that forward does not read); where the window
cache matched less, the prefill computes from there, and the full cache's extra shared blocks
are copied before they are written (`writable`, copy on write). Features kept for a feature
drafter stay with the full cache.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from .paged_cache import SCRATCH, PagedKVCache, blocks_for


def window_pool_blocks(rows: int, kept_behind: int, widest: int, block_size: int) -> int:
    """Blocks the windowed layers' pool needs for `rows` requests at once, each holding at most
    `kept_behind` positions before its forward's start and its forward of up to `widest`
    positions (the padding position past them included), one more where a window begins inside
    a block, and the scratch block."""
    return 1 + rows * (blocks_for(kept_behind + widest + 1, block_size) + 1)


class HybridPagedKVCache:
    paged = True
    is_compileable = False
    hybrid = True

    def __init__(self, windowed: Callable[[int], bool], block_size: int, max_model_len: int | None = None,
                 num_blocks: int | None = None, prefix_caching: bool = False, key_step: int | None = None,
                 window_blocks: int | None = None) -> None:
        """windowed(layer index): whether the layer attends a window (its keys go to `window`);
        num_blocks: the full layers' pool, fixed (None: it grows); window_blocks: what the
        windowed layers' pool starts at (`window_pool_blocks`; None: the full pool's size)."""
        extra = {} if key_step is None else {"key_step": key_step}
        self.full = PagedKVCache(block_size, max_model_len, num_blocks, prefix_caching, **extra)
        start = window_blocks or num_blocks
        if num_blocks is not None and start is not None:
            start = min(start, num_blocks)
        self.window = PagedKVCache(block_size, max_model_len, start, prefix_caching,
                                   grows_to=num_blocks or 0, **extra)
        self.window.windowed_layer = lambda layer_idx: True  # (it reads window tables wherever bound with them)
        self.windowed_layer = windowed

    @property
    def block_size(self) -> int:
        return self.full.block_size

    @property
    def max_model_len(self) -> int | None:
        return self.full.max_model_len

    @property
    def key_step(self) -> int:
        return self.full.key_step

    @key_step.setter
    def key_step(self, step: int) -> None:
        for cache in self._both():
            cache.key_step = step

    @property
    def prefix_caching(self) -> bool:
        return self.full.prefix_caching

    @property
    def fixed(self) -> bool:
        return self.full.fixed

    @property
    def generation(self) -> int:
        """Bumped whenever either pool's storage or tables move (captured graphs hold both)."""
        return self.full.generation + self.window.generation

    def _both(self) -> tuple[PagedKVCache, PagedKVCache]:
        return self.full, self.window

    # -- HF Cache duck-typing -------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.full.get_seq_length(layer_idx)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """As `PagedKVCache.update`, in the pool of the layer's kind: a windowed layer gets its
        rows' window blocks [B', H, E * bs, D] (or every block up to K), a full layer its rows'
        keys or, bound in place, the full pool."""
        cache = self.window if self.windowed_layer(layer_idx) else self.full
        return cache.update(key_states, value_states, layer_idx)

    # -- runner API: slots ------------------------------------------------------------------
    @property
    def scratch_slot(self) -> int:
        return self.full.scratch_slot

    def place(self, slot: int, positions: int) -> None:
        for cache in self._both():
            cache.place(slot, positions)

    def release(self, slot: int) -> None:
        for cache in self._both():
            cache.release(slot)

    def forget(self, slot: int, before: int) -> int:
        """The windowed layers will not read the slot's positions before `before` again: their
        pool takes those blocks back (the full layers keep theirs) -> positions given back there."""
        return self.window.forget(slot, before)

    def forgotten(self, slot: int) -> int:
        """Leading positions of the slot the windowed layers' pool gave back (`forget`)."""
        return self.window.forgotten(slot)

    def move_slot(self, src: int, dst: int) -> None:
        for cache in self._both():
            cache.move_slot(src, dst)

    # -- prefix sharing ---------------------------------------------------------------------
    def match(self, slot: int, start: int, tokens: list[int], root: int | None = None,
              reach: int | None = None) -> int:
        """The cached blocks both pools hold for a leading part of `tokens` -> how many tokens
        (see the module's text: the full pool's extra matched blocks are copied on write).
        reach: the windowed layers' window (their pool then needs only the blocks a forward
        right after the match reads: `PagedKVCache.match`)."""
        taken = self.full.match(slot, start, tokens, root)
        return self.window.match(slot, start, tokens[:taken], root, reach) if taken else 0

    def register(self, slot: int, start: int, tokens: list[int], root: int | None = None) -> None:
        for cache in self._both():
            cache.register(slot, start, tokens, root)

    def writable(self, slot: int, start: int, end: int) -> None:
        for cache in self._both():
            cache.writable(slot, start, end)

    def copy_positions(self, src: int, dst: int, start: int, end: int) -> None:
        for cache in self._both():
            cache.copy_positions(src, dst, start, end)

    def keep_features(self, slot: int, start: int, features: torch.Tensor) -> None:
        self.full.keep_features(slot, start, features)

    def kept_features(self, slot: int, start: int, end: int) -> torch.Tensor:
        return self.full.kept_features(slot, start, end)

    # -- runner API: a forward --------------------------------------------------------------
    def reserve(self, num_slots: int, needed_positions: int) -> int:
        self.window.reserve(num_slots, needed_positions)
        return self.full.reserve(num_slots, needed_positions)

    def reserve_length(self, needed_positions: int) -> int:
        return self.full.reserve_length(needed_positions)

    @property
    def ready(self) -> bool:
        return self.full.ready and self.window.ready

    def built(self) -> None:
        for cache in self._both():
            cache.built()

    def upload(self, device: torch.device, key_length: int) -> int:
        return sum(cache.upload(device, key_length) for cache in self._both())

    def whole_length(self) -> int:
        """K of a forward whose full layers read their pool in place (`PagedKVCache.whole_length`)."""
        return self.full.whole_length()

    def tables_of(self, slots: torch.Tensor, entries: int) -> torch.Tensor:
        """[B', entries]: the rows' full-layer block tables."""
        return self.full.tables_of(slots, entries)

    def window_tables_of(self, slots: torch.Tensor, entries: int) -> torch.Tensor:
        """[B', entries]: the rows' tables in the windowed layers' pool (scratch past its width)."""
        tables = self.window.tables_of(slots, entries)
        return F.pad(tables, (0, entries - tables.shape[1]), value=SCRATCH) if tables.shape[1] < entries else tables

    def bind(self, write_slots: torch.Tensor, positions: torch.Tensor, read_slots: torch.Tensor | None,
             tables: torch.Tensor | None = None, in_place: str | None = None,
             window_tables: torch.Tensor | None = None, own: torch.Tensor | None = None) -> None:
        """As `PagedKVCache.bind`: tables [B', T] the full layers' (read in place where in_place
        says); window_tables [B', E], what the windowed layers gather in their pool (None: every
        entry of their tables up to T), which they always gather; own [B', T]: their tables, where
        they write (None: looked up here, `window_tables_of`)."""
        self.full.bind(write_slots, positions, read_slots, tables, in_place)
        if own is None:
            own = self.window_tables_of(write_slots, tables.shape[1])
        self.window.bind(write_slots, positions, read_slots, own, None, window_tables)

    # -- accounting -------------------------------------------------------------------------
    def allocated(self) -> tuple[int, int]:
        """(blocks in use in the full layers' pool, scratch included; the positions they hold):
        what the budget bounds (`window_allocated`: the windowed layers')."""
        return self.full.allocated()

    def window_allocated(self) -> tuple[int, int]:
        return self.window.allocated()

    @property
    def num_cached_blocks(self) -> int:
        return self.full.num_cached_blocks

    @property
    def num_registered_blocks(self) -> int:
        return self.full.num_registered_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.full.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.full.num_blocks

    @property
    def num_window_blocks(self) -> int:
        return self.window.num_blocks

    def bytes_per_position(self) -> int:
        """Bytes of keys and values one position holds in the full layers allocated so far (a
        windowed layer's are held for a window only)."""
        return self.full.bytes_per_position()

    def memory_bytes(self) -> int:
        return self.full.memory_bytes() + self.window.memory_bytes()
