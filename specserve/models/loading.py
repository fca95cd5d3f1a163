"""ModelSource -> torch model / tokenizer. Heavy imports happen lazily, inside the process that loads."""
from __future__ import annotations

import torch

from specserve.config import AppConfig, HFSource, ModelSource, SmolLM2Source, TinySource


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def load_target(source: ModelSource) -> torch.nn.Module:
    if isinstance(source, TinySource):
        from .tiny import tiny_llama

        return tiny_llama(**source.model_dump(exclude={"kind"}))
    if isinstance(source, SmolLM2Source):
        from specserve.models.smollm2 import load_smollm2_target

        model, _ = load_smollm2_target(source.cache_dir, dtype=_dtype(source.dtype))
        return model
    return _load_hf(source)


def load_draft(source: ModelSource) -> torch.nn.Module:
    if isinstance(source, SmolLM2Source):
        from specserve.models.smollm2 import load_smollm2_draft, load_smollm2_target

        target, _ = load_smollm2_target(source.cache_dir, dtype=_dtype(source.dtype))
        return load_smollm2_draft(target, source.cache_dir)  # keeps only the shared embedding
    return load_target(source)


def _load_hf(source: HFSource) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    max_memory = None
    if source.max_memory:
        max_memory = {int(k) if k.isdigit() else k: v for k, v in source.max_memory.items()}
    model = AutoModelForCausalLM.from_pretrained(
        source.path, dtype=_dtype(source.dtype), device_map=source.device_map, max_memory=max_memory,
        attn_implementation=source.attn_implementation, local_files_only=True,
    )
    if source.device_map is None and torch.cuda.is_available():
        model = model.cuda()
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
