"""A batch of per-request KV caches with per-row lengths, in the shape HF attention layers expect.

Storage per layer: keys/values [S, H, C, D] (S slots, H kv heads, C capacity, D head dim). Every
request owns one slot; each forward writes row b's new keys at its own positions, so rows of
different lengths share one forward pass. Rolling a row back is free: the next forward simply
writes from the row's accepted length on, and the causal mask (a key is visible to a query only if
its position is <= the query's) hides whatever stale entries lie beyond (gpt-fast's trick, per row).

The last slot S-1 is scratch: no request owns it, and the padded rows of a forward (a batch padded
up to its capture bucket) write there. A compiled or captured forward attends over K =
capacity_for(longest row) key positions, a length that changes once per 256 tokens rather than every
step, so that shapes stay fixed per capture bucket; an eager one over the longest row rounded up
to `key_step` (the runner's `EAGER_KEY_STEP`).

Reading the keys of a forward's rows is free when its rows are slots 0..B'-1 in order (the runner
sorts its rows by slot, and live slots are dense, so a forward over every live request is such a
prefix): `update` returns a view of the first B' slots. Any other set of rows (a prefill of a few
new requests) gathers its slots, a copy per layer.

The object is passed to a HF model as `past_key_values`; HF calls `update(keys, values, layer_idx)`
in every attention layer. Before each forward the runner calls `reserve` (host integers only) and,
inside the forward, `bind` (device index tensors). Layers are allocated lazily on the device of
their keys, so a model sharded with accelerate works; each device gets its own copy of the indices.

Stacked (`stack_layers`; a runner whose blocks are compiled, on one device): every layer's keys
live in one tensor [L, S, H, C, D] (and values in another), allocated by `reserve`, before the
forward, and `_keys[i]` are its views. Compiled blocks then write and read a layer's storage
through the layer's index as a number (`update_in_stack`): one compiled code serves every layer,
with the cache write inside it (fused with the rotary embedding that precedes it) rather than an
eager call between two compiled halves. The price: a growth copies the whole stack at once, so it
needs the old and the new storage side by side (a cache sized up front never grows).
"""
from __future__ import annotations

import torch

CAPACITY_STEP = 256  # grow the position dimension in chunks of this many tokens


