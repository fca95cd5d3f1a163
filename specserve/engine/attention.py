"""Grouped-query attention under a mask, without copying the cache once per query head.

HF's SDPA path, given a mask, grouped KV heads (GQA) and more than one query token, first expands
every KV head to its query heads (`repeat_kv`: a copy of the layer's whole key and value cache,
every layer, every forward) and then, on a CPU, runs SDPA's math kernel instead of the fused one.
A verify forward is exactly that case: γ+1 query tokens per row, a 4D mask, and (for most current
models) GQA. On SmolLM2-135M (9 query heads over 3 KV heads, one thread of this project's 2-core
CPU) this path alone cut a 5-token forward from 101.6 to 92.5 ms; the rest of the gap to a
1-token forward was the linears (engine/cpu_linear.py).

`grouped_sdpa` stacks the query heads of each group along the query axis instead:

    query [B, Hkv*G, Q, D] -> [B, Hkv, G*Q, D]     (head h = k*G + r; row r*Q + q)
    mask  [B, 1, Q, K]     -> [B, 1, G*Q, K]       (row r*Q + q is row q)

and runs one SDPA over the KV heads as they are, then undoes the stacking. Every query still
attends its own group's keys under its own row of the mask: the same attention, with no copy of
the cache and the fused kernel. Anything else (one group, no mask, a per-head mask, extra
arguments) goes to HF's own SDPA function unchanged.

`flex_sdpa` takes no materialised mask at all (`ModelRunner(attention="flex")`): the runner
builds one `BlockMask` per forward from the rows' query positions (`block_mask`: key k is visible
to query (b, q) iff k <= positions[b, q], the mask_mod reading the [B', Q] positions tensor), and
every layer runs FlexAttention under it with the KV heads as they are (`enable_gqa`). On a GPU
that is a fused kernel that skips key blocks past a row's end, instead of SDPA's math kernel over
a [B', 1, Q, K] mask; on a CPU (tests) it runs the eager reference, for equality only.

On a CPU, a paged cache's decode-width forwards under grouped SDPA read the pool in place through
a C kernel instead (engine/cpu_attention.py): `grouped_sdpa` is handed the pools and, in place of
the mask, the rows' positions and block tables.

Over a paged cache (engine/paged_cache.py) under flex, a decode-width forward reads the pool in place:
`pool_block_mask` lists each row's own blocks of the pool (its block table) and maps a pool
position back to the row's position, and every row attends over the one pool tensor
[1, Hkv, N * bs, D]. No keys are gathered, K is the pool's size (fixed while the pool is), and a
short row's kernel visits only its own blocks.

The functions are registered with HF's AttentionInterface under `NAME` and `FLEX_NAME`;
`ModelRunner` selects one for its own forwards only (`selected`), so the model behaves as before
for any other caller.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from . import cpu_attention
from .sharding import config_value

NAME = "specserve_grouped_sdpa"
FLEX_NAME = "specserve_flex"
_KV_BLOCK = 128  # FlexAttention's default sparse block, both axes
_compiled_flex: Callable | None = None


def grouped_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """query [B, Hq, Q, D], key/value [B, Hkv, K, D], attention_mask [B, 1, Q, K] -> ([B, Q, Hq, D], None).
    A paged pool read in place (attention_mask int64: the rows' reads; key/value the pools
    [N, bs, Hkv, D]) goes to the CPU kernel (engine/cpu_attention.py)."""
    if attention_mask is not None and attention_mask.dtype == torch.int64:
        return cpu_attention.attend(query, key, value, attention_mask, scaling), None
    groups = getattr(module, "num_key_value_groups", 1)
    # (query heads not a multiple of the keys': keys already expanded, as latent attention's are)
    plain = (groups == 1 or query.shape[1] != groups * key.shape[1]
             or attention_mask is None or attention_mask.dim() != 4 or attention_mask.shape[1] != 1
             or any(kwargs.get(k) is not None for k in ("position_bias", "softcap", "cache"))
             or kwargs.get("output_attentions", False))
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    batch, heads, width, _ = query.shape
    kv_heads = key.shape[1]
    stacked = query.reshape(batch, kv_heads, groups * width, query.shape[-1])  # [B, Hkv, G*Q, D]
    rows = attention_mask.shape[0]
    mask = attention_mask[:, :, None].expand(rows, 1, groups, width, attention_mask.shape[-1])
    mask = mask.reshape(rows, 1, groups * width, attention_mask.shape[-1])  # [B, 1, G*Q, K]
    out = F.scaled_dot_product_attention(stacked, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    out = out.reshape(batch, heads, width, value.shape[-1])  # [B, Hq, Q, D]
    return out.transpose(1, 2).contiguous(), None


def dispatches(model: torch.nn.Module) -> bool:
    """Whether the model's layers attend through transformers' attention interface (the function
    registered under `config._attn_implementation`, `_supports_attention_backend`), so that a
    function selected here reaches them. Some (Falcon, ...) branch on the name "sdpa" themselves:
    renamed, they took their eager branch and added a boolean mask to the scores."""
    from transformers import PreTrainedModel

    inner = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)  # (through wrappers)
    return bool(getattr(inner, "_supports_attention_backend", False))


FULL, SLIDING = "full_attention", "sliding_attention"  # HF's layer types (config.layer_types)


@dataclass(frozen=True)
class Windows:
    """Which keys a model's layers see besides the causal rule. window: how many of the latest
    positions a sliding-window layer attends, its query's own included (key k is visible to
    position p iff p - window < k <= p, HF's `sliding_window`); None where every layer attends
    its whole context. by_type: the model reads one mask per layer type (config.layer_types:
    Gemma 2 and 3, Qwen2 with use_sliding_window), else one mask for every layer (Mistral, Phi-3).
    sliding: by type, the indices of the windowed layers."""

    window: int | None = None
    by_type: bool = False
    every_layer: bool = True  # (with a window) no layer attends its whole context
    sliding: frozenset[int] = frozenset()

    def windowed(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` attends through the window."""
        return self.window is not None and (not self.by_type or layer_idx in self.sliding)

    @property
    def horizon(self) -> int | None:
        """How far back any layer reads: the window where every layer has it, else None (all)."""
        return self.window if self.every_layer else None

    def masks(self, build: Callable[[int | None], object]) -> object:
        """build(window or None) -> a forward's mask; -> what the model takes: that mask, or one
        per layer type."""
        if self.window is None:
            return build(None)
        if not self.by_type:
            return build(self.window)
        return {FULL: build(None), SLIDING: build(self.window)}


