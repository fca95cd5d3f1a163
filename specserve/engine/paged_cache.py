"""A paged KV cache: keys and values by fixed-size block from one pool per layer, a block table per slot.

`SlotKVCache` gives every slot the capacity of the longest live request, so one long request makes
every short one cost its length. Here storage per layer is one pool `[N, bs, H, D]` (N blocks of bs
positions, H kv heads, D head dim); block 0 is scratch (padding rows and unused table entries point
there, nobody reads it). A slot (the runner's index for a request, exactly as with the dense
cache) owns a list of blocks: its position p lives at `table[p // bs]`, offset `p % bs`. A slot
takes blocks as its positions need them (`place`, on the host, before a forward) and gives them
back when its request is freed; a rollback past a block boundary keeps the blocks it has (the next
forward overwrites them, as the dense cache does).

The tables live on the device too: one static tensor `[S + 1, M]` (a row per slot, M entries:
the most blocks a request may hold; its last row is all scratch, for padding rows), kept in step
with the host's lists by `upload` before a forward, which sends only the entries that changed
since the last one (a block taken every bs tokens, a copy on write, a slot freed or moved), as one
small copy, and nothing at all on most steps. A forward looks its rows' tables up by slot
(`tables_of`, a device gather): `[B', K / bs]` (K the key length, a multiple of bs); `bind` turns
them into flat write indices `[B', Q]`, and `update` writes through those and gathers the tables'
blocks whole (bs positions per index) in every layer (device ops on fixed shapes: compiled or
captured like the dense forward).
A layer that attends a sliding window reads less where the runner hands `bind` window tables
(`[B', E]`: E entries from the block where each row's window starts, the same E for every row):
`update` gathers those for the layers `windowed_layer` names, the whole tables for the others, so a
windowed layer of a long request reads about its window, not its whole context.
Bound in place, `update` writes and returns the whole pool instead, for an attention that reads
it through the tables itself: no gather. `"flat"`: `[1, H, N * bs, D]`, for FlexAttention
(attention.pool_block_mask); such a forward takes the tables whole (`[B', M]`) and its K is the
pool's: shapes that no context length changes, so one captured graph per batch bucket and width
serves every length. `"blocks"`: the pools as they are, `[N, bs, H, D]`, for the CPU kernel
(engine/cpu_attention.py).
With a pool sized once (`num_blocks`: the server's budget), storage never moves, so captured
graphs stay valid; without one the pool doubles when full (its `generation` bumps, as the dense
cache's growth does), up to `grows_to` blocks where that is given.

A model whose every layer attends a sliding window never reads a position again once the window
has passed it: `forget` gives a slot's leading blocks back to the pool (their entries become
scratch, counted by `forgotten`), so such a request holds about a window of positions however long
it runs. A copy (`copy_positions`, a fork) leaves what its source gave back behind too. A model with
full layers too keeps its windowed layers in a cache of their own that does this
(engine/hybrid_cache.py).

Prefix sharing (`prefix_caching`): every full block a prefill wrote (committed tokens only) is
registered under a hash of the whole token prefix it ends (a chain: the previous block's hash and
its own tokens). A later prefill of the same prefix takes those blocks instead of computing them
(`match`): they join its table read-only, counted by reference. A block nobody references stays
cached, least recently used first out when the pool needs blocks. A forward that would write into
a shared or registered block (a request rolled back into its prompt) first copies it into a block
of its own (`writable`: copy on write), so a cached block never changes. Where every layer reads
only a window (`match(reach=)`), a prompt needs only the cached blocks its next forward reads,
its last window's: the leading ones, which such a cache gives back and so evicts first, may be
gone. A runner whose forwards also output per-position features (a feature drafter's tap) keeps a prefill's features by block
beside its keys (`keep_features`, one more pool `[N, bs, F]`), so that a request taking the blocks
gets their features too (`kept_features`): the drafter needs one per position.

The object is passed to a HF model as `past_key_values` (`update(keys, values, layer_idx)`), like
`SlotKVCache`; layers are allocated lazily on the device of their keys (a sharded model gets one
pool per device for its layers).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch

from .kv_cache import CAPACITY_STEP, key_length_for

SCRATCH = 0  # the scratch block
TABLE_ROWS = 64  # slots the device tables first hold (doubled when more are live)
IN_PLACE = (None, "flat", "blocks")  # how `update` returns keys: gathered, or the pool in a layout


def blocks_for(positions: int, block_size: int) -> int:
    return -(-positions // block_size)


class PagedKVCache:
    paged = True
    is_compileable = False

    def __init__(self, block_size: int, max_model_len: int | None = None, num_blocks: int | None = None,
                 prefix_caching: bool = False, key_step: int = CAPACITY_STEP, grows_to: int | None = None) -> None:
        """num_blocks: the pool's fixed size, scratch included (None: grow as needed);
        prefix_caching: share the blocks of prompt prefixes already computed (see above);
        key_step: K's rounding before whole blocks (`key_length_for`); grows_to: num_blocks is
        where the pool starts, and it may grow up to this many blocks (0: without a limit)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.key_step = key_step
        self.fixed = num_blocks is not None and grows_to is None
        self._limit = grows_to or None  # the most blocks a growing pool may come to (None: no limit)
        self._num_blocks = num_blocks if num_blocks is not None else 64  # N, scratch included
        if self._num_blocks < 2:
            raise ValueError("a paged cache needs at least 2 blocks (one is scratch)")
        self._free = list(range(self._num_blocks - 1, 0, -1))  # a stack: the lowest id on top
        self._tables: list[list[int]] = []  # slot -> its blocks
        self._device_tables: torch.Tensor | None = None  # [S + 1, M] the tables on the device (`upload`)
        self._uploaded: list[int] = []  # slot -> entries its device row holds (scratch past them)
        self._changed: dict[int, int] = {}  # slot -> its first entry changed since the last upload
        self.prefix_caching = prefix_caching
        self._refs = [0] * self._num_blocks  # block -> tables holding it
        self._index: dict[int, int] = {}  # prefix hash -> the block that ends it
        self._hash_of: dict[int, int] = {}  # registered block -> its prefix hash
        self._content: dict[int, tuple] = {}  # registered block -> (previous block's hash, its tokens)
        self._cached: OrderedDict[int, None] = OrderedDict()  # registered blocks no table holds, LRU first
        self._chains: list[list[int]] = []  # slot -> hashes of its leading registered blocks
        self._tails: list[list[int] | None] = []  # slot -> tokens written past them (None: not followed)
        self._forgotten: list[int] = []  # slot -> leading table entries given back (`forget`): scratch now
        self._keys: list[torch.Tensor | None] = []  # per layer [N, bs, H, D]
        self._values: list[torch.Tensor | None] = []
        self._features: torch.Tensor | None = None  # [N, bs, F] what prefills' tapped forwards output (`keep_features`)
        self._built = 0  # blocks every layer was last seen at after a forward
        self.generation = 0  # bumped whenever storage moves (captured graphs hold its addresses)
        self._view_length = 0  # K of the current forward
        self._write: torch.Tensor | None = None  # [B', Q] flat index each new token goes to
        self._read: torch.Tensor | None = None  # [B', K / bs] block ids to gather (None: read in place)
        self._window_read: torch.Tensor | None = None  # [B', E] those a windowed layer gathers (None: `_read`)
        self.windowed_layer: Callable[[int], bool] = lambda layer_idx: False  # which layers read `_window_read`
        self._in_place: str | None = None  # the layout `update` returns the pool in, if it does (`bind`)
        self._on_device: dict[torch.device, tuple] = {}

    # -- HF Cache duck-typing -------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._view_length

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """key_states/value_states [B', H, Q, D] -> keys/values of the batch rows [B', H, K, D]
        ([B', H, E * bs, D] for a windowed layer bound with window tables; bound in place: the
        pool, [1, H, N * bs, D] or [N, bs, H, D]; see `bind`)."""
        keys, values = self._layer(layer_idx, key_states, value_states)
        write, read, window_read = self._indices(keys.device)  # [B', Q], [B', K / bs], [B', E]
        if window_read is not None and self.windowed_layer(layer_idx):
            read = window_read
        batch, heads = key_states.shape[:2]
        for pool, states in ((keys, key_states), (values, value_states)):  # (D each their own)
            pool.view(-1, heads, states.shape[-1])[write] = states.transpose(1, 2).to(pool.dtype)  # [B', Q, H, D]
        if self._in_place == "blocks":
            return keys, values  # [N, bs, H, D]
        if read is None:  # bound in place, flat: [1, H, N*bs, D]
            return tuple(pool.view(1, -1, heads, pool.shape[-1]).transpose(1, 2) for pool in (keys, values))
        length = read.shape[1] * self.block_size
        blocks = read.reshape(-1)  # whole blocks at a time: bs * H * D contiguous elements each
        return tuple(pool.view(pool.shape[0], -1).index_select(0, blocks).view(batch, length, heads, pool.shape[-1])
                     .transpose(1, 2) for pool in (keys, values))

    # -- runner API: slots ------------------------------------------------------------------
    @property
    def scratch_slot(self) -> int:
        return -1  # (a padding row: its table is all scratch)

    def place(self, slot: int, positions: int) -> None:
        """Before a forward (host): slot's table covers positions [0, positions)."""
        while len(self._tables) <= slot:
            self._tables.append([])
            self._chains.append([])
            self._tails.append([])
            self._uploaded.append(0)
            self._forgotten.append(0)
        table = self._tables[slot]
        missing = blocks_for(positions, self.block_size) - len(table)
        if missing > 0:
            self._change(slot, len(table))
            table.extend(self._take(missing))

    def release(self, slot: int) -> None:
        """The slot's request is gone: its blocks go back to the pool (registered ones stay cached)."""
        if slot < len(self._tables):
            for block in reversed(self._tables[slot][self._forgotten[slot]:]):
                self._drop(block)
            self._tables[slot], self._chains[slot], self._tails[slot] = [], [], []
            self._forgotten[slot] = 0
            self._change(slot, 0)

    def forget(self, slot: int, before: int) -> int:
        """No forward will read the slot's positions before `before` again (every layer attends a
        window that has passed them): the blocks wholly before it go back to the pool (registered
        ones stay cached), their entries scratch. -> the slot's positions given back so far (a
        multiple of the block size; `forgotten`)."""
        if slot >= len(self._tables):  # (nothing placed yet)
            return 0
        table = self._tables[slot]
        first, last = self._forgotten[slot], min(max(before, 0) // self.block_size, len(table))
        if last > first:
            for i in range(first, last):
                self._drop(table[i])
                table[i] = SCRATCH
            self._forgotten[slot] = last
            self._change(slot, first)
        return self.forgotten(slot)

    def forgotten(self, slot: int) -> int:
        """Leading positions of the slot given back by `forget` (none of them can be read)."""
        return self._forgotten[slot] * self.block_size if slot < len(self._forgotten) else 0

    def move_slot(self, src: int, dst: int) -> None:
        """Slot src's cache becomes slot dst's (dst released first; nothing is copied)."""
        self.release(dst)
        self.place(dst, 0)
        for store in (self._tables, self._chains, self._tails):
            store[dst], store[src] = store[src], []
        self._forgotten[dst], self._forgotten[src] = self._forgotten[src], 0
        self._change(dst, 0)
        self._change(src, 0)

    # -- prefix sharing ---------------------------------------------------------------------
    def match(self, slot: int, start: int, tokens: list[int], root: int | None = None,
              reach: int | None = None) -> int:
        """Before a prefill of `tokens` at `start` (committed tokens): take the cached blocks that
        hold a leading part of them -> how many of the tokens they hold. It continues the slot's
        registered blocks: from a block boundary, or from inside the block the slot's last prefill
        ended in (its private copy of that block is then swapped for the cached one). root: the
        hash chain's start (`register`'s). reach: every layer reads only this many positions back
        (a window: `forget` gives the rest back), so from a block boundary only the blocks a
        forward right after the match reads need be cached (`_match_window`)."""
        self.place(slot, 0)
        chain, tail, table = self._chains[slot], self._tails[slot], self._tables[slot]
        size = self.block_size
        if not self.prefix_caching or tail is None or len(chain) * size + len(tail) != start:
            return 0
        if len(table) != len(chain) + bool(tail):
            return 0
        if reach is not None and not tail:
            return self._match_window(slot, tokens, root, reach)
        taken = 0
        while taken + size - len(tail) <= len(tokens):
            content = (chain[-1] if chain else root, tuple(tail) + tuple(tokens[taken : taken + size - len(tail)]))
            block = self._index.get(hash(content))
            if block is None or self._content[block] != content:  # (a hash collision is a miss)
                break
            self._hold(block)
            if tail:  # the block the last prefill began: the cached one replaces the private copy
                self._drop(table.pop())
            self._change(slot, len(table))
            table.append(block)
            chain.append(hash(content))
            taken += size - len(tail)
            tail = self._tails[slot] = []
        return taken

    def _match_window(self, slot: int, tokens: list[int], root: int | None, reach: int) -> int:
        """`match` from a block boundary where layers read `reach` positions back: the longest
        run of whole blocks of `tokens` whose last ones, those holding the positions a forward
        from the run's end P reads (from P - reach + 1), are all cached. The blocks before those
        are given back at once (their entries scratch, `forgotten`), cached or not, so a prompt
        whose leading blocks were evicted (a window pool gives them back first) still takes its
        last window's. -> tokens taken."""
        chain, table, size = self._chains[slot], self._tables[slot], self.block_size
        first = len(chain)  # the slot's block the run begins at
        keys, found, previous = [], [], chain[-1] if chain else root
        for i in range(len(tokens) // size):
            content = (previous, tuple(tokens[i * size : (i + 1) * size]))
            previous = hash(content)
            block = self._index.get(previous)
            keys.append(previous)
            found.append(block if block is not None and self._content[block] == content else None)
        for end in range(len(found), 0, -1):  # the longest run first
            needed = max((first + end) * size - reach + 1, 0) // size  # the first block a forward then reads
            if needed >= self._forgotten[slot] and all(b is not None for b in found[max(needed - first, 0) : end]):
                break
        else:
            return 0
        self.forget(slot, needed * size)  # (the slot's own blocks before `needed`)
        self._change(slot, len(table))
        for i in range(end):
            block = found[i] if first + i >= needed else SCRATCH
            if block != SCRATCH:
                self._hold(block)
            table.append(block)
            chain.append(keys[i])
        self._forgotten[slot] = max(self._forgotten[slot], needed)
        return end * size

    def register(self, slot: int, start: int, tokens: list[int], root: int | None = None) -> None:
        """After a prefill wrote committed `tokens` at `start`: index the slot's blocks they filled.
        root: what the first block's hash chains from, beside its tokens (None for a model whose
        position p depends on tokens 0..p only)."""
        tail = self._tails[slot] if slot < len(self._tails) else None
        chain = self._chains[slot] if slot < len(self._chains) else []
        if not self.prefix_caching or tail is None or len(chain) * self.block_size + len(tail) != start:
            if slot < len(self._tails):
                self._tails[slot] = None  # not a plain continuation: this slot registers nothing more
            return
        tail = tail + list(tokens)
        size = self.block_size
        while len(tail) >= size:
            content = (chain[-1] if chain else root, tuple(tail[:size]))
            key, block = hash(content), self._tables[slot][len(chain)]
            if key not in self._index and block not in self._hash_of:
                self._index[key], self._hash_of[block], self._content[block] = block, key, content
            chain.append(key)
            tail = tail[size:]
        self._tails[slot] = tail

    def writable(self, slot: int, start: int, end: int) -> None:
        """Before a forward writes positions [start, end) of slot: any shared or registered block
        among them is first copied into a block of the slot's own (copy on write)."""
        table = self._tables[slot]
        first, last = start // self.block_size, min(blocks_for(end, self.block_size), len(table))
        for i in range(first, last):
            block = table[i]
            if self._refs[block] > 1 or block in self._hash_of:
                (fresh,) = self._take(1)
                self._copy_block(block, fresh)
                table[i] = fresh
                self._change(slot, i)
                self._drop(block)
        if first < len(self._chains[slot]):  # its registered prefix ends before the rewritten block
            del self._chains[slot][first:]
            self._tails[slot] = None

    def copy_positions(self, src: int, dst: int, start: int, end: int) -> None:
        """Copy positions [start, end) of slot src into slot dst (taking the blocks dst lacks);
        those src has given back (`forget`) dst gives back too, uncopied."""
        self.place(dst, end)
        gone = min(self.forgotten(src), end)
        if start < gone:
            self.forget(dst, gone)
            start = gone
        self.writable(dst, start, end)
        self._fit_features()
        src_index = self._flat(self._tables[src], start, end)
        dst_index = self._flat(self._tables[dst], start, end)
        for store in self._stores():
            flat = store.view(-1, *store.shape[2:])
            flat[dst_index.to(store.device)] = flat[src_index.to(store.device)]

    def keep_features(self, slot: int, start: int, features: torch.Tensor) -> None:
        """After a prefill wrote slot's positions [start, start + n): features [n, F] its forward
        output there, kept by block beside their keys (taken along with the blocks). Host-built
        indices: prefills only, never a decode step."""
        store = self._fit_features(features)
        index = self._flat(self._tables[slot], start, start + features.shape[0]).to(store.device)
        store.view(-1, store.shape[-1])[index] = features.to(store.dtype)

    def kept_features(self, slot: int, start: int, end: int) -> torch.Tensor:
        """[end - start, F]: the features `keep_features` kept at slot's positions [start, end)
        (blocks it took from the prefix cache hold those of the request that computed them)."""
        if self._features is None:
            raise RuntimeError("no features were kept in this cache (keep_features)")
        index = self._flat(self._tables[slot], start, end).to(self._features.device)
        return self._features.view(-1, self._features.shape[-1])[index]

    def reserve(self, num_slots: int, needed_positions: int) -> int:
        """Before a forward (host integers only) -> K, the key length to attend over: the dense
        cache's rounding, up to a whole number of blocks."""
        if self.max_model_len is not None and needed_positions > self.max_model_len:
            raise ValueError(
                f"position {needed_positions - 1} is beyond the cache limit of {self.max_model_len} tokens")
        self._view_length = self.reserve_length(needed_positions)
        return self._view_length

    def reserve_length(self, needed_positions: int) -> int:
        """K a forward over rows needing `needed_positions` would attend over (`reserve`'s rounding:
        the dense cache's, `key_step`, up to a whole number of blocks)."""
        needed = needed_positions if self.max_model_len is None else min(needed_positions, self.max_model_len)
        return blocks_for(key_length_for(needed, self.key_step, self.max_model_len), self.block_size) * self.block_size

    @property
    def ready(self) -> bool:
        """Every layer already holds the pool's current size: a forward allocates nothing."""
        return self._built >= self._num_blocks

    def built(self) -> None:
        self._built = self._num_blocks

    def bind(self, write_slots: torch.Tensor, positions: torch.Tensor, read_slots: torch.Tensor | None,
             tables: torch.Tensor | None = None, in_place: str | None = None,
             window_tables: torch.Tensor | None = None) -> None:
        """Inside a forward (device tensors): positions [B', Q], tables [B', K / bs] block ids
        (the slot columns are the dense cache's and unused here); in_place ("flat" or "blocks"):
        layers get the whole pool back in that layout, not their rows' keys (no read indices);
        window_tables [B', E]: what the layers `windowed_layer` names gather instead of tables."""
        if in_place not in IN_PLACE:
            raise ValueError(f"in_place is one of {IN_PLACE}, got {in_place!r}")
        if in_place and window_tables is not None:
            raise ValueError("window tables are gathered: a forward reading the pool in place takes none")
        size = self.block_size
        block = tables.gather(1, torch.div(positions, size, rounding_mode="floor"))  # [B', Q]
        self._write = block * size + positions % size
        self._read = None if in_place else tables
        self._window_read = window_tables
        self._in_place = in_place
        self._on_device = {}

    def upload(self, device: torch.device, key_length: int) -> int:
        """Before a forward (host), after its `place`s: the device tables catch up with the host's
        lists, holding at least `key_length` positions per slot. Only the entries changed since the
        last upload travel, in one copy (none when nothing changed). More slots or a wider table
        than the tensor holds reallocate it (captured graphs read its address: `generation`).
        -> entries sent."""
        self._fit_tables(device, blocks_for(key_length, self.block_size))
        if not self._changed:
            return 0
        slots, entries, ids = [], [], []
        for slot, first in self._changed.items():
            table, end = self._tables[slot], max(len(self._tables[slot]), self._uploaded[slot])
            if end > first:
                slots += [slot] * (end - first)
                entries += range(first, end)
                ids += table[first:end] + [SCRATCH] * (end - max(first, len(table)))
            self._uploaded[slot] = len(table)
        self._changed = {}
        if not slots:
            return 0
        host = torch.tensor([slots, entries, ids], dtype=torch.long)  # [3, changes]
        # pinned through torch's caching host allocator: reused only once this copy has read it
        changes = (host.pin_memory() if device.type == "cuda" else host).to(device, non_blocking=True)
        self._device_tables[changes[0], changes[1]] = changes[2]
        return len(slots)

    def whole_length(self) -> int:
        """K of a forward that reads the pool in place: its tables taken whole (at most the pool's
        blocks, all a row could hold), the same for every context length. It becomes the forward's
        key length (`get_seq_length`)."""
        self._view_length = min(self._device_tables.shape[1], self._num_blocks) * self.block_size
        return self._view_length

    def tables_of(self, slots: torch.Tensor, entries: int) -> torch.Tensor:
        """Inside a forward (device): slots [B'] (-1: a padding row, all scratch) -> their first
        `entries` table entries [B', entries] (scratch past each table's end)."""
        table = self._device_tables
        rows = torch.where(slots < 0, slots + table.shape[0], slots)  # -1: the last row, scratch
        return table.index_select(0, rows)[:, :entries]

    # -- accounting -------------------------------------------------------------------------
    def allocated(self) -> tuple[int, int]:
        """(blocks in use, scratch included; positions they hold): cached blocks nobody holds count
        as free (they are taken back when needed)."""
        used = self._num_blocks - len(self._free) - len(self._cached)
        return used, used * self.block_size

    @property
    def num_cached_blocks(self) -> int:
        """Registered blocks no request holds (reusable by a matching prefix until evicted)."""
        return len(self._cached)

    @property
    def num_registered_blocks(self) -> int:
        """Blocks that hold a registered prefix, held by a request or cached."""
        return len(self._hash_of)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._cached)

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    def bytes_per_position(self) -> int:
        """Bytes of keys and values one position holds over every layer allocated so far (0 before
        the first forward)."""
        return sum(t.shape[2] * t.shape[3] * t.element_size() for t in self._keys + self._values if t is not None)

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._stores())

    # -- internals --------------------------------------------------------------------------
    def _change(self, slot: int, first: int) -> None:
        """Entries from `first` on of slot's table changed: the next upload sends them."""
        self._changed[slot] = min(first, self._changed.get(slot, first))

    def _fit_tables(self, device: torch.device, entries: int) -> None:
        """The device tables, allocated or grown to every slot plus the scratch row and at least
        `entries` per slot (with a model length, M = its blocks from the start). Only tables
        changed since the last upload can have outgrown the tensor: the others are in it."""
        table = self._device_tables
        rows = len(self._tables) + 1
        width = max(entries, max((len(self._tables[slot]) for slot in self._changed), default=0),
                    blocks_for(self.max_model_len, self.block_size) if self.max_model_len else 1)
        if table is not None and table.device == device and table.shape[0] >= rows and table.shape[1] >= width:
            return
        if table is not None and table.device == device:  # grown by doubling what must grow
            old_rows, old_width = table.shape
            rows = old_rows if rows <= old_rows else max(rows, 2 * old_rows)
            width = old_width if width <= old_width else max(width, 2 * old_width)
        grown = torch.full((max(rows, TABLE_ROWS), width), SCRATCH, dtype=torch.long, device=device)
        if table is not None:
            kept = min(table.shape[0] - 1, grown.shape[0] - 1)  # (not the old scratch row)
            grown[:kept, : table.shape[1]] = table[:kept].to(device)
        self._device_tables = grown
        self.generation += 1

    def _take(self, count: int) -> list[int]:
        """count fresh blocks (referenced once): free ones, then the least recently used cached ones."""
        while count > len(self._free) and self._cached:
            self._evict(next(iter(self._cached)))  # (the least recently used)
        if count > len(self._free):
            wanted = self._num_blocks + count - len(self._free)
            if self.fixed or (self._limit is not None and wanted > self._limit):
                raise MemoryError(f"the KV pool is out of blocks: {count} wanted, {len(self._free)} free "
                                  f"of {self._num_blocks} (admission should have kept within it)")
            grown = max(self._num_blocks * 2, wanted)
            self._grow(grown if self._limit is None else min(grown, self._limit))
        taken = [self._free.pop() for _ in range(count)]
        for block in taken:
            self._refs[block] = 1
        return taken

    def _evict(self, block: int) -> None:
        """A cached block (registered, held by no table) is forgotten by the index and freed."""
        del self._cached[block]
        del self._index[self._hash_of.pop(block)]
        del self._content[block]
        self._free.append(block)

    def _hold(self, block: int) -> None:
        self._refs[block] += 1
        self._cached.pop(block, None)

    def _drop(self, block: int) -> None:
        """One table less holds the block: at none, it is cached (registered) or free."""
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self._hash_of:
                self._cached[block] = None
            else:
                self._free.append(block)

    def _stores(self) -> list[torch.Tensor]:
        """Every pool allocated so far, indexed by block first: keys, values, kept features."""
        return [t for t in (*self._keys, *self._values, self._features) if t is not None]

    def _copy_block(self, src: int, dst: int) -> None:
        self._fit_features()
        for store in self._stores():
            store[dst] = store[src]

    def _fit_features(self, like: torch.Tensor | None = None) -> torch.Tensor | None:
        """The features pool, allocated (F, dtype and device of `like` [n, F]) or grown to every
        block of the pool; None while none was kept and `like` is None."""
        store = self._features
        if store is None and like is None:
            return None
        if store is None or store.shape[0] < self._num_blocks:
            like = store if store is not None else like
            grown = like.new_zeros(self._num_blocks, self.block_size, like.shape[-1])
            if store is not None:
                grown[: store.shape[0]] = store
            self._features = store = grown
        return store

    def _grow(self, num_blocks: int) -> None:
        """More blocks (storage reallocated at the next forward, `_layer`)."""
        self._free = list(range(num_blocks - 1, self._num_blocks - 1, -1)) + self._free
        self._refs += [0] * (num_blocks - self._num_blocks)
        self._num_blocks = num_blocks

    def _flat(self, table: list[int], start: int, end: int) -> torch.Tensor:
        positions = torch.arange(start, end)
        blocks = torch.tensor(table, dtype=torch.long)[positions // self.block_size]
        return blocks * self.block_size + positions % self.block_size

    def _indices(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(write [B', Q], read [B', K / bs], window read [B', E]) on `device` (a sharded model's)."""
        bound = (self._write, self._read, self._window_read)
        if device == self._write.device:
            return bound
        if device not in self._on_device:
            self._on_device[device] = tuple(None if t is None else t.to(device) for t in bound)
        return self._on_device[device]

    def _layer(self, layer_idx: int, key_like: torch.Tensor, value_like: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's pools [N, bs, H, D] (D each of keys and values their own)."""
        while len(self._keys) <= layer_idx:
            self._keys.append(None)
            self._values.append(None)
        keys = self._keys[layer_idx]
        if keys is None or keys.shape[0] < self._num_blocks:
            new_keys, new_values = (like.new_zeros(self._num_blocks, self.block_size, like.shape[1], like.shape[3])
                                    for like in (key_like, value_like))
            if keys is not None:
                new_keys[: keys.shape[0]] = keys
                new_values[: keys.shape[0]] = self._values[layer_idx]
            self._keys[layer_idx], self._values[layer_idx] = new_keys, new_values
            self.generation += 1
        return self._keys[layer_idx], self._values[layer_idx]