def key_length_for(positions: int, step: int, max_model_len: int | None = None) -> int:
    """K a forward attends over when its rows need `positions`: rounded up to `step` (the growth
    step where shapes must stay fixed for compiled or captured forwards; finer in eager mode, where
    every key position past a row's end is attention work for nothing), capped at max_model_len."""
    rounded = -(-max(positions, 1) // step) * step
    return rounded if max_model_len is None else min(rounded, max_model_len)


def capacity_for(positions: int, max_model_len: int | None = None) -> int:
    """Positions a slot's storage is allocated for when it must hold `positions` of them: the one
    rounding rule that the cache, the key length of a forward and admission (which budgets what
    the cache really allocates) share."""
    grown = -(-max(positions, 1) // CAPACITY_STEP) * CAPACITY_STEP
    return grown if max_model_len is None else min(grown, max_model_len)


class SlotKVCache:
    def __init__(self, max_model_len: int | None = None, key_step: int = CAPACITY_STEP) -> None:
        self.max_model_len = max_model_len
        self.key_step = key_step  # K's rounding (`key_length_for`)
        self._keys: list[torch.Tensor | None] = []  # per layer [S, H, C, D]
        self._values: list[torch.Tensor | None] = []
        self._num_slots = 0  # slots S every layer is (or will be) sized for, scratch included
        self._capacity = 0  # positions C every layer is (or will be) sized for
        self._built = (0, 0)  # (S, C) every layer was last seen at after a forward
        self.generation = 0  # bumped whenever storage moves (captured graphs hold its addresses)
        self._write_slots: torch.Tensor | None = None  # [B'] slot each row writes to (scratch for padding)
        self._positions: torch.Tensor | None = None  # [B', Q] where each new token goes
        self._read_slots: torch.Tensor | None = None  # [B'] slots to gather, or None: the first B' slots
        self._view_length = 0  # K: key positions the current forward attends over
        self._on_device: dict[torch.device, tuple] = {}  # indices copied to other devices (sharded models)
        self._stacking: tuple | None = None  # (L, H, D, dtype, device) of stacked storage (`stack_layers`)
        self._stack: tuple[torch.Tensor, torch.Tensor] | None = None  # keys, values [L, S, H, C, D]

    # -- HF Cache duck-typing -------------------------------------------------------------
    is_compileable = False

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._view_length

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """key_states/value_states [B', H, Q, D] -> keys/values of the batch rows [B', H, K, D]."""
        keys, values = self._layer(layer_idx, key_states, value_states)
        if self._stack is not None:
            return self.update_in_stack(key_states, value_states, layer_idx)
        write_slots, positions, read_slots = self._indices(keys.device)  # [B', 1], [B', Q], [B'] or None
        keys[write_slots, :, positions] = key_states.transpose(1, 2).to(keys.dtype)  # indexed view [B', Q, H, D]
        values[write_slots, :, positions] = value_states.transpose(1, 2).to(values.dtype)
        return self._rows(keys, values, positions.shape[0], read_slots)

    def update_in_stack(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`update` over stacked storage, allocated already (`reserve`), in code that compiles
        once for every layer: the layer is an index tensor in the write (an integer would select
        a view of the stack, and compiled code copies a view whole to write into it) and a
        number in the read. key_states/value_states [B', H, Q, D] -> [B', H, K, D]."""
        keys, values = self._stack  # [L, S, H, C, D]
        write_slots, positions, read_slots = self._write_slots, self._positions, self._read_slots
        layer = write_slots * 0 + layer_idx  # [B', 1]
        keys[layer, write_slots, :, positions] = key_states.transpose(1, 2).to(keys.dtype)  # [B', Q, H, D]
        values[layer, write_slots, :, positions] = value_states.transpose(1, 2).to(values.dtype)
        return self._rows(keys.select(0, layer_idx), values.select(0, layer_idx), positions.shape[0], read_slots)

    def _rows(self, keys: torch.Tensor, values: torch.Tensor, batch: int, read_slots: torch.Tensor | None):
        """A layer's storage [S, H, C, D] -> its forward's B' rows [B', H, K, D]: a view of the
        first B' slots (read_slots None), else those slots gathered."""
        length = self._view_length
        if read_slots is None:
            return keys[:batch, :, :length], values[:batch, :, :length]
        return keys[read_slots, :, :length], values[read_slots, :, :length]

    @property
    def stacked(self) -> bool:
        """Whether every layer's storage is one stacked tensor, allocated (`stack_layers`)."""
        return self._stack is not None

    # -- runner API -----------------------------------------------------------------------
    def stack_layers(self, num_layers: int, heads: int, head_dim: int, dtype: torch.dtype,
                     device: torch.device | str) -> None:
        """From the next `reserve` on, keep the `num_layers` layers' keys and values stacked, each
        [L, S, H, C, D] (see the module docstring), copying what the layers already hold."""
        self._stacking = (num_layers, heads, head_dim, dtype, torch.device(device))
        if self._capacity:
            self._grow_stack()

    @property
    def scratch_slot(self) -> int:
        return self._num_slots - 1

    def reserve(self, num_slots: int, needed_positions: int) -> int:
        """Before a forward (host integers; stacked storage is allocated here too): make room for
        `num_slots` owned or padded slots plus the scratch slot, and for `needed_positions`.
        Returns K, the key length to attend over."""
        if self.max_model_len is not None and needed_positions > self.max_model_len:
            raise ValueError(
                f"position {needed_positions - 1} is beyond the cache limit of {self.max_model_len} tokens")
        self._num_slots = max(self._num_slots, num_slots + 1)
        self._capacity = max(self._capacity, capacity_for(needed_positions, self.max_model_len))
        self._view_length = key_length_for(needed_positions, self.key_step, self.max_model_len)
        if self._stacking is not None and (self._stack is None or not self.ready):
            self._grow_stack()  # (stacked storage is allocated here, not inside the forward)
        return self._view_length

    @property
    def ready(self) -> bool:
        """Every layer already holds what the last `reserve` asked for: a forward allocates nothing
        (so it can be compiled or captured)."""
        return self._built[0] >= self._num_slots and self._built[1] >= self._capacity

    def built(self) -> None:
        """After a forward: every layer has been brought to the reserved size."""
        self._built = (self._num_slots, self._capacity)

    def bind(self, write_slots: torch.Tensor, positions: torch.Tensor, read_slots: torch.Tensor | None,
             tables: torch.Tensor | None = None, in_place: str | None = None,
             window_tables: torch.Tensor | None = None) -> None:
        """Inside a forward (device tensors): write_slots [B'] int64, positions [B', Q] int64,
        read_slots [B'] int64 or None when the rows are slots 0..B'-1 (tables, in_place,
        window_tables: a paged cache's)."""
        if in_place or window_tables is not None:
            raise ValueError("only a paged cache is read in place or through window tables")
        self._write_slots = write_slots[:, None]
        self._positions = positions
        self._read_slots = read_slots
        self._on_device = {}

    def _indices(self, device: torch.device) -> tuple:
        """This forward's write slots [B', 1], positions [B', Q], read slots on `device`: the bound
        tensors themselves on their own device, a copy made once per forward on any other."""
        if device == self._positions.device:
            return self._write_slots, self._positions, self._read_slots
        if device not in self._on_device:
            reads = None if self._read_slots is None else self._read_slots.to(device)
            self._on_device[device] = (self._write_slots.to(device), self._positions.to(device), reads)
        return self._on_device[device]

    def move_slot(self, src: int, dst: int) -> None:
        """Copy slot src's cache into slot dst (used to keep live slots dense after a free)."""
        for keys, values in zip(self._keys, self._values):
            if keys is not None and src < keys.shape[0]:
                keys[dst].copy_(keys[src])
                values[dst].copy_(values[src])

    def copy_positions(self, src: int, dst: int, start: int, end: int) -> None:
        """Copy positions [start, end) of slot src into slot dst (a fork of a request's cache, or
        what a fork drafted, back), growing every allocated layer first when dst lies past its
        slots (the scratch slot moves up)."""
        self._num_slots = max(self._num_slots, dst + 2)  # dst, then scratch
        if self._stack is not None and not self.ready:
            self._grow_stack()
        for i, keys in enumerate(self._keys):
            if keys is None:
                continue
            if keys.shape[0] < self._num_slots:
                self._grow(i, keys, self._values[i])
            for store in (self._keys[i], self._values[i]):
                store[dst, :, start:end] = store[src, :, start:end]

    def allocated(self) -> tuple[int, int]:
        """(slots, positions) the storage is sized for, the scratch slot included."""
        return self._num_slots, self._capacity

    def shrink(self, num_slots: int, num_positions: int) -> None:
        """Reallocate every layer to hold only the first `num_slots` slots (plus scratch) and
        `num_positions` positions (rounded up to the growth step), copying what they hold: memory
        follows the live requests down again after a burst of many or long ones."""
        capacity = min(capacity_for(num_positions), self._capacity)
        num_slots = min(num_slots + 1, self._num_slots)
        if self._stack is not None:
            self._stack = tuple(s[:, :num_slots, :, :capacity].clone() for s in self._stack)
            self._keys, self._values = list(self._stack[0].unbind(0)), list(self._stack[1].unbind(0))
        else:
            for i, (keys, values) in enumerate(zip(self._keys, self._values)):
                if keys is not None:
                    self._keys[i] = keys[:num_slots, :, :capacity].clone()
                    self._values[i] = values[:num_slots, :, :capacity].clone()
        self._num_slots, self._capacity = num_slots, capacity
        self._built = (num_slots, capacity)
        self.generation += 1

    def memory_bytes(self) -> int:
        if self._stack is not None:
            return sum(s.numel() * s.element_size() for s in self._stack)
        return sum(t.numel() * t.element_size() for t in self._keys + self._values if t is not None)

    def _layer(self, layer_idx: int, key_like: torch.Tensor, value_like: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's storage, allocated or grown to [S, H, C, D] as the last reserve() asked
        (D each of keys and values their own: latent attention's differ)."""
        if self._stack is not None:
            if not self.ready:
                self._grow_stack()
            return self._keys[layer_idx], self._values[layer_idx]
        while len(self._keys) <= layer_idx:
            self._keys.append(None)
            self._values.append(None)
        keys = self._keys[layer_idx]
        if keys is None or keys.shape[0] < self._num_slots or keys.shape[2] < self._capacity:
            self._grow(layer_idx, key_like, value_like)
        return self._keys[layer_idx], self._values[layer_idx]

    def _grow(self, layer_idx: int, key_like: torch.Tensor, value_like: torch.Tensor) -> None:
        keys, values = self._keys[layer_idx], self._values[layer_idx]
        new_keys, new_values = (like.new_zeros(self._num_slots, like.shape[1], self._capacity, like.shape[3])
                                for like in (key_like, value_like))
        if keys is not None:
            old_slots, _, old_capacity, _ = keys.shape
            # The old scratch slot (its last) is copied too: harmless, nobody reads it.
            new_keys[:old_slots, :, :old_capacity] = keys
            new_values[:old_slots, :, :old_capacity] = values
        self._keys[layer_idx], self._values[layer_idx] = new_keys, new_values
        self.generation += 1

    def _grow_stack(self) -> None:
        """(Re)allocate stacked storage at the reserved size, copying what every layer holds."""
        layers, heads, head_dim, dtype, device = self._stacking
        shape = (layers, self._num_slots, heads, self._capacity, head_dim)
        stacks = (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for stack, held in zip(stacks, (self._keys, self._values)):
            for i, layer in enumerate(held):
                if layer is not None:
                    slots, _, capacity, _ = layer.shape
                    stack[i, :slots, :, :capacity] = layer
        self._stack = stacks
        self._keys, self._values = list(stacks[0].unbind(0)), list(stacks[1].unbind(0))
        self._built = (self._num_slots, self._capacity)
        self.generation += 1