# model types whose layers read positions or the cache in a way the runner's per-row masks and
# caches cannot stand in for (each found giving transformers' own error at the first forward)
UNSUPPORTED = {
    "bloom": "builds its ALiBi biases from a 2-D padding mask, which the runner's per-row masks replace",
    "cpmant": "hands its cache keys and values in a layout of its own",
    "dory": "loops its layers over key and value states they share through transformers' cache layers",
    "hrm_text": "runs its layers in recurrent cycles over a cache of transformers' own kind",
}


def check_supported(config) -> None:
    """Refuse, naming the reason, a model whose attention the runner cannot serve as the model
    itself computes it (its config is all that is read)."""
    model_type = getattr(config, "model_type", None)
    if model_type in UNSUPPORTED:
        raise ValueError(f"{model_type} is not supported: it {UNSUPPORTED[model_type]}")
    if model_type == "falcon" and getattr(config, "alibi", False):
        raise ValueError(f"falcon with alibi is not supported: it {UNSUPPORTED['bloom']}")
    if "local" in (getattr(config, "attention_layers", None) or ()):
        raise ValueError("local attention layers that mask by their own causal buffer (GPT-Neo) are not supported")


# model types whose layers read the cache's keys in a way a paged cache's gathered keys (a view of
# blocks, [B', H, K, D] strided) cannot give: served with a dense cache only
UNPAGEABLE = {
    "gpt_neox_japanese": "views its cached keys as one contiguous [B * H, K, D] block",
}


