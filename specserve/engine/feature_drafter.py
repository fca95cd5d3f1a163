"""Feature drafter (EAGLE-style head): drafts from the target's own hidden states.

The head is one Llama decoder layer fed, per position t, with the target's feature f_t (its final
norm's output, or EAGLE-3's fused low/mid/high decoder-layer outputs) and the token embedding of
x_{t+1}; its output predicts x_{t+2}. Layout (the public EAGLE-3 checkpoint's names):

    fc            Linear(F, H)          F = features per position (H_target, or 3 H_target)
    midlayer      input_layernorm(emb) ++ hidden_norm(fc(f))  -> attention over 2H inputs
                  -> post_attention_layernorm -> mlp   (residual stream = fc(f))
    norm          RMSNorm(H)
    lm_head       Linear(H, K)          K = draft vocabulary; `d2t[k]` + k is its target id
    embed_tokens  the target's (shared, never stored)

Drafting (per request): pairs (f_t, x_{t+1}) whose features came from the target are *exact*;
each call first runs the head over the exact pairs it has not seen yet (the tokens accepted since
its last call) and takes draft 1 from the last one; draft j+1 comes from the pair (h_j, d_j), where
h_j is the head's own output for the previous position ("feedback": the pre-norm output as in
EAGLE-3, or `fc` of the normed output for heads trained to regress the next feature). Draft pairs
are rolled back at the next call, like a draft model's KV cache.

The target's features reach the head through `FeatureTap`, attached to the target's runner: hooks
keep the outputs of the feature modules of every target forward, and the runner's rows say which
request and positions they belong to; they are stored per request by position (a later forward
over the same positions overwrites them, as it does the target's KV cache).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .grammar import DraftMasks
from .model_runner import ForwardTiming, ModelRunner, RowInput, regroup
from .lookup import TokenStore, continue_match
from .prediction import forced_runs, pad_run
from .proposers import DraftModelProposer, Proposal, decoder_layers
from .sampling import BatchSampling, one_hot, rows_over_one_hot

FEEDBACK_KINDS = ("direct", "fc")  # how a draft's own output becomes the next position's feature
LOOKUP_MAX_N = 8  # the longest suffix n-gram a lookup row tries to match (the most specific context wins)
# Widths a captured loop's catch-up forward is padded to (a runner that pads batches pads these
# too): a step's catch-up is as wide as its widest row's accepted drafts + 1, anything from 1 to
# γ + 1, so one loop per bucket rather than per width. Wider catch-ups run as they are.
CATCH_UP_WIDTHS = (4, 8, 16)


def catch_up_width(width: int) -> int:
    """The CATCH_UP_WIDTHS bucket a catch-up of this many tokens is padded to (itself past them)."""
    return next((w for w in CATCH_UP_WIDTHS if w >= width), width)


def _widths_up_to(width: int) -> list[int]:
    """The catch-up widths that catch-ups of 1..width tokens are padded to."""
    return sorted({catch_up_width(n) for n in range(1, width + 1)})


def feature_modules(model: torch.nn.Module, feature_layers: tuple[int, ...] = ()) -> list[torch.nn.Module]:
    """The target modules whose outputs are the head's features: the final norm when
    `feature_layers` is empty, else those decoder layers (EAGLE-3 fuses a low, a middle and a high one)."""
    if feature_layers:
        _, layers = decoder_layers(model)
        return [layers[i] for i in feature_layers]
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    for name in ("norm", "final_layernorm", "ln_f"):
        if isinstance(getattr(decoder, name, None), torch.nn.Module):
            return [getattr(decoder, name)]
    raise ValueError(f"cannot find the final norm of {type(model).__name__}")


def eagle3_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """The decoder layers whose outputs EAGLE-3 heads are trained on (the inputs of layers 2,
    L/2 and L-3, as SGLang and vLLM capture them)."""
    return (1, num_layers // 2 - 1, num_layers - 4)


# -- the head -----------------------------------------------------------------------------------
class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(2 * hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, Q, 2H] -> q [B, heads, Q, D], k, v [B, kv_heads, Q, D] (rotary applied)."""
        batch, width, _ = x.shape
        q = self.q_proj(x).view(batch, width, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, width, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, width, self.kv_heads, self.head_dim).transpose(1, 2)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [B, heads, Q, D], k/v [B, kv_heads, K, D], mask [B|1, 1, Q, K] (bool: visible, or
        additive float) -> [B, Q, H]."""
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(1, 2).flatten(2))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding; cos/sin [B, Q, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class _MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, cfg: "HeadConfig") -> None:
        super().__init__()
        self.self_attn = _Attention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self.mlp = _MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def inputs(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[B, Q, H] each -> the attention's input [B, Q, 2H]."""
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    def finish(self, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual + attention, then the MLP block -> the pre-norm output [B, Q, H]."""
        hidden = hidden + attn
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int  # V, the target's
    draft_vocab_size: int  # K
    feature_size: int  # F, fc's input width
    feature_layers: tuple[int, ...] = ()  # () = the target's final norm
    feedback: str = "direct"  # "direct" (EAGLE-3) or "fc" (the normed output goes through fc)

    def __post_init__(self) -> None:
        if self.feedback not in FEEDBACK_KINDS:
            raise ValueError(f"feedback must be one of {FEEDBACK_KINDS}, got {self.feedback!r}")


@dataclass
class _Output:
    logits: torch.Tensor


class _HFConfigView:
    """What ModelRunner reads of a model's config."""

    def __init__(self, cfg: HeadConfig) -> None:
        self._attn_implementation = "sdpa"
        self.max_position_embeddings = cfg.max_position_embeddings
        self.layer_types = None


class FeatureHead(nn.Module):
    """The head as a module the engine's ModelRunner can drive: `forward(input_ids, position_ids,
    attention_mask, past_key_values, logits_to_keep)` like a HF causal LM, with the features for the
    call set beforehand through `set_features` (the runner knows nothing of them)."""

    def __init__(self, cfg: HeadConfig, embed_tokens: nn.Embedding, token_map: torch.Tensor | None) -> None:
        super().__init__()
        self.cfg = cfg
        self.config = _HFConfigView(cfg)
        self.fc = nn.Linear(cfg.feature_size, cfg.hidden_size, bias=False)
        self.midlayer = _MidLayer(cfg)
        self.norm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self._embed = [embed_tokens]  # the target's, kept out of this module's parameters and state
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)  # [D/2]
        if token_map is not None:
            self.register_buffer("draft_token_map", token_map.long(), persistent=False)  # [K] target ids
        else:
            self.draft_token_map = None
        self._features: torch.Tensor | None = None  # [B, Q, F] target features, or [B, Q, H] feedback
        self._feedback = False
        self.last_feedback: torch.Tensor | None = None  # [B, Q, H] what the next position reads

    def get_input_embeddings(self) -> nn.Embedding:
        return self._embed[0]

    def set_features(self, features: torch.Tensor, feedback: bool) -> None:
        """features [B, Q, F] from the target (feedback=False) or [B, Q, H] the head's own."""
        self._features, self._feedback = features, feedback

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, Q] -> cos, sin [B, Q, D]."""
        angles = positions[..., None].float() * self.inv_freq  # [B, Q, D/2]
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def hidden_in(self, features: torch.Tensor, feedback: bool) -> torch.Tensor:
        """The residual stream the layer starts from: fc(target features), or a draft's feedback."""
        if feedback and self.cfg.feedback == "direct":
            return features
        return self.fc(features)

    def feedback_of(self, pre: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        return pre if self.cfg.feedback == "direct" else normed

    def forward(self, input_ids, position_ids, attention_mask, past_key_values=None, use_cache=True,
                logits_to_keep: int = 0, **_) -> _Output:
        """input_ids/position_ids [B, Q]; attention_mask [B, 1, Q, K]; past_key_values a SlotKVCache."""
        embeds = self.get_input_embeddings()(input_ids).to(self.fc.weight.dtype)  # [B, Q, H]
        features, feedback = self._features, self._feedback
        self._features = None
        if features is None:  # a timing call (calibration): zero features of the right width
            features, feedback = embeds.new_zeros(*input_ids.shape, self.cfg.feature_size), False
        hidden = self.hidden_in(features.to(embeds.dtype), feedback)  # [B, Q, H]
        layer = self.midlayer
        cos, sin = self.rotary(position_ids, embeds.dtype)
        q, k, v = layer.self_attn.qkv(layer.inputs(embeds, hidden), cos, sin)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, 0)  # [B, kv_heads, K, D]
        pre = layer.finish(hidden, layer.self_attn.attend(q, k, v, attention_mask))  # [B, Q, H]
        normed = self.norm(pre)
        self.last_feedback = self.feedback_of(pre, normed)
        keep = normed[:, -logits_to_keep:] if logits_to_keep else normed
        return _Output(self.lm_head(keep))


