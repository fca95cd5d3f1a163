"""ModelSource -> torch model / tokenizer. Heavy imports happen lazily, inside the process that loads."""
from __future__ import annotations

import torch

from specserve.config import AppConfig, HFSource, ModelSource, SmolLM2Source, TinySource


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def load_target(source: ModelSource, gpus: list[int] | None = None) -> torch.nn.Module:
    """gpus: CUDA ordinals this process may use (an HF checkpoint is sharded over them)."""
    if isinstance(source, TinySource):
        from .tiny import tiny_llama

        return tiny_llama(**source.model_dump(exclude={"kind"}))
    if isinstance(source, SmolLM2Source):
        from specserve.models.smollm2 import load_smollm2_target

        model, _ = load_smollm2_target(source.cache_dir, dtype=_dtype(source.dtype))
        return model
    return _load_hf(source, gpus or [])


def load_draft(source: ModelSource, gpus: list[int] | None = None) -> torch.nn.Module:
    if isinstance(source, SmolLM2Source):
        from specserve.models.smollm2 import load_smollm2_draft, load_smollm2_target

        target, _ = load_smollm2_target(source.cache_dir, dtype=_dtype(source.dtype))
        return load_smollm2_draft(target, source.cache_dir)  # keeps only the shared embedding
    return load_target(source, gpus)


def _load_hf(source: HFSource, gpus: list[int]) -> torch.nn.Module:
    if gpus:
        from specserve.engine.sharding import load_sharded

        budget = source.max_memory_per_gpu or {g: torch.cuda.get_device_properties(g).total_memory for g in gpus}
        return load_sharded(source.path, gpus, budget, source.dtype, source.kv_cache_headroom,
                            source.attn_implementation)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        source.path, dtype=_dtype(source.dtype), attn_implementation=source.attn_implementation,
        local_files_only=True,
    )
    return model.eval()


def load_tokenizer(config: AppConfig):
    """The tokenizer the ingress uses (the target's, unless config.tokenizer names a directory)."""
    from transformers import AutoTokenizer

    if config.tokenizer:
        return AutoTokenizer.from_pretrained(config.tokenizer, local_files_only=True)
    source = config.target
    if isinstance(source, TinySource):
        from .tiny import byte_tokenizer

        return byte_tokenizer()
    if isinstance(source, SmolLM2Source):
        from specserve.models.smollm2 import ensure_target_checkpoint

        return AutoTokenizer.from_pretrained(ensure_target_checkpoint(source.cache_dir))
    return AutoTokenizer.from_pretrained(source.path, local_files_only=True)