def check_pageable(config) -> None:
    """Refuse a paged cache (`kv_block_size`) for a model listed in UNPAGEABLE, naming why."""
    model_type = getattr(config, "model_type", None)
    if model_type in UNPAGEABLE:
        raise ValueError(f"{model_type} cannot use a paged KV cache: it {UNPAGEABLE[model_type]}; "
                         "serve it without kv_block_size")


def windows_of(config, max_model_len: int | None) -> Windows:
    """A model's attention windows from its config; a window that reaches back past the context
    (max_model_len) hides nothing. Layers other than attention (linear attention, state spaces,
    chunked attention) are refused, as are configs whose layers set their attention apart."""
    types, window = config_value(config, "layer_types"), config_value(config, "sliding_window")
    if types:
        other = set(types) - {FULL, SLIDING}
        if other:
            raise ValueError(f"layers of type {sorted(other)} are not supported (full and sliding-window attention are)")
        if SLIDING not in types:
            return Windows()
    elif not window or getattr(config, "use_sliding_window", True) is False:
        return Windows()
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding-window layers need a positive sliding_window, got {window!r}")
    if max_model_len is not None and window >= max_model_len:
        return Windows()
    sliding = frozenset(i for i, kind in enumerate(types or ()) if kind == SLIDING)
    return Windows(window, by_type=bool(types), every_layer=not types or FULL not in types, sliding=sliding)


def block_mask(positions: torch.Tensor, key_length: int, window: int | None = None,
               start: torch.Tensor | None = None) -> BlockMask:
    """positions [B', Q] int64 (device) -> BlockMask over [B', 1, Q, K]: the key at position k is
    visible to query (b, q) iff k <= positions[b, q] (and, with a window, k > positions[b, q] -
    window); key j of row b is at position j, or start[b] + j ([B']: a windowed layer's keys
    gathered from where its window starts). One mask for every head and every layer it is handed to."""
    rows, width = positions.shape

    def at(b, k):
        return k if start is None else start[b] + k

    def visible(b, h, q, k):
        return at(b, k) <= positions[b, q]

    def recent(b, h, q, k):
        return (at(b, k) <= positions[b, q]) & (at(b, k) > positions[b, q] - window)

    return create_block_mask(visible if window is None else recent, rows, None, width, key_length,
                             device=positions.device, BLOCK_SIZE=(_query_block(positions), _KV_BLOCK))