# -- loading and saving -------------------------------------------------------------------------
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def head_config_for(target: nn.Module, draft_vocab_size: int, feature_layers: tuple[int, ...] = (),
                    feedback: str = "fc", intermediate_size: int | None = None) -> HeadConfig:
    """A head shaped like one decoder layer of `target` (a HF Llama-like causal LM)."""
    c = target.config
    heads = c.num_attention_heads
    hidden = c.hidden_size
    return HeadConfig(
        hidden_size=hidden, num_attention_heads=heads,
        num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
        head_dim=getattr(c, "head_dim", None) or hidden // heads,
        intermediate_size=intermediate_size or c.intermediate_size, rms_norm_eps=c.rms_norm_eps,
        rope_theta=_rope_theta(c), max_position_embeddings=c.max_position_embeddings,
        vocab_size=int(target.get_output_embeddings().weight.shape[0]), draft_vocab_size=draft_vocab_size,
        feature_size=hidden * max(len(feature_layers), 1), feature_layers=tuple(feature_layers), feedback=feedback,
    )


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta or getattr(config, "rope_theta", None) or 10000.0)


def read_head_config(raw: dict, target: nn.Module) -> HeadConfig:
    """A checkpoint's config.json (EAGLE-3's, or ours with a "specserve" section) -> HeadConfig."""
    ours = raw.get("specserve", {})
    heads = raw["num_attention_heads"]
    hidden = raw["hidden_size"]
    target_layers = target.config.num_hidden_layers
    eagle = raw.get("eagle_config") or {}
    layers = ours.get("feature_layers", eagle.get("eagle_aux_hidden_state_layer_ids"))
    if layers is None:
        layers = eagle3_feature_layers(target_layers)
    target_hidden = raw.get("target_hidden_size") or target.config.hidden_size
    if raw.get("rope_scaling") not in (None, {}) and raw["rope_scaling"].get("rope_type", "default") != "default":
        raise ValueError("feature heads with scaled rotary embeddings are not supported yet")
    vocab = raw.get("vocab_size") or int(target.get_output_embeddings().weight.shape[0])
    return HeadConfig(
        hidden_size=hidden, num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or hidden // heads, intermediate_size=raw["intermediate_size"],
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6), rope_theta=float(raw.get("rope_theta", 10000.0)),
        max_position_embeddings=raw.get("max_position_embeddings", 2048), vocab_size=vocab,
        draft_vocab_size=raw.get("draft_vocab_size") or vocab,
        feature_size=target_hidden * max(len(layers), 1), feature_layers=tuple(int(i) for i in layers),
        feedback=ours.get("feedback", "direct"),
    )


