"""Place a target model over the GPUs one worker was given (accelerate device_map), and load it there.

The plan is made from the model's config alone: a skeleton is built on the meta device (no
download, no weights), accelerate sizes every module, and decoder layers are placed whole, each on
exactly one device (`_no_split_modules`). Every device keeps `kv_cache_headroom` free for the
engine's KV cache and activations. A model that does not fit raises `ValueError` here, before a
single weight is read.

Placement is pipeline-style (layer i on one GPU, layer i+1 maybe on the next); accelerate's hooks
move activations across devices. This lets a model bigger than one GPU run; it does not make one
forward faster (the GPUs work one after the other). The engine's SlotKVCache allocates each
layer's storage on the device of that layer's keys, and ModelRunner puts its inputs on the
embedding's device, so a dispatched model needs nothing else from the engine.

Devices are local CUDA ordinals as torch sees them (after CUDA_VISIBLE_DEVICES), "cuda:N", or
"cpu" (tests). `cuda_ordinals` turns the GPU ids a scheduler such as Ray assigned into those.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

Device = int | str
GB = 1e9


# -- sizes ------------------------------------------------------------------------------------------
def dtype_bytes(dtype: torch.dtype | str) -> int:
    return _dtype(dtype).itemsize


def kv_cache_bytes_per_token(config, dtype: torch.dtype | str = torch.bfloat16, num_layers: int | None = None) -> int:
    """Bytes the KV cache takes per token: layers × kv heads × (key size + value size) × dtype bytes.

    num_layers: count only that many layers (e.g. those placed on one device); default all.
    """
    layers, kv_heads, _ = kv_shape(config)
    return (layers if num_layers is None else num_layers) * kv_heads * sum(kv_sizes(config)) * dtype_bytes(dtype)


def kv_shape(config) -> tuple[int, int, int | None]:
    """(layers, kv heads, head dim) of a model config's attention, its text config's for a
    multimodal one (AttributeError: the config does not say)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "kv_lora_rank", None):  # latent attention: one compressed head (`kv_sizes`)
        return text.num_hidden_layers, 1, text.kv_lora_rank
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    return text.num_hidden_layers, kv_heads, head_dim(text)


