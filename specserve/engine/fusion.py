"""Fused kernels for captured forwards: a model's repeated blocks compiled once, shared by every layer.

A captured forward (`execution="graph"`) replays the kernels the eager model launches. Eager HF
decoder layers launch about forty each: an RMSNorm is six or seven elementwise kernels, rotary
embedding about ten, the MLP's activation two. Inside a CUDA graph each still costs a few
microseconds, so at batch 1 a 32-layer 7B model spends milliseconds on them beside the ~4 ms its
weights take to read: the likeliest cause of the gap between the engine's captured decoding and
HF's `torch.compile`d StaticCache decoding measured on an H100 (110 against 137 tok/s; not yet
measured with fusion). gpt-fast and vLLM compile the forward with inductor (which fuses those
chains) and capture the compiled kernels.

`BlockFusion` compiles the model's repeated blocks (regional compilation: the layers of its
largest `ModuleList` of one block class, `repeated_blocks`), not the whole forward:

- One compiled code serves every layer: parameters are graph inputs, so the 32 layers of a 7B
  model compile as one layer does, in seconds instead of minutes.
- Sizes are symbolic (`dynamic=True`), so one compile serves every batch bucket, width and key
  length; dynamo still specialises sizes of 1, so a model compiles for B' = 1 or more and Q = 1
  or more (and again for eager forwards whose keys are gathered, not views of the cache): a few
  times, not once per capture bucket.

Two things would still make a compiled layer layer-specific. The KV cache's `update` picks the
layer's storage by its index. And dynamo treats an integer module attribute (`layer_idx`) as a
constant. So:
- the runner keeps a dense cache stacked, every layer's keys in one tensor [L, S, H, C, D]
  (`SlotKVCache.stack_layers`), and hands the model its cache behind `OpaqueCache`, whose `update`
  indexes the stack with the layer's index as a number: compiled into the block, the write fused
  with the rotary embedding before it. Over a paged cache `update` runs outside the compiled code
  (a graph break: a layer compiles as the code before its cache write and the code after it; the
  write and the read of the rows' keys stay eager);
- within `active`, module integers are compiled as symbols (dynamo's
  `allow_unspec_int_on_nn_module`), and sizes that happen to be equal stay distinct symbols (no
  "duck shaping": a batch of 8 rows over 8 KV heads would otherwise compile a graph that only
  batches of 8 can take).

A graph break costs host time on every eager call, which a captured forward never pays; inside
a captured forward, the write kept out of the compiled code costs kernels of its own. On a CPU
(eager) the fused blocks measured no faster than the plain ones (docs/engine.md), so fusion is for
captured forwards only (`execution="fused-graph"`); CPU tests use it for equality. Logits equal the plain model's
up to float rounding (inductor may reorder a reduction). The promise is unchanged: the fused
target is the one that verifies, so a speculative engine's tokens are that target's own
(tests/test_fusion.py: the captured fused engine against the eager engine and HF's greedy).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.fx.experimental._config as shapes

# dynamo compiles a code object at most this many times (models × size specialisations)
RECOMPILE_LIMIT = 64


def repeated_blocks(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The model's decoder layers: the largest ModuleList whose children are all of one class,
    preferring the classes HF names as blocks not to split (`_no_split_modules`); None: none."""
    named = set(getattr(model, "_no_split_modules", None) or [])
    best, best_key = None, (False, 0)
    for module in model.modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) == 0:
            continue
        kinds = {type(child) for child in module}
        if len(kinds) != 1:
            continue
        key = (next(iter(kinds)).__name__ in named, len(module))
        if key > best_key:
            best, best_key = module, key
    return best


class OpaqueCache:
    """A runner's KV cache as compiled blocks see it: the same object (every attribute passes
    through), except for `update` (this layer's writes, its rows' keys back). Over stacked storage
    (engine/kv_cache.py, `stack_layers`) it is compiled with the block, one code for every layer;
    over anything else (a paged cache) it runs eagerly, between the block's two compiled halves."""

    def __init__(self, cache) -> None:
        self.inner = cache

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if getattr(self.inner, "stacked", False):
            return self.inner.update_in_stack(key_states, value_states, layer_idx)
        return self._eager_update(key_states, value_states, layer_idx, *args, **kwargs)

    @torch.compiler.disable
    def _eager_update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        return self.inner.update(key_states, value_states, layer_idx, *args, **kwargs)


class BlockFusion:
    def __init__(self, blocks: torch.nn.ModuleList, backend: str = "inductor") -> None:
        """blocks: a model's `repeated_blocks`. Compiles nothing yet: the first call within
        `active` does (one compile for all of them, per size specialisation)."""
        self.blocks = blocks
        self.plain = list(blocks)
        self.fused = [torch.compile(block, dynamic=True, backend=backend) for block in self.plain]
        self._opaque: OpaqueCache | None = None

    def variants(self) -> int | None:
        """Compiled variants of the blocks' code so far (dynamo's cache entries for it; None where
        this torch does not say). A few are expected (sizes of 1 specialised, gathered keys); one
        per layer would mean the layer's index was specialised, and past RECOMPILE_LIMIT the
        blocks would run uncompiled: a captured forward as slow as an eager one's kernels."""
        try:
            from torch._dynamo.eval_frame import _debug_get_cache_entry_list
            return len(_debug_get_cache_entry_list(type(self.plain[0]).forward.__code__))
        except Exception:  # (a private helper: absent or changed in some torch)
            return None

    def cache(self, cache) -> OpaqueCache:
        """`cache` as the fused blocks take it (one wrapper per cache object)."""
        if self._opaque is None or self._opaque.inner is not cache:
            self._opaque = OpaqueCache(cache)
        return self._opaque

    @contextmanager
    def active(self):
        """Within the block the model runs its fused blocks (on the host, around a forward or a
        captured loop; the plain blocks are back after)."""
        limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        with torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True, recompile_limit=limit), \
                shapes.patch(use_duck_shape=False):
            for i, block in enumerate(self.fused):
                self.blocks[i] = block
            try:
                yield
            finally:
                for i, block in enumerate(self.plain):
                    self.blocks[i] = block