def load_feature_head(path: str | Path, target: nn.Module) -> FeatureHead:
    """A head from a directory holding config.json + model.safetensors in the EAGLE-3 layout.

    Keys: fc.weight [H, F]; midlayer.{self_attn.{q,k,v}_proj [*, 2H], self_attn.o_proj,
    mlp.{gate,up,down}_proj, input_layernorm, hidden_norm, post_attention_layernorm}.weight;
    norm.weight; lm_head.weight [K, H] (when absent: the target's output rows of the draft
    vocabulary); d2t [K] (target id = k + d2t[k]; absent: K == V, the identity); t2d [V] (ignored).
    A "model." prefix is accepted; embed_tokens.weight, when present, must equal the target's.
    """
    from safetensors.torch import load_file

    folder = Path(path)
    cfg = read_head_config(json.loads((folder / CONFIG_FILE).read_text()), target)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors file in {folder}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update({k.removeprefix("model."): v for k, v in load_file(str(f)).items()})
    tensors.pop("t2d", None)
    tensors.pop("embed_tokens.weight", None)  # EAGLE-3 heads are trained on the target's embedding
    d2t = tensors.pop("d2t", None)
    if d2t is None and cfg.draft_vocab_size != cfg.vocab_size:
        raise ValueError("a head with a reduced vocabulary needs its d2t map")
    token_map = None if d2t is None else d2t.long() + torch.arange(len(d2t))  # [K] target ids
    embed = target.get_input_embeddings()
    head = FeatureHead(cfg, embed, token_map)
    if "lm_head.weight" not in tensors:
        rows = target.get_output_embeddings().weight.detach()
        tensors["lm_head.weight"] = rows if token_map is None else rows[token_map.to(rows.device)]
    dtype, device = embed.weight.dtype, embed.weight.device
    missing, unexpected = head.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=False)
    if missing or unexpected:
        raise ValueError(f"feature head {folder}: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    return head.to(device=device, dtype=dtype).eval().requires_grad_(False)


def save_feature_head(head: FeatureHead, path: str | Path, *, store_lm_head: bool, extra: dict | None = None,
                      dtype: torch.dtype = torch.float16) -> None:
    """Write config.json + model.safetensors in the layout `load_feature_head` reads."""
    from safetensors.torch import save_file

    cfg = head.cfg
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(dtype).contiguous() for k, v in head.state_dict().items()
             if store_lm_head or k != "lm_head.weight"}
    if head.draft_token_map is not None:
        k = head.draft_token_map.cpu()
        state["d2t"] = (k - torch.arange(len(k))).contiguous()
    save_file(state, str(folder / WEIGHTS_FILE))
    raw = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": cfg.hidden_size, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size, "draft_vocab_size": cfg.draft_vocab_size, "num_hidden_layers": 1,
        "target_hidden_size": cfg.feature_size // max(len(cfg.feature_layers), 1),
        "specserve": {"feature_layers": list(cfg.feature_layers), "feedback": cfg.feedback, **(extra or {})},
    }
    (folder / CONFIG_FILE).write_text(json.dumps(raw, indent=2) + "\n")


# -- the target's features ------------------------------------------------------------------------
@dataclass
class _Held:
    """One request's features: rows[i] holds position origin + i; positions base .. written - 1
    are held (base >= origin: those below were released)."""
    rows: torch.Tensor  # [capacity, F]
    origin: int
    base: int
    written: int

    def moved(self, end: int) -> None:
        """Into new storage, from base on, with room for positions up to `end` (twice what that
        needs, 64 or more): the rows below base are gone."""
        rows = self.rows.new_empty(max(2 * (end - self.base), 64), self.rows.shape[1])
        kept = min(self.written, end) - self.base
        if kept > 0:
            rows[:kept] = self.rows[self.base - self.origin : self.base - self.origin + kept]
        self.rows, self.origin = rows, self.base


class FeatureStore:
    """Per request, the target's features by position, grown by doubling. A drafter that has
    consumed a request's features up to some position releases those below it (`release`): they
    leave at the next growth, and storage that held a whole prompt shrinks once it is consumed, so
    a request keeps about its unconsumed positions (a step's new tokens), not its whole context
    (a 7B target's EAGLE-3 features are 24 KB a position: 200 MB at 8k tokens)."""

    def __init__(self) -> None:
        self._held: dict[str, _Held] = {}

    def write(self, request_id: str, start: int, features: torch.Tensor) -> None:
        """features [n, F] for positions start .. start+n-1 (what lies beyond is stale from now on)."""
        end = start + features.shape[0]
        held = self._held.get(request_id)
        if held is None or start < held.base:  # (below what is held: everything from there on is new)
            held = self._held[request_id] = _Held(features.new_empty(0, features.shape[1]), start, start, start)
        if held.rows.shape[0] < end - held.origin:
            held.written = min(held.written, start)
            held.moved(end)
        held.rows[start - held.origin : end - held.origin] = features
        held.written = end

    def written(self, request_id: str) -> int:
        held = self._held.get(request_id)
        return 0 if held is None else held.written

    def held_from(self, request_id: str) -> int:
        """The first position held (those below were released)."""
        held = self._held.get(request_id)
        return 0 if held is None else held.base

    def read(self, request_id: str, start: int, end: int) -> torch.Tensor:
        held = self._held[request_id]
        if start < held.base:
            raise RuntimeError(f"features of {request_id!r} below position {held.base} were released "
                               f"(read from {start})")
        return held.rows[start - held.origin : end - held.origin]  # [end - start, F]

    def release(self, request_id: str, upto: int) -> None:
        """Positions below `upto` will not be read again (the drafter's cache holds them)."""
        held = self._held.get(request_id)
        if held is None or min(upto, held.written) <= held.base:
            return
        held.base = min(upto, held.written)
        if held.rows.shape[0] > 4 * max(held.written - held.base, 64):  # mostly released: give it back
            held.moved(held.written)

    def held_bytes(self) -> int:
        """The storage every request's features take now."""
        return sum(h.rows.numel() * h.rows.element_size() for h in self._held.values())

    def free(self, request_id: str) -> None:
        self._held.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._held)


