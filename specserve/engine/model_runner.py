"""Runs one HF causal LM over a batch of requests, each with its own KV cache slot.

The runner knows requests only by id: it maps ids to cache slots, and for every id remembers how
many leading positions of its slot hold valid keys. A call names, per row, where its new tokens
start; a start below the valid length rolls the row back, a start above it is a cache miss (the
caller must resend from `valid_length`), which is how a restarted worker rebuilds its caches from
the tokens the coordinator holds.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .kv_cache import SlotKVCache, capacity_for


class ForwardTiming(NamedTuple):
    """One model forward, for the cost model: tokens it processed, seconds, and whether it was a
    prefill (a backlog of known tokens, timed but kept out of the per-step cost fit)."""

    tokens: int
    seconds: float
    prefill: bool = False


@dataclass(frozen=True)
class RowInput:
    """One request's row in a call: its new tokens, written from position `start` on."""

    request_id: str
    start: int
    tokens: list[int]


class CacheMiss(RuntimeError):
    """The runner holds fewer valid positions for a request than a call assumed."""

    def __init__(self, request_id: str, valid_length: int, start: int) -> None:
        super().__init__(f"request {request_id!r}: cache holds {valid_length} tokens, call starts at {start}")
        self.request_id = request_id
        self.valid_length = valid_length
        self.start = start

    def __reduce__(self):  # survives pickling across processes (Ray)
        return (CacheMiss, (self.request_id, self.valid_length, self.start))