def kv_sizes(config) -> tuple[int | None, int | None]:
    """(key size, value size) per cached head. Latent attention (DeepSeek-V2/V3 and its kin: a
    `kv_lora_rank`) is cached as transformers runs it, compressed: one head of the latent
    (kv_lora_rank) as keys and the rotary part (qk_rope_head_dim) as values; every other
    attention, its head size for both."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "kv_lora_rank", None):
        return text.kv_lora_rank, text.qk_rope_head_dim
    size = head_dim(text)
    return size, size


def config_value(config, name: str, default=None):
    """`config.<name>`, else default. transformers' per-layer (heterogeneous) configs refuse a
    global read of what their layers set apart (a RuntimeError): such a config is refused here."""
    try:
        return getattr(config, name, default)
    except RuntimeError as e:
        raise ValueError(f"a config whose layers differ in {name} is not supported ({e})") from e


def head_dim(config) -> int | None:
    """A model config's attention head size: its `head_dim`, else hidden size / heads (None: the
    config names neither)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads, hidden = config_value(text, "num_attention_heads"), config_value(text, "hidden_size")
    return config_value(text, "head_dim") or (hidden // heads if heads and hidden else None)


def headroom_for_tokens(config, tokens: int, num_devices: int, dtype: torch.dtype | str = torch.bfloat16) -> int:
    """Per-device bytes to keep for `tokens` cached tokens (summed over all requests), assuming the
    layers are spread evenly: a device holds at most ceil(layers / devices) layers."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    per_device_layers = math.ceil(text.num_hidden_layers / max(num_devices, 1))
    return tokens * kv_cache_bytes_per_token(config, dtype, per_device_layers)


def parse_bytes(size: int | float | str) -> int:
    """80_000_000_000, "80GB" (decimal) or "80GiB" (binary) -> bytes."""
    if isinstance(size, str):
        from accelerate.utils import convert_file_size_to_int

        return int(convert_file_size_to_int(size.strip()))
    return int(size)


# -- the plan ---------------------------------------------------------------------------------------
def build_skeleton(config, dtype: torch.dtype | str = torch.bfloat16) -> torch.nn.Module:
    """The causal LM for `config` with every parameter on the meta device: costs no memory."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=_dtype(dtype))
    model.tie_weights()
    return model


def plan_device_map(
    config,
    devices: Sequence[Device],
    max_memory_per_device: int | str | Mapping[Device, int | str],
    dtype: torch.dtype | str = torch.bfloat16,
    kv_cache_headroom: int | float | str = 0.1,
    no_split_module_classes: Sequence[str] | None = None,
    *,
    balanced: bool = True,
) -> dict[str, Device]:
    """Module name -> device, every decoder layer whole on one of `devices`.

    max_memory_per_device: one budget for every device, or a budget per device (e.g. less on the
    GPU a draft shares). kv_cache_headroom: bytes (int or "4GB") kept free on every device, or a
    fraction (0 <= x < 1) of each device's budget; see `headroom_for_tokens`. balanced: spread the
    weights evenly over the devices (so every device keeps similar room for its layers' KV cache)
    rather than filling the first device first.

    Raises ValueError, before any weight is read, if the model does not fit.
    """
    from accelerate import infer_auto_device_map
    from accelerate.utils import compute_module_sizes

    if not devices:
        raise ValueError("no devices given")
    names = [_device(d) for d in devices]
    if len(set(names)) != len(names):
        raise ValueError(f"devices repeat: {list(devices)}")
    budgets = _budgets(names, max_memory_per_device)
    headroom = {d: _headroom(kv_cache_headroom, budgets[d]) for d in names}
    usable = {d: budgets[d] - headroom[d] for d in names}
    for d in names:
        if usable[d] <= 0:
            raise ValueError(
                f"device {d!r}: KV-cache headroom {headroom[d] / GB:.1f} GB leaves nothing of its "
                f"{budgets[d] / GB:.1f} GB budget"
            )

    model = build_skeleton(config, dtype)
    no_split = sorted(set(getattr(model, "_no_split_modules", None) or []) | set(no_split_module_classes or []))
    sizes = compute_module_sizes(model, dtype=_dtype(dtype))
    total = sizes[""]
    if total > sum(usable.values()):
        raise ValueError(_no_fit_message(total, budgets, headroom, dtype, None))

    def infer(limits: dict[Device, int]) -> dict[str, Device]:
        with _quiet_accelerate():  # planning for GPUs this host lacks is fine: no "not available" noise
            return infer_auto_device_map(
                model, max_memory=limits, no_split_module_classes=no_split, dtype=_dtype(dtype)
            )

    plan = infer(dict(usable))  # fills the devices in order
    if balanced and len(names) > 1 and not _misplaced(plan, names):
        # Smallest equal cap that still fits, so every device keeps similar room for its layers' cache.
        low, high = math.ceil(total / len(names)), max(usable.values())
        while high - low > max(total // 1000, 1 << 20):
            cap = (low + high) // 2
            trial = infer({d: min(usable[d], cap) for d in names})
            if _misplaced(trial, names):
                low = cap
            else:
                high, plan = cap, trial
    stray = _misplaced(plan, names)
    if stray:
        raise ValueError(_no_fit_message(total, budgets, headroom, dtype, stray))
    return plan


def placed_bytes(config, plan: Mapping[str, Device], dtype: torch.dtype | str = torch.bfloat16) -> dict[Device, int]:
    """Parameter + buffer bytes each device receives under `plan` (from the meta skeleton)."""
    from accelerate.utils import compute_module_sizes

    model = build_skeleton(config, dtype)
    sizes = compute_module_sizes(model, dtype=_dtype(dtype))
    out: dict[Device, int] = {}
    for name, device in plan.items():
        out[device] = out.get(device, 0) + sizes[name]
    return out


# -- loading ----------------------------------------------------------------------------------------
def load_sharded(
    path: str | os.PathLike,
    devices: Sequence[Device],
    max_memory_per_device: int | str | Mapping[Device, int | str],
    dtype: torch.dtype | str = torch.bfloat16,
    kv_cache_headroom: int | float | str = 0.1,
    attn_implementation: str = "sdpa",
    no_split_module_classes: Sequence[str] | None = None,
) -> torch.nn.Module:
    """Load a causal LM from a local checkpoint folder, sharded over `devices` (never downloads).

    The plan is checked first (see plan_device_map), so a model that cannot fit fails fast.
    The returned model is in eval mode; `model.hf_device_map` holds the placement.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a local checkpoint folder (downloads are not allowed)")
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    plan = plan_device_map(config, devices, max_memory_per_device, dtype, kv_cache_headroom, no_split_module_classes)
    model = AutoModelForCausalLM.from_pretrained(
        folder, config=config, device_map=plan, dtype=_dtype(dtype),
        attn_implementation=attn_implementation, local_files_only=True,
    )
    return model.eval()


def cuda_ordinals(assigned_gpu_ids: Sequence[int | str], environ: Mapping[str, str] | None = None) -> list[int]:
    """GPU ids a scheduler assigned (e.g. `ray.get_gpu_ids()`) -> the CUDA ordinals torch uses.

    When CUDA_VISIBLE_DEVICES is set (Ray sets it to the assigned ids for an actor with num_gpus),
    torch numbers the visible GPUs 0..n-1 in that order, so an assigned id maps to its index in
    that list. When it is unset, the ids are already ordinals.
    """
    env = os.environ if environ is None else environ
    visible = env.get("CUDA_VISIBLE_DEVICES")
    ids = [str(i).strip() for i in assigned_gpu_ids]
    if visible is None:
        return [int(i) for i in ids]
    order = [v.strip() for v in visible.split(",") if v.strip()]
    missing = [i for i in ids if i not in order]
    if missing:
        raise ValueError(f"assigned GPUs {missing} are not in CUDA_VISIBLE_DEVICES={visible!r}")
    return [order.index(i) for i in ids]


# -- internals --------------------------------------------------------------------------------------
def _dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return value


def _device(device: Device) -> Device:
    """accelerate's device names: CUDA ordinals as ints, "cpu" as is."""
    if isinstance(device, torch.device):
        device = str(device)
    if isinstance(device, int):
        return device
    text = str(device).strip()
    if text.isdigit():
        return int(text)
    if text.startswith("cuda:") and text[5:].isdigit():
        return int(text[5:])
    if text == "cuda":
        return 0
    if text == "cpu":
        return "cpu"
    raise ValueError(f"unsupported device {device!r}: give CUDA ordinals, 'cuda:N' or 'cpu'")


def _budgets(names: list[Device], budget) -> dict[Device, int]:
    if isinstance(budget, Mapping):
        given = {_device(k): parse_bytes(v) for k, v in budget.items()}
        missing = [d for d in names if d not in given]
        if missing:
            raise ValueError(f"no memory budget for devices {missing}")
        return {d: given[d] for d in names}
    return {d: parse_bytes(budget) for d in names}


def _headroom(headroom: int | float | str, budget: int) -> int:
    if isinstance(headroom, float):
        if not 0.0 <= headroom < 1.0:
            raise ValueError(f"a fractional kv_cache_headroom must lie in [0, 1), got {headroom}")
        return int(headroom * budget)
    value = parse_bytes(headroom)
    if value < 0:
        raise ValueError("kv_cache_headroom must be >= 0")
    return value


@contextlib.contextmanager
def _quiet_accelerate():
    log = logging.getLogger("accelerate.utils.modeling")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _misplaced(plan: Mapping[str, Device], names: list[Device]) -> dict[str, Device]:
    return {module: device for module, device in plan.items() if device not in names}


def _no_fit_message(total: int, budgets, headroom, dtype, stray: Mapping[str, Device] | None) -> str:
    usable = sum(budgets[d] - headroom[d] for d in budgets)
    per = ", ".join(f"{d}: {budgets[d] / GB:.1f} GB - {headroom[d] / GB:.1f} GB headroom" for d in budgets)
    text = (
        f"the model does not fit: its {_dtype(dtype)} weights need {total / GB:.1f} GB, the devices give "
        f"{usable / GB:.1f} GB after KV-cache headroom ({len(budgets)} device(s): {per})"
    )
    if stray:
        modules = list(stray)
        shown = ", ".join(modules[:3]) + (f" and {len(modules) - 3} more" if len(modules) > 3 else "")
        text += (
            f"; {len(modules)} module(s) would spill to {sorted(set(map(str, stray.values())))}: {shown}. "
            "Decoder layers are never split over devices, so per-device room matters too"
        )
    return text + ". Give more or larger GPUs, a smaller dtype, or less headroom."