class FeatureTap:
    """Keeps the features of every forward of the target's runner in a FeatureStore.

    The runner taps the feature modules (`ModelRunner.tap`): each forward yields their outputs as
    `last_features` ([B', Q, F], the runner's slot order, padded rows last), an output of the
    forward itself, so the target's forwards may be compiled or replayed as CUDA graphs. The
    runner hands each row's positions to the store once a forward has run (and, for a prompt
    prefix it took from cached blocks, the features kept with them); the runner's `free` is
    wrapped so that they go with the request.
    """

    def __init__(self, runner: ModelRunner, feature_layers: tuple[int, ...], store: FeatureStore) -> None:
        self.runner = runner
        self.store = store
        runner.tap(feature_modules(runner.model, feature_layers),
                   "a feature drafter reads the target's hidden states at every position", store.write)
        inner_free = runner.free

        def free(request_id: str) -> None:  # features live as long as the target's cache of them
            inner_free(request_id)
            store.free(request_id)

        runner.free = free  # an instance attribute: this runner only


class FeatureServer:
    """The target's side of a feature head that drafts in another process (the draft worker):
    a FeatureTap on the target's runner, and `read`, which hands out committed features. What it
    handed out leaves the device (the target's GPU) for a host copy, the one the reply was made
    from: a draft worker that restarts asks for every position again."""

    def __init__(self, runner: ModelRunner, feature_layers: tuple[int, ...]) -> None:
        self.runner = runner
        self.store = FeatureStore()  # on the target's device: what no read has handed out yet
        self.handed = FeatureStore()  # on the host: what reads handed out, never released
        self.tap = FeatureTap(runner, feature_layers, self.store)
        tapped_free = runner.free

        def free(request_id: str) -> None:
            tapped_free(request_id)
            self.handed.free(request_id)

        runner.free = free  # an instance attribute: this runner only

    def read(self, wants: dict[str, tuple[int, int]]) -> dict[str, tuple[int, torch.Tensor]]:
        """{request id: (first position wanted, end)} -> {request id: (that position, features
        [n, F] on the host)} for the positions held up to `end`. The caller's end is its committed
        tokens' count - 1: every position below it holds the feature of the committed prefix (a
        rejected draft's position is the recovered token's, which the next forward rewrites before
        it falls below an end), so those leave the device once read. Requests with none are left out."""
        out = {}
        for rid, (start, end) in wants.items():
            end = min(self.store.written(rid), end)
            if end <= start:
                continue
            device_from = self.store.held_from(rid)  # the first position not handed out yet
            if device_from < end:
                self.handed.write(rid, device_from, self.store.read(rid, device_from, end).cpu())  # [n, F]
                self.store.release(rid, end)
            out[rid] = (start, self.handed.read(rid, start, end))
        return out