def pool_block_mask(positions: torch.Tensor, tables: torch.Tensor, block_size: int, num_blocks: int,
                    scratch: int = 0, window: int | None = None) -> BlockMask:
    """positions [B', Q] int64, tables [B', T] block ids of a paged cache's pool (each row's own
    blocks, `scratch` elsewhere: past them, and before them once `forget` gave the oldest back;
    device) -> BlockMask over [B', 1, Q, N * bs]: the keys are the pool's positions where they lie
    (block k // bs, offset k % bs), not a gathered copy.
    Physical key k is visible to query (b, q) iff its block is row b's j-th and j * bs + k % bs
    <= positions[b, q] (and, with a window, > positions[b, q] - window); each row lists only its
    own blocks, so a short row's kernel skips the rest of the pool. Device ops on fixed shapes (a
    forward compiled or captured builds it)."""
    rows, entries = tables.shape
    width = positions.shape[1]
    device = tables.device
    # one table for the mask to read: [B', N + Q], per row its logical index of each pool block
    # (-1: not its own), then its queries' positions. (Inductor on a CPU finds no FlexAttention
    # kernel when the mask reads a tensor it would compute inline, as positions alone would be.)
    lookup = torch.full((rows, num_blocks + width), -1, dtype=torch.long, device=device)
    lookup[:, num_blocks:] = positions
    index = torch.arange(entries, device=device).expand(rows, entries)  # [B', T]
    lookup.scatter_(1, tables, torch.where(tables == scratch, -1, index))  # (scratch entries all write -1)
    listed = torch.zeros(rows, 1, 1, num_blocks, dtype=torch.int32, device=device)  # [B', 1, 1, N]
    if window is None:  # a row's own blocks first, then scratch
        listed[:, 0, 0, :entries] = tables.to(torch.int32)
    else:  # (own blocks first: a windowed row may have given its oldest back, scratch entries before them)
        own_first = torch.argsort((tables == scratch).to(torch.int8), dim=1, stable=True)  # [B', T]
        listed[:, 0, 0, :entries] = tables.gather(1, own_first).to(torch.int32)
    counts = (tables != scratch).sum(1, dtype=torch.int32).view(rows, 1, 1)  # [B', 1, 1]: own blocks

    def visible(b, h, q, k):
        j = lookup[b, k // block_size]
        return (j >= 0) & (j * block_size + k % block_size <= lookup[b, num_blocks + q])

    def recent(b, h, q, k):
        j = lookup[b, k // block_size]
        at, p = j * block_size + k % block_size, lookup[b, num_blocks + q]
        return (j >= 0) & (at <= p) & (at > p - window)

    return BlockMask.from_kv_blocks(counts, listed, BLOCK_SIZE=(_query_block(positions), block_size),
                                    mask_mod=visible if window is None else recent,
                                    seq_lengths=(width, num_blocks * block_size), compute_q_blocks=False)


def _query_block(positions: torch.Tensor) -> int:
    # Q is padded up to the query block. On a CPU under inductor (torch 2.13) a single query row
    # padded to 128 generates C++ that does not compile; a query block of one row does.
    return 1 if positions.shape[1] == 1 and positions.device.type == "cpu" else _KV_BLOCK


def flex_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: BlockMask, dropout: float = 0.0, scaling: float | None = None,
              **kwargs) -> tuple[torch.Tensor, None]:
    """query [B, Hq, Q, D], key/value [B, Hkv, K, D] (or a paged pool in place, [1, Hkv, N * bs, D],
    every row reading it), attention_mask the forward's `block_mask` or `pool_block_mask`
    -> ([B, Q, Hq, D], None). Inference only (no dropout). A model that soft-caps its attention
    logits (Gemma 2: `softcap`) gets them capped, softcap * tanh(score / softcap), as its eager
    attention does."""
    if not isinstance(attention_mask, BlockMask):
        raise ValueError(f"{type(module).__name__} hands its attention a tensor mask of its own making (as Doge's "
                         "dynamic masks do), which flex cannot take: serve it with attention 'mask'")
    if kwargs.get("s_aux") is not None:
        raise ValueError("this model's attention has sinks (gpt-oss), which attention='flex' does not take: "
                         "use attention='mask' with attn_implementation='eager'")
    cap = kwargs.get("softcap")

    def capped(score, b, h, q, k):
        return cap * torch.tanh(score / cap)

    out = _flex(query.device)(query, key, value, block_mask=attention_mask, scale=scaling, enable_gqa=True,
                              score_mod=capped if cap else None)
    return out.transpose(1, 2).contiguous(), None  # [B, Q, Hq, D]


def _flex(device: torch.device) -> Callable:
    """flex_attention as it should run here: inside a graph being compiled, the plain function
    (the graph's compiler fuses it; a nested torch.compile would not); eagerly on a GPU, compiled
    once (eager FlexAttention is a slow reference); eagerly on a CPU, the reference itself
    (compiling it costs seconds per shape, and CPU runs are for equality only)."""
    global _compiled_flex
    if torch.compiler.is_compiling() or device.type != "cuda":
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex


AttentionInterface.register(NAME, grouped_sdpa)
AttentionInterface.register(FLEX_NAME, flex_sdpa)


@contextmanager
def selected(model: torch.nn.Module, name: str | None):
    """Within the block, `model` attends through the function registered as `name` (None: its
    own); its own setting is restored after."""
    config = model.config
    before = getattr(config, "_attn_implementation", None)
    if name is None:
        yield
        return
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before
