"""ModelSource -> torch model / tokenizer. Heavy imports happen lazily, inside the process that loads."""
from __future__ import annotations

import torch

from specserve.config import HFSource, ModelSource, RandomSource, SmolLM2Source, TinySource


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
    if isinstance(source, RandomSource):
        return load_random(source, gpus or [])
    return _load_hf(source, gpus or [])


def load_random(source: RandomSource, gpus: list[int]) -> torch.nn.Module:
    """A model of the source's shape with seeded random weights, made where it will live (the
    first of `gpus`, else the CPU) in its dtype: no float32 copy, no transfer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = source.config_fields()
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    config.eos_token_id = None  # load tests: every request runs to its max_tokens
    config.bos_token_id = config.pad_token_id = None
    device = torch.device(f"cuda:{gpus[0]}" if gpus else "cpu")
    default = torch.get_default_dtype()
    torch.manual_seed(source.seed)
    try:
        torch.set_default_dtype(_dtype(source.dtype))
        with device:
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    finally:
        torch.set_default_dtype(default)
    model.generation_config.eos_token_id = None
    if source.peaked:
        from .peaked import peak

        peak(model, source.seed)
    return model.eval().requires_grad_(False)


def load_draft(source: ModelSource, gpus: list[int] | None = None) -> torch.nn.Module:
    if isinstance(source, SmolLM2Source):
        from specserve.models.smollm2 import load_smollm2_draft, load_smollm2_target

        target, _ = load_smollm2_target(source.cache_dir, dtype=_dtype(source.dtype))
        return load_smollm2_draft(target, source.cache_dir)  # keeps only the shared embedding
    return load_target(source, gpus)


class TargetIO(torch.nn.Module):
    """A target's config, token embedding and output head without its decoder layers: what a
    feature head drafting in another process reuses (`load_feature_head`)."""

    def __init__(self, config, embed: torch.nn.Embedding, output: torch.nn.Linear) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens, self.lm_head = embed, output

    def get_input_embeddings(self) -> torch.nn.Embedding:
        return self.embed_tokens

    def get_output_embeddings(self) -> torch.nn.Linear:
        return self.lm_head


def load_target_io(source: ModelSource, gpus: list[int] | None = None) -> torch.nn.Module:
    """The target's TargetIO. From an HF checkpoint only the embedding and output-head tensors are
    read (a 70B target's draft worker holds ~2 GB of them, not 140 GB); the built-in targets are
    small enough to build whole."""
    if not isinstance(source, HFSource):
        model = load_target(source)
        return TargetIO(model.config, model.get_input_embeddings(), model.get_output_embeddings())
    import json
    from pathlib import Path

    from safetensors import safe_open
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source.path, local_files_only=True)
    folder = Path(source.path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = {k: folder / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    else:
        files = {}
        for path in folder.glob("*.safetensors"):
            with safe_open(str(path), "pt") as f:
                files.update(dict.fromkeys(f.keys(), path))

    def tensor(suffix: str) -> torch.Tensor | None:
        name = next((k for k in files if k.endswith(suffix)), None)
        if name is None:
            return None
        with safe_open(str(files[name]), "pt") as f:
            return f.get_tensor(name)

    embed = tensor("embed_tokens.weight")
    head = tensor("lm_head.weight")
    if embed is None:
        raise FileNotFoundError(f"no embed_tokens.weight in {folder}")
    head = embed if head is None else head  # tied embeddings
    device = f"cuda:{gpus[0]}" if gpus else "cpu"
    dtype = _dtype(source.dtype)
    emb = torch.nn.Embedding.from_pretrained(embed.to(device=device, dtype=dtype), freeze=True)
    out = torch.nn.Linear(head.shape[1], head.shape[0], bias=False, device=device, dtype=dtype)
    out.weight.data.copy_(head.to(device=device, dtype=dtype))
    return TargetIO(config, emb, out.requires_grad_(False))


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


def load_tokenizer(source: ModelSource, directory: str | None = None):
    """The tokenizer the ingress uses: the target source's, unless `directory` (the app's
    `tokenizer` setting) names one."""
    from transformers import AutoTokenizer

    if directory:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    if isinstance(source, (TinySource, RandomSource)):
        from .tiny import byte_tokenizer

        return byte_tokenizer()
    if isinstance(source, SmolLM2Source):
        from specserve.models.smollm2 import ensure_target_checkpoint

        return AutoTokenizer.from_pretrained(ensure_target_checkpoint(source.cache_dir))
    return AutoTokenizer.from_pretrained(source.path, local_files_only=True)