# -- the proposer ---------------------------------------------------------------------------------
class FeatureDrafterProposer(DraftModelProposer):
    """Drafts with a FeatureHead from the target's features; needs `attach_target(runner)` (the
    target verifier's runner) before its first call. Per request it keeps the tokens it was sent
    (plus its last G-1 drafts, as the protocol asks) and how many exact pairs the head's KV cache
    holds. A row whose last target feature is not there yet (its prompt has not been through the
    target: the first step) gets copies of its last token, which cost nothing and are rejected."""

    can_branch = False  # its per-request token and feature stores have no fork (pipelined: one branch)

    def __init__(self, head: FeatureHead, vocab_size: int, max_model_len: int | None = None,
                 min_confidence: float | None = None, pulled: bool = False,
                 lookup_min_n: int | None = None, execution: str = "auto") -> None:
        super().__init__(head, vocab_size, max_model_len, execution=execution)
        # the head reads the features set on it before each forward (module state that a replayed
        # single forward would not see): in graph mode only whole draft loops are captured, which
        # set them inside (`_draft_rows`); other forwards run eagerly
        self.runner.capture_forwards = False
        self.head = head
        # a row stops drafting where the product of the head's top probabilities falls below this
        # (None: every planned draft); counted on the device, read with the drafts at the end
        self.min_confidence = min_confidence
        # under a floor, read after each position whether some row still drafts and skip the head's
        # remaining forwards once none does: a host read per position, free where the head runs on
        # the CPU; elsewhere every position runs on the device (grammar rows read per position anyway)
        self.host_stop = self.runner.device.type == "cpu"
        # a row whose newest lookup_min_n (or more) tokens occurred earlier in its own tokens drafts
        # what followed them there (prompt lookup) instead of running the head; None: never
        self.lookup_min_n = lookup_min_n
        self.num_rows = 0  # rows drafted for, and how many of them by lookup
        self.num_looked_up = 0
        self.features = FeatureStore()
        # per request: the tokens sent (and the last G-1 drafts), indexed for lookups
        self._tokens = TokenStore(lookup_min_n, None if lookup_min_n is None else max(LOOKUP_MAX_N, lookup_min_n))
        self._exact: dict[str, int] = {}  # request id -> leading pairs computed from target features
        self._tap: FeatureTap | None = None
        # the widest catch-up a loop takes at a fixed shape (`_run_backlog`): the widest captured ahead
        self.loop_width = CATCH_UP_WIDTHS[-1]
        # True: the target runs elsewhere; its features arrive through `put_features` (the draft
        # worker pulls what `features_wanted` names from the target's FeatureServer before a propose)
        self.pulled = pulled

    def features_wanted(self, rows: list[RowInput]) -> dict[str, tuple[int, int]]:
        """{request id: (first position missing, end)} for rows whose committed tokens (row.start
        + len(row.tokens) of them) lack features here: end = that count - 1, as the target has
        computed features for every committed token but the newest (FeatureServer.read)."""
        wants = {}
        for row in rows:
            have = self.features.written(row.request_id)  # only committed positions are ever put here
            end = row.start + len(row.tokens) - 1
            if have < end:
                wants[row.request_id] = (have, end)
        return wants

    def put_features(self, got: dict[str, tuple[int, torch.Tensor]]) -> None:
        """Features from the target's FeatureServer.read: {request id: (start, [n, F])}."""
        device = self.runner.device
        for rid, (start, feats) in got.items():
            if start <= self.features.written(rid):  # contiguous with what is held
                self.features.write(rid, start, feats.to(device))

    def attach_target(self, runner: ModelRunner) -> None:
        """Start keeping the features of the target runner's forwards (one runner per proposer).
        A drafter whose features are pulled from another process (`pulled`) keeps none here."""
        if self.pulled:
            return
        if self._tap is not None and self._tap.runner is not runner:
            raise RuntimeError("this feature drafter already reads another target runner; build one per engine")
        if self._tap is None:
            self._tap = FeatureTap(runner, self.head.cfg.feature_layers, self.features)

    def free(self, request_id: str) -> None:
        self.runner.free(request_id)
        self.features.free(request_id)
        self._tokens.free(request_id)
        self._exact.pop(request_id, None)
        if self.grammar is not None:
            self.grammar.free(request_id)

    def valid_length(self, request_id: str) -> int:
        return self._tokens.length(request_id)

    def num_cached(self) -> int:
        return len(self._tokens)

    def graph_loops(self) -> bool:
        """Whether its draft loops replay as CUDA graphs: graph mode, and no host read per
        position (`host_stop`)."""
        return super().graph_loops() and not self.host_stop

    def capture_ahead(self, size: int, prefixes, max_gamma: int, kinds, tick) -> None:
        """As a draft model's, at each catch-up width bucket up to γ + 1 tokens (a step's accepted
        drafts and bonus token); from then on wider catch-ups first run their backlog."""
        self.loop_width = self._ahead_widths(max_gamma)[-1]
        super().capture_ahead(size, prefixes, max_gamma, kinds, tick)

    def _ahead_widths(self, max_gamma: int) -> list[int]:
        return _widths_up_to(max_gamma + 1)

    def _ahead_context(self, ids: list[str], prefix: int) -> None:
        head = self.head
        head.set_features(torch.zeros(len(ids), prefix, head.cfg.feature_size, dtype=head.fc.weight.dtype,
                                      device=self.runner.device), feedback=False)
        super()._ahead_context(ids, prefix)

    def _ahead_loop(self, rows: list[RowInput], gamma: int, sampling: BatchSampling,
                    uniforms: torch.Tensor | None) -> None:
        """The loop over zero features, standing in for the target's (a replay reads whatever its
        buffers then hold)."""
        head, width = self.head, len(rows[0].tokens)
        zeros = torch.zeros(width, head.cfg.feature_size, dtype=head.fc.weight.dtype)
        self._draft_rows(rows, [zeros] * len(rows), gamma, sampling, uniforms)

    def prefill(self, rows: list[RowInput]) -> tuple[ForwardTiming, ...]:
        """Hold rows' tokens (prompt chunks). The head's own cache of them waits for the target's
        features (written by the target's prefill forwards) and is caught up by the next propose:
        one forward of the head's single layer, a small fraction of the target's prefill."""
        self._tokens.hold(rows)
        for row in rows:
            self._exact[row.request_id] = min(self._exact.get(row.request_id, 0), row.start - 1)
        return ()

    @torch.no_grad()
    def propose(
        self, rows: list[RowInput], num_tokens: int, sampling: BatchSampling, uniforms: torch.Tensor | None
    ) -> Proposal:
        """rows: B rows; uniforms [B, G] or None (all greedy) -> Proposal with G = num_tokens."""
        if self._tap is None and not self.pulled:
            raise RuntimeError("a feature drafter must be attached to the target's runner first")
        self._tokens.check(rows)
        self.runner.take_forward_log()
        began = time.perf_counter()
        seqs = []
        for row in rows:
            seqs.append(self._tokens.rewrite(row.request_id, row.start, row.tokens))
            self._exact[row.request_id] = min(self._exact.get(row.request_id, 0), row.start - 1)
        looked = self._look_up(rows, seqs, num_tokens)  # row -> its G drafts by prompt lookup
        runs = forced_runs(sampling.forced)  # row -> its predicted run: drafted as a lookup row's are
        looked.update((b, pad_run(run, num_tokens)) for b, run in runs.items())
        ready = [b for b, (row, seq) in enumerate(zip(rows, seqs)) if b not in looked
                 and self.features.written(row.request_id) >= len(seq) - 1 and len(seq) >= 2]
        tokens = torch.tensor([looked.get(b, seq[-1:] * num_tokens) for b, seq in enumerate(seqs)],
                              dtype=torch.long).view(len(rows), num_tokens)  # [B, G]
        probs = None
        counts = torch.zeros(len(rows), dtype=torch.long)  # [B] drafts worth verifying (none without features)
        counts[list(looked)] = num_tokens
        for b, run in runs.items():
            counts[b] = min(len(run), num_tokens)
        if ready and num_tokens > 0:
            drafted, probs, kept = self._draft([rows[b] for b in ready], [seqs[b] for b in ready], num_tokens,
                                               sampling.select(ready) if len(ready) < len(rows) else sampling,
                                               None if uniforms is None else uniforms[ready])
            tokens[ready] = drafted
            counts[ready] = kept
            probs = rows_over_one_hot(probs, ready, tokens.to(self.runner.device), self.vocab_size)  # [B, G, V]
        elif not sampling.all_greedy:
            probs = one_hot(tokens.to(self.runner.device), self.vocab_size)  # [B, G, V]
        for row, seq, row_tokens in zip(rows, seqs, tokens.tolist()):
            self._tokens.rewrite(row.request_id, len(seq), row_tokens[: num_tokens - 1])
        forwards = self.runner.take_forward_log() or (ForwardTiming(0, time.perf_counter() - began),)
        counted = self.min_confidence is not None or bool(runs)
        return Proposal(tokens, self._sent(probs), forwards, num_draft=counts if counted else None)

    def _look_up(self, rows: list[RowInput], seqs: list[list[int]], num_tokens: int) -> dict[int, list[int]]:
        """Rows whose suffix repeats an earlier n-gram of at least `lookup_min_n` tokens -> their
        drafts: what followed the match (`TokenStore.find`). On a model's own text a match of 3
        or more tokens predicts 1.8-3.3 of 4 drafts (docs/drafters.md), more than the head does;
        there the head's forwards are skipped. The choice depends only on tokens already there,
        so q (one-hot at each looked-up draft) keeps the acceptance rule exact for sampled rows."""
        self.num_rows += len(seqs)
        if self.lookup_min_n is None or num_tokens == 0:
            return {}
        looked = {}
        for b, (row, seq) in enumerate(zip(rows, seqs)):
            start = self._tokens.find(row.request_id)
            if start is not None:
                looked[b] = continue_match(seq, start, num_tokens)
        self.num_looked_up += len(looked)
        return looked

    def _draft(self, rows, seqs, num_tokens, sampling, uniforms):
        """Catch up on the exact pairs, then one head forward per further draft -> (drafts [b, G]
        on the host, q [b, G, V] or None, drafts worth verifying [b] on the host: G, or fewer
        under `min_confidence`). One forward per length group of the head's runner (paged)."""
        catch_up, feats = self._take_cached(*self._catch_up(rows, seqs), seqs)
        loop_rows, loop_feats = self._run_backlog(catch_up, feats)
        groups = self.runner.length_groups(loop_rows, extra_positions=num_tokens - 1)
        if len(groups) == 1:
            out = self._draft_rows(loop_rows, loop_feats, num_tokens, sampling, uniforms)
        else:
            parts = [self._draft_rows([loop_rows[b] for b in g], [loop_feats[b] for b in g], num_tokens,
                                      sampling.select(g), None if uniforms is None else uniforms[g]) for g in groups]
            out = tuple(regroup([p[i] for p in parts], groups, len(rows)) for i in range(3))
        for row, seq in zip(catch_up, seqs):  # exact pairs only: the drafts' positions are rewritten
            self.runner.register_prefix(row, root=seq[0])
        return out

    def _catch_up(self, rows, seqs) -> tuple[list[RowInput], list[torch.Tensor]]:
        """The exact pairs each row's head has not seen (the tokens since its last call) -> the
        head's rows (pairs exact .. P-1, P the newest token's position) and their features [n, F]."""
        catch_up, feats = [], []
        for row, seq in zip(rows, seqs):
            exact = max(self._exact[row.request_id], 0)
            last = len(seq) - 1
            catch_up.append(RowInput(row.request_id, exact, seq[exact + 1 :]))
            feats.append(self.features.read(row.request_id, exact, last))
            self.features.release(row.request_id, last)  # (the next catch-up starts at last)
            self._exact[row.request_id] = last
        return catch_up, feats

    def _run_backlog(self, catch_up: list[RowInput], feats: list[torch.Tensor]):
        """Where loops run at fixed shapes (a runner that pads batches), rows whose catch-up is
        wider than `loop_width` (a new prompt, a row that has not drafted for a while) first run
        all but their last pair through one forward of their own, as a draft model's backlog does:
        the loop's catch-up then stays within the widths it was captured at, rather than running
        eagerly for the whole batch -> the loop's rows and features."""
        long = [b for b, row in enumerate(catch_up) if len(row.tokens) > self.loop_width]
        if not long or not self.runner.pad_batches:
            return catch_up, feats
        backlog = [RowInput(catch_up[b].request_id, catch_up[b].start, catch_up[b].tokens[:-1]) for b in long]
        self.runner.check(backlog)
        staged = self.runner.stage(backlog)
        self.head.set_features(self._sorted_features(staged, [feats[b][:-1] for b in long]), feedback=False)
        self.runner.run(staged, logits="none")
        rows, loop_feats = list(catch_up), list(feats)
        for b in long:
            row = catch_up[b]
            rows[b] = RowInput(row.request_id, row.start + len(row.tokens) - 1, row.tokens[-1:])
            loop_feats[b] = feats[b][-1:]
        return rows, loop_feats

    def _take_cached(self, catch_up: list[RowInput], feats: list[torch.Tensor], seqs):
        """Under prefix caching, each row skips the leading exact pairs whose keys the head's
        cached blocks hold (another request's catch-up computed them) -> its rows and features
        less those. A pair at position p is (the target's feature of p, token p + 1), so the hash
        chain starts from token 0; the last pair is always computed: its logits give draft 1."""
        taken = [self.runner.take_cached_prefix(row, root=seq[0], spare_last=True) for row, seq in zip(catch_up, seqs)]
        return ([RowInput(row.request_id, row.start + n, row.tokens[n:]) for row, n in zip(catch_up, taken)],
                [f[n:] for f, n in zip(feats, taken)])

    def _draft_rows(self, catch_up, feats, num_tokens, sampling, uniforms):
        """`_draft` over one forward's rows: staged once (the key length covers the G-1 single-token
        forwards), the loop in the runner's sorted row order, one copy to the host at the end."""
        runner = self.runner
        runner.check(catch_up)
        width = catch_up_width(max(len(r.tokens) for r in catch_up)) if runner.pad_batches else 0
        staged = runner.stage(catch_up, extra_positions=num_tokens - 1, min_width=width)
        picked = staged.order + [staged.order[0]] * (staged.padded - staged.rows)  # sorted row -> caller row
        flags = sampling.loop_flags()  # host reads of host tensors
        masks = self._draft_masks(sampling, lambda: staged.order, staged.padded)  # (narrow grammar rows')
        uniforms = None if uniforms is None else uniforms[picked].to(runner.device)  # [B', G]
        features, sampling = self._sorted_features(staged, feats), sampling.select(picked).to(runner.device)
        static = self.graph_loops() and masks is None and runner.fixed_shape(staged)
        try:
            if static:
                drafted, probs, kept, steps = self._replay(staged, features, num_tokens, sampling, flags, uniforms)
            else:
                drafted, probs, kept, steps = self._loop(staged, features, num_tokens, sampling, flags,
                                                         {"uniforms": uniforms}, masks)
        finally:
            if masks is not None:
                masks.close()
        runner.commit(staged, advanced=steps)
        host = torch.cat([runner.unsort(staged, drafted), runner.unsort(staged, kept)[:, None]], 1).cpu()  # [b, G+1]
        return host[:, :num_tokens], runner.unsort(staged, probs), host[:, num_tokens]

    def _sorted_features(self, staged, feats: list[torch.Tensor]) -> torch.Tensor:
        """Each row's features [n, F] -> [B', Q, F] on the head's device in the runner's sorted row
        order (what the staged ids are in), zero past a row's end and for padding rows."""
        device = self.runner.device
        rows = [F.pad(feats[b].to(device), (0, 0, 0, staged.width - feats[b].shape[0])) for b in staged.order]
        return torch.stack(rows + [torch.zeros_like(rows[0])] * (staged.padded - staged.rows))

    def _replay(self, staged, features, num_tokens, sampling, flags, uniforms):
        """`_loop` as one CUDA graph per (B', Q, K, G, flags), its inputs copied into static
        buffers first -> what `_loop` returns (the outputs cloned out of the graph's)."""
        runner = self.runner
        buffers = self._static_buffers(staged, num_tokens, features.shape[-1])
        buffers["features"].copy_(features)
        if flags is not None:
            for name, values in (("temperature", sampling.temperature), ("top_k", sampling.top_k),
                                 ("top_p", sampling.top_p), ("min_p", sampling.min_ps())):
                buffers[name].copy_(values)
            buffers["uniforms"].copy_(uniforms)
            buffers["probs"] = self._q_buffer(staged.padded, num_tokens)
        buffers["real"].copy_(staged.real)
        static = BatchSampling(buffers["temperature"], buffers["top_k"], buffers["top_p"], min_p=buffers["min_p"])
        key = ("head", *staged.static_key, num_tokens, flags, runner.cache.generation)
        written = (staged.block, runner.advance_block(staged))  # the loop writes the single-token block
        began = runner.clock()
        out = runner.graphs.run(key, lambda: self._loop(staged, buffers["features"], num_tokens, static, flags,
                                                        buffers, None, captured=True)[:3], written)
        runner.record(staged.rows, began, forwards=num_tokens)
        drafted, probs, kept = (None if t is None else t.clone() for t in out)
        return drafted, probs, kept, num_tokens - 1

    def _static_buffers(self, staged, num_tokens: int, width: int) -> dict[str, torch.Tensor]:
        """The captured loop's inputs for (B', Q, G), allocated once (a replay reads them at fixed
        addresses): features [B', Q, F], sampling parameters [B'], uniforms [B', G], which rows
        are real [B'] (B may change between replays of one B')."""
        key = (staged.padded, staged.width, num_tokens)
        if key not in self._inputs:
            b, device = staged.padded, self.runner.device
            self._inputs[key] = dict(
                features=torch.zeros(b, staged.width, width, dtype=self.head.fc.weight.dtype, device=device),
                temperature=torch.zeros(b, device=device), top_k=torch.zeros(b, dtype=torch.long, device=device),
                top_p=torch.ones(b, device=device), min_p=torch.zeros(b, device=device),
                uniforms=torch.zeros(b, num_tokens, device=device),
                real=torch.zeros(b, dtype=torch.bool, device=device))
        return self._inputs[key]

    def _forward(self, staged, captured: bool) -> torch.Tensor:
        """One head forward -> logits [B', K]: inside a capture, the forward itself (not the
        runner's dispatch, which would time it)."""
        if captured:
            return self.runner.forward_in_capture(staged, "last")
        return self.runner.execute(staged, "last")[0]

    def _loop(self, staged, features, num_tokens, sampling, flags, inputs, masks: DraftMasks | None,
              captured: bool = False):
        """The catch-up forward, then single-token forwards fed each draft and the head's feedback on
        the device, sorted row order -> (drafts [B', G], q [B', G, V] or None, kept [B'], forwards
        after the catch-up). Nothing is read back to the host, except by grammar masks and, where
        `host_stop`, the floor's check that some row still drafts (its forwards skipped otherwise).
        captured: being captured as a graph (`_replay`): no timing, no host reads."""
        runner = self.runner
        began = None if captured else runner.clock()
        self.head.set_features(features, feedback=False)  # [B', Q, F]
        logits = self._forward(staged, captured)  # [B', K]
        index = staged.block[:, staged.width + 3]  # [B'] each row's last real token
        feedback = self.head.last_feedback[torch.arange(staged.padded, device=index.device), index]  # [B', H]
        last = staged.ids.gather(1, index[:, None])  # [B', 1] the newest token (a copy: advance may reuse the block)
        if not captured:
            runner.record(staged.tokens, began)
            began = runner.clock()
        real = inputs["real"] if captured else staged.real
        confidence = _Confidence(self.min_confidence, real, num_tokens)
        stops = not captured and (masks is not None or self.host_stop)
        out, qs = [], []
        for j in range(num_tokens):
            if masks is not None:
                logits = masks.apply(self._to_target_vocab(logits))  # [B', V]
            confidence.see(logits)
            if stops and not confidence.any_drafting():  # no row drafts position j: skip its forwards
                break
            token, q = self._pick(logits, sampling, flags, inputs, j, masks is not None)  # [B'], [B', V]
            if masks is not None:
                masks.advance(token)
            out.append(token)
            qs.append(q)
            if j + 1 < num_tokens:
                staged, logits, feedback = self._step(staged, token, feedback, captured)
        steps = min(len(out), num_tokens - 1)
        if steps and not captured:
            runner.record(staged.rows, began, forwards=steps)
        q_out = inputs.get("probs") if captured else None  # [B', G, V] shared by the shape's graphs
        drafted, probs = self._fill(out, qs, flags, confidence, last, num_tokens, q_out)
        return drafted, probs, confidence.kept, steps

    def _step(self, staged, token: torch.Tensor, feedback: torch.Tensor, captured: bool = False):
        """One single-token forward after `staged`: token [B'] and feedback [B', H] of the position
        before -> (its staged layout, logits [B', K], its feedback [B', H]). Device only."""
        staged = self.runner.advance(staged, token)
        self.head.set_features(feedback[:, None], feedback=True)  # [B', 1, H]
        logits = self._forward(staged, captured)
        return staged, logits, self.head.last_feedback[:, -1]

    def _fill(self, out, qs, flags, confidence: "_Confidence", last: torch.Tensor, num_tokens: int,
              q_out: torch.Tensor | None = None):
        """The drafts of the n positions run (tokens [B'] and q [B', V] each) -> tokens [B', G] and q
        [B', G, V] or None. Under a floor, positions no row drafts (from the longest row's count on)
        hold copies of the last draft some row kept (the newest token where none did), q one-hot
        there: what the loop sent when it stopped at the first such position. Device only.
        q_out: a captured loop's shared q buffer [B', G, V] (q is written there; None: a new tensor)."""
        drafted = torch.stack(out, dim=1) if out else last[:, :0]  # [B', n]
        if confidence.floor is None:
            if not out or flags is None:
                return drafted, None
            return drafted, torch.stack(qs, dim=1, out=q_out)
        probs = torch.stack(qs, dim=1) if out and flags is not None else None  # [B', n, V]
        longest = confidence.longest()  # 0-d
        fill = torch.cat([last, drafted], dim=1).index_select(1, longest.view(1))  # [B', 1]
        ran = drafted.shape[1]
        beyond = torch.arange(num_tokens, device=drafted.device) >= longest  # [G]
        tokens = torch.where(beyond, fill, torch.cat([drafted, fill.expand(-1, num_tokens - ran)], dim=1))  # [B', G]
        if flags is None:
            return tokens, None
        hot = one_hot(tokens, self.vocab_size)  # [B', G, V]
        q = hot if probs is None else torch.cat([probs, hot[:, ran:]], dim=1)
        return tokens, torch.where(beyond[:, None], hot, q, out=q_out)


