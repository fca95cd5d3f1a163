"""A batch of per-request KV caches with per-row lengths, in the shape HF attention layers expect.

Storage per layer: keys/values [S, H, C, D] (S slots, H kv heads, C capacity, D head dim). Every
request owns one slot; each forward writes row b's new keys at its own positions, so rows of
different lengths share one forward pass. Rolling a row back is free: the next forward simply
writes from the row's accepted length on, and the causal mask (a key is visible to a query only if
its position is <= the query's) hides whatever stale entries lie beyond (gpt-fast's trick, per row).

The object is passed to a HF model as `past_key_values`; HF calls `update(keys, values, layer_idx)`
in every attention layer. Before each forward the runner calls `prepare(slots, write_positions)`.
Layers are allocated lazily on the device of their keys, so a model sharded with accelerate works.
"""
from __future__ import annotations

import torch

_CAPACITY_STEP = 256  # grow the position dimension in chunks of this many tokens


def capacity_for(positions: int, max_positions: int | None = None) -> int:
    """Positions a slot's storage is allocated for when it must hold `positions` of them: the one
    rounding rule that the cache and admission (which budgets what the cache really allocates) share."""
    grown = -(-max(positions, 1) // _CAPACITY_STEP) * _CAPACITY_STEP
    return grown if max_positions is None else min(grown, max_positions)


class SlotKVCache:
    def __init__(self, max_positions: int | None = None) -> None:
        self.max_positions = max_positions
        self._keys: list[torch.Tensor | None] = []  # per layer [S, H, C, D]
        self._values: list[torch.Tensor | None] = []
        self._num_slots = 0  # rows S every layer is (or will be) sized for
        self._capacity = 0  # positions C every layer is (or will be) sized for
        self._slots: torch.Tensor | None = None  # [B] slot of each row of the current forward
        self._write_positions: torch.Tensor | None = None  # [B, Q] where each new token goes
        self._view_length = 0  # K: key positions the current forward attends over
        self._contiguous = False  # rows are slots 0..B-1 in order (no gather needed)
        self._on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # slots, positions per device

    # -- HF Cache duck-typing -------------------------------------------------------------
    is_compileable = False

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._view_length

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """key_states/value_states [B, H, Q, D] -> all keys/values of the batch rows [B, H, K, D]."""
        keys, values = self._layer(layer_idx, key_states)
        slots, positions = self._indices(keys.device)  # [B, 1], [B, Q]
        keys[slots, :, positions] = key_states.transpose(1, 2).to(keys.dtype)  # indexed view [B, Q, H, D]
        values[slots, :, positions] = value_states.transpose(1, 2).to(values.dtype)
        if self._contiguous:
            batch = slots.shape[0]
            return keys[:batch, :, : self._view_length], values[:batch, :, : self._view_length]
        return keys[slots[:, 0], :, : self._view_length], values[slots[:, 0], :, : self._view_length]

    # -- runner API -----------------------------------------------------------------------
    def prepare(self, slots: torch.Tensor, write_positions: torch.Tensor) -> int:
        """Set up the next forward. slots [B] int64, write_positions [B, Q] int64. Returns K."""
        needed = int(write_positions.max()) + 1
        if self.max_positions is not None and needed > self.max_positions:
            raise ValueError(f"position {needed - 1} is beyond the cache limit of {self.max_positions} tokens")
        self._num_slots = max(self._num_slots, int(slots.max()) + 1)
        if needed > self._capacity:
            self._capacity = capacity_for(needed, self.max_positions)
        self._slots = slots
        self._write_positions = write_positions
        self._on_device = {}
        self._view_length = needed
        self._contiguous = bool(torch.equal(slots.cpu(), torch.arange(slots.shape[0])))
        return needed

    def _indices(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """This forward's slots [B, 1] and write positions [B, Q] on `device`, copied once per device."""
        if device not in self._on_device:
            self._on_device[device] = (self._slots.to(device)[:, None], self._write_positions.to(device))
        return self._on_device[device]

    def move_slot(self, src: int, dst: int) -> None:
        """Copy slot src's cache into slot dst (used to keep live slots dense after a free)."""
        for keys, values in zip(self._keys, self._values):
            if keys is not None and src < keys.shape[0]:
                keys[dst].copy_(keys[src])
                values[dst].copy_(values[src])

    def allocated(self) -> tuple[int, int]:
        """(slots, positions) the storage is sized for."""
        return self._num_slots, self._capacity

    def shrink(self, num_slots: int, num_positions: int) -> None:
        """Reallocate every layer to hold only the first `num_slots` slots and `num_positions`
        positions (rounded up to the growth step), copying what they hold: memory follows the live
        requests down again after a burst of many or long ones."""
        capacity = capacity_for(num_positions)
        num_slots, capacity = min(num_slots, self._num_slots), min(capacity, self._capacity)
        for i, (keys, values) in enumerate(zip(self._keys, self._values)):
            if keys is not None:
                self._keys[i] = keys[:num_slots, :, :capacity].clone()
                self._values[i] = values[:num_slots, :, :capacity].clone()
        self._num_slots, self._capacity = num_slots, capacity

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._keys + self._values if t is not None)

    def _layer(self, layer_idx: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's storage, allocated or grown to [S, H, C, D] as the last prepare() asked."""
        while len(self._keys) <= layer_idx:
            self._keys.append(None)
            self._values.append(None)
        keys = self._keys[layer_idx]
        _, heads, _, head_dim = like.shape
        if keys is None or keys.shape[0] < self._num_slots or keys.shape[2] < self._capacity:
            shape = (self._num_slots, heads, self._capacity, head_dim)
            new_keys = like.new_zeros(shape)
            new_values = like.new_zeros(shape)
            if keys is not None:
                old_slots, _, old_capacity, _ = keys.shape
                new_keys[:old_slots, :, :old_capacity] = keys
                new_values[:old_slots, :, :old_capacity] = self._values[layer_idx]
            self._keys[layer_idx], self._values[layer_idx] = new_keys, new_values
        return self._keys[layer_idx], self._values[layer_idx]