CALIBRATION_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, max_positions: int | None = None) -> None:
        self.model = model.eval()
        attn = getattr(model.config, "_attn_implementation", None) or "eager"
        if attn not in ("sdpa", "eager"):
            raise ValueError(f"attention implementation {attn!r} cannot take a per-row mask; load with sdpa or eager")
        _reject_sliding_window(model.config)
        self._float_mask = attn == "eager"
        self.device = model.get_input_embeddings().weight.device
        self.dtype = model.get_input_embeddings().weight.dtype
        limit = getattr(model.config, "max_position_embeddings", None)
        self.max_positions = min(p for p in (max_positions, limit) if p) if (max_positions or limit) else None
        self.cache = SlotKVCache(self.max_positions)
        self.token_map: torch.Tensor | None = getattr(model, "draft_token_map", None)  # [K] target ids, or None
        self._slot_of: dict[str, int] = {}
        self._valid: dict[str, int] = {}
        self._slot_owner: list[str] = []  # slot -> request id, dense
        self.last_forward_seconds = 0.0
        self.last_forward_tokens = 0
        self._forward_log: list[ForwardTiming] = []  # every forward since the log was last taken

    # -- bookkeeping ------------------------------------------------------------------------
    def valid_length(self, request_id: str) -> int:
        return self._valid.get(request_id, 0)

    def num_cached(self) -> int:
        return len(self._slot_of)

    def free(self, request_id: str) -> None:
        """Forget a request; the last live slot moves into its place so that live slots stay dense."""
        slot = self._slot_of.pop(request_id, None)
        freed_length = self._valid.pop(request_id, 0)
        if slot is None:
            return
        last = len(self._slot_owner) - 1
        if slot != last:
            moved = self._slot_owner[last]
            self.cache.move_slot(last, slot)
            self._slot_of[moved] = slot
            self._slot_owner[slot] = moved
        self._slot_owner.pop()
        self._maybe_shrink(freed_length)

    def _maybe_shrink(self, freed_length: int) -> None:
        """Give memory back once the live requests use under a quarter of the cache's allocation.
        O(1) unless a quarter of the slots emptied or the freed request was among the longest."""
        slots, positions = self.cache.allocated()
        live_slots = len(self._slot_owner)
        if live_slots * 4 >= slots and freed_length * 2 < positions:
            return
        live_positions = max(self._valid.values(), default=0) + 1
        if slots * positions and live_slots * live_positions * 4 < slots * positions:
            self.cache.shrink(max(live_slots, 1), live_positions)

    def _fit(self, needed: int) -> None:
        """Before the cache grows, drop what no live request uses (slots past the live ones, positions
        past the longest live row): its allocation stays within live slots x the capacity that the
        longest of them needs, which is what admission budgets."""
        slots, capacity = self.cache.allocated()
        live = len(self._slot_owner)
        if live <= slots and capacity_for(needed, self.max_positions) <= capacity:
            return  # no growth
        keep = max(needed, max(self._valid.values(), default=0))
        if slots > live or capacity > capacity_for(keep, self.max_positions):
            self.cache.shrink(live, keep)

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
    def forward(self, rows: list[RowInput], logits: str = "last") -> torch.Tensor | None:
        """Write every row's tokens into its cache and return logits.

        logits="last": [B, V'] at each row's last token; "all": [B, Q, V'] (Q = longest row; a
        shorter row's padded positions hold junk); "none": None. V' is the model's output size
        (K for a draft with a token map). Rows are right-padded; padding is written past a row's
        end, where the causal mask hides it and the next call overwrites it.
        """
        self.check(rows)
        lengths = [len(r.tokens) for r in rows]
        width = max(lengths)
        input_ids = torch.tensor([r.tokens + [0] * (width - n) for r, n in zip(rows, lengths)])  # [B, Q]
        starts = torch.tensor([r.start for r in rows], dtype=torch.long)  # [B]
        positions = starts[:, None] + torch.arange(width)[None, :]  # [B, Q]
        # a shorter row's padding all goes to the position just past its own tokens (junk the mask
        # hides), never past the longest row's end: the cache grows only as far as real rows need
        ends = starts + torch.tensor(lengths, dtype=torch.long)  # [B]
        positions = torch.minimum(positions, ends[:, None])
        if self.max_positions is not None:
            # Real tokens stay below max_positions - 1 (the caller's invariant); padding and
            # unused drafts past that all land on the last position, which nothing real attends.
            positions = positions.clamp(max=self.max_positions - 1)
        slots = torch.tensor([self._slot(r.request_id) for r in rows], dtype=torch.long)  # [B]
        self._fit(int(positions.max()) + 1)
        view_length = self.cache.prepare(slots, positions)
        mask = self._mask(positions, view_length)  # [B, 1, Q, K]
        keep = {"last": width, "all": width, "none": 1}[logits]
        began = time.perf_counter()
        out = self.model(
            input_ids=input_ids.to(self.device),
            position_ids=positions.to(self.device),
            attention_mask=mask,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=keep,
        ).logits  # [B, keep, V']
        for row, n in zip(rows, lengths):
            self._valid[row.request_id] = row.start + n
        if logits == "none":  # only prefills ask for no logits
            self._record(began, sum(lengths), prefill=True)
            return None
        if logits == "last":
            last = torch.tensor(lengths, device=out.device) - 1  # [B]
            out = out[torch.arange(len(rows), device=out.device), last]  # [B, V']
        self._record(began, sum(lengths), out)
        return out

    def time_forwards(self, sizes: tuple[int, ...] = CALIBRATION_SIZES) -> list[ForwardTiming]:
        """One forward of each size (tokens) after a short context, twice, keeping the faster:
        seeds a cost model. Sizes 1..8 cover the verify widths where a CPU's cost jumps most."""
        context = [0] * 16
        timings = []
        for n in sizes:
            best = float("inf")
            for _ in range(2):
                self.forward([RowInput("__calibrate__", 0, context)], logits="none")
                self.forward([RowInput("__calibrate__", len(context), [0] * n)], logits="last")
                best = min(best, self.last_forward_seconds)
            timings.append(ForwardTiming(n, best))
        self.free("__calibrate__")
        self.take_forward_log()
        return timings

    def _record(self, began: float, num_tokens: int, out: torch.Tensor | None = None, prefill: bool = False) -> None:
        if out is not None and out.is_cuda:
            torch.cuda.synchronize(out.device)
        self.last_forward_seconds = time.perf_counter() - began
        self.last_forward_tokens = num_tokens
        self._forward_log.append(ForwardTiming(num_tokens, self.last_forward_seconds, prefill))

    def take_forward_log(self) -> tuple[ForwardTiming, ...]:
        """Every forward since the last call, for the cost model."""
        log, self._forward_log = tuple(self._forward_log), []
        return log

    def _mask(self, positions: torch.Tensor, view_length: int) -> torch.Tensor:
        """positions [B, Q] -> [B, 1, Q, K]: key k is visible to a query at position p iff k <= p."""
        keys = torch.arange(view_length)[None, None, :]  # [1, 1, K]
        visible = (keys <= positions[:, :, None])[:, None]  # [B, 1, Q, K]
        if not self._float_mask:
            return visible.to(self.device)
        blocked = torch.finfo(self.dtype).min
        return torch.zeros(visible.shape, dtype=self.dtype).masked_fill(~visible, blocked).to(self.device)

    def map_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """Ids in the model's output space -> target vocabulary ids."""
        return ids if self.token_map is None else self.token_map.to(ids.device)[ids]


def _reject_sliding_window(config) -> None:
    layer_types = getattr(config, "layer_types", None) or []
    uses_window = any(t != "full_attention" for t in layer_types) or (
        getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None)
    )
    if uses_window:
        raise ValueError("models with sliding-window or non-attention layers are not supported yet")