class _Confidence:
    """Where rows stop drafting: a row drafts position j while the product of the head's top
    probabilities at positions 0..j stays >= floor (EAGLE-2's estimate of the chance that the
    target accepts the drafts so far). Position j's decision depends only on the tokens before
    it, never on the token drafted there, so the acceptance rule stays exact for sampled rows.
    Counted on the device; the product never grows (top <= 1), so a row that stops stays stopped."""

    def __init__(self, floor: float | None, real: torch.Tensor, num_tokens: int) -> None:
        """real: [B'] bool, the real rows of the B' (padding rows last; a captured loop's static
        input: B may change between replays)."""
        self.floor = floor
        self.real = real
        self.kept = torch.full(real.shape, num_tokens if floor is None else 0, dtype=torch.long,
                               device=real.device)  # [B'] positions each row drafts
        self._product: torch.Tensor | None = None  # [B']
        self._drafting: torch.Tensor | None = None  # [B'] bool: rows drafting the position last seen

    def see(self, logits: torch.Tensor) -> None:
        """logits [B', K] of the next position: counted in `kept` for the rows still over the floor."""
        if self.floor is None:
            return
        top = torch.softmax(logits.float(), dim=-1).amax(dim=-1)  # [B']
        self._product = top if self._product is None else self._product * top
        self._drafting = self._product >= self.floor
        self.kept += self._drafting.long()

    def any_drafting(self) -> bool:
        """Whether some real row drafts the position last seen: a host read (a sync on a GPU)."""
        return self.floor is None or bool((self._drafting & self.real).any())

    def longest(self) -> torch.Tensor:
        """0-d: the most positions a real row drafts."""
        return torch.where(self.real, self.kept, 0).max()


