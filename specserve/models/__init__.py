"""Model loaders: the offline SmolLM2-135M-Instruct target and its trained draft."""

from specserve.models.smollm2 import (
    cache_root,
    ensure_target_checkpoint,
    gguf_path,
    load_smollm2_draft,
    load_smollm2_target,
    target_checkpoint_dir,
)

__all__ = [
    "cache_root",
    "ensure_target_checkpoint",
    "gguf_path",
    "load_smollm2_draft",
    "load_smollm2_target",
    "target_checkpoint_dir",
]