SHIPPED_HEADS = Path(__file__).resolve().parent.parent / "models" / "weights"


def resolve_head_path(path: str | Path) -> Path:
    """A head directory as given, else one shipped with the package (specserve/models/weights/NAME)."""
    given = Path(path).expanduser()
    if (given / CONFIG_FILE).is_file():
        return given
    shipped = SHIPPED_HEADS / str(path)
    if (shipped / CONFIG_FILE).is_file():
        return shipped
    raise FileNotFoundError(f"no feature head at {given} (config.json + safetensors), nor a shipped one named {path!r}")


@dataclass(frozen=True)
class FeatureDrafterSpec:
    """A feature head (EAGLE-style) loaded from `path` (config.json + safetensors; or the name of
    a head shipped in specserve/models/weights), drafting from the target's hidden states next to
    the target. The engine (or the target worker) attaches it to the target's runner."""

    path: str
    min_confidence: float | None = None  # see FeatureDrafterProposer
    lookup_min_n: int | None = None  # see FeatureDrafterProposer
    execution: str = "auto"  # the head's forwards (see ModelRunner): graph mode captures whole draft loops

    def build(self, target_model: torch.nn.Module, vocab_size: int, max_model_len: int | None,
              pulled: bool = False):
        """pulled: the target runs in another process, `target_model` holds only its embedding and
        output head (models.loading.TargetIO), and features arrive through `put_features`."""
        head = load_feature_head(resolve_head_path(self.path), target_model)
        return FeatureDrafterProposer(head, vocab_size, max_model_len, self.min_confidence, pulled, self.lookup_min_n,
                                      self.execution)

    def server(self, runner: ModelRunner) -> FeatureServer:
        """The target side of a pulled head: taps the layers the head reads on `runner`."""
        raw = json.loads((resolve_head_path(self.path) / CONFIG_FILE).read_text())
        return FeatureServer(runner, read_head_config(raw, runner.model).feature_layers)
