"""Training a feature head on the target's features (see `specserve.engine.feature_drafter`).

Per sequence, pair t = (f_t, x_{t+1}) is trained to predict the target's greedy choice after
x_{t+1} (`argmax[t+1]`), with three terms: cross-entropy on that token, cross-entropy to the
target's whole distribution over the draft vocabulary (the target's head applied to f_{t+1}), and,
for heads whose feedback goes through `fc`, a smooth-L1 pull of the head's normed output towards
f_{t+1} (what the next position will read in its place while drafting).

Training-time test: pass m (2..steps) reruns the layer with, at position t, the head's own output
of pass m-1 at t-1 as the feature, attending exactly what draft m attends while drafting: the
exact pairs up to t-m+1 (pass 1's keys) and one key of each later pass. So the drafts after the
first are trained on the head's own feedback, not only on the target's features.

The schedule runs on wall-clock time (warm-up, then linear decay to a tenth over the budget), and
a checkpoint (weights + optimizer + progress) is written every few minutes; a rerun resumes it.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from specserve.engine.feature_drafter import FeatureHead, head_config_for
from specserve.engine.proposers import decoder_layers


@dataclass
class TrainSettings:
    time_budget: float = 1800.0  # seconds of training (the schedule's length)
    max_epochs: int = 20
    batch_tokens: int = 2048  # pairs per optimiser step (sequences are grouped by length)
    lr: float = 1e-3
    warmup_steps: int = 30
    ttt_steps: int = 2  # passes of training-time test (1 = the target's features only)
    prompt_weight: float = 0.3  # loss weight of labels inside the prompt (answer tokens weigh 1)
    regress_weight: float = 1.0  # smooth-L1 to the next feature, for feedback="fc" heads
    checkpoint_every: float = 180.0  # seconds
    seed: int = 0
    max_steps: int | None = None  # when set, the schedule's length in optimiser steps instead of seconds
                                  # (the same head on a loaded machine as on an idle one)


def choose_draft_vocab(rows: list[dict], k: int, vocab: int, reserved: int = 17) -> torch.Tensor:
    """The K target ids the head can propose: the target's greedy labels by frequency, then a
    prior for low ids (BPE ids follow merge order, so low ids are common pieces), then specials."""
    counts = torch.zeros(vocab, dtype=torch.float64)
    for r in rows:
        counts.index_add_(0, r["argmax"].long(), torch.ones(len(r["argmax"]), dtype=torch.float64))
    score = counts + 1.0 / (1.0 + torch.arange(vocab, dtype=torch.float64) / 100.0)
    score[: min(reserved, vocab)] += 1e9
    return score.topk(min(k, vocab)).indices.sort().values  # [K]


def init_head(target: torch.nn.Module, k_map: torch.Tensor, feature_layers=(), feedback: str | None = None
              ) -> FeatureHead:
    """A new head shaped like a target layer: the last decoder layer's weights in the half of the
    attention input that reads the feature, its MLP and norms; fc the identity (when square);
    lm_head the target's output rows of the draft vocabulary (frozen while training). Feedback:
    "fc" for final-norm features (a draft's normed output stands in for the next one), "direct"
    for fused layers (EAGLE-3: fc's input is wider than a draft's output)."""
    feedback = feedback or ("direct" if feature_layers else "fc")
    cfg = head_config_for(target, len(k_map), tuple(feature_layers), feedback)
    head = FeatureHead(cfg, target.get_input_embeddings(), k_map)
    _, layers = decoder_layers(target)
    src = layers[-1]
    hidden = cfg.hidden_size
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            w = getattr(head.midlayer.self_attn, name).weight  # [out, 2H]
            w[:, hidden:] = getattr(src.self_attn, name).weight
            w[:, :hidden].normal_(0.0, 0.02)
        head.midlayer.self_attn.o_proj.weight.copy_(src.self_attn.o_proj.weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(head.midlayer.mlp, name).weight.copy_(getattr(src.mlp, name).weight)
        head.midlayer.input_layernorm.weight.copy_(src.input_layernorm.weight)
        head.midlayer.hidden_norm.weight.copy_(src.input_layernorm.weight)
        head.midlayer.post_attention_layernorm.weight.copy_(src.post_attention_layernorm.weight)
        head.norm.weight.copy_(target.get_decoder().norm.weight)
        if cfg.feature_size == hidden:
            head.fc.weight.copy_(torch.eye(hidden))
        rows = target.get_output_embeddings().weight
        head.lm_head.weight.copy_(rows[k_map.to(rows.device)])
    head.lm_head.requires_grad_(False)
    return head


def warm_start(head: FeatureHead, source: FeatureHead) -> None:
    """Copy a trained head's layer, fc and norm into `head` (whose draft vocabulary may differ: its
    output head stays the target's rows of its own ids)."""
    state = {k: v for k, v in source.state_dict().items() if k != "lm_head.weight"}
    mine = head.state_dict()
    wrong = [k for k, v in state.items() if k not in mine or mine[k].shape != v.shape]
    if wrong:
        raise ValueError(f"cannot start from a head shaped differently: {wrong}")
    head.load_state_dict(state, strict=False)


# -- batches ------------------------------------------------------------------------------------
def make_batches(rows: list[dict], batch_tokens: int, rng: random.Random) -> list[list[dict]]:
    rows = sorted(rows, key=lambda r: len(r["ids"]))
    batches, current = [], []
    for r in rows:
        if current and len(r["ids"]) * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current = []
        current.append(r)
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


def collate(batch: list[dict], inv_map: torch.Tensor, prompt_weight: float):
    """-> feats [B, T, F] (f_0..f_{T-1}), next_final [B, T, H] (the final norm's output at
    1..T: the teacher's input), tokens [B, T] (x_1..x_T), labels [B, T] draft ids (-1: not in the
    draft vocabulary), weight [B, T]; T = longest - 1."""
    width = max(len(r["ids"]) for r in batch) - 1
    size = batch[0]["features"].shape[1]
    feats = torch.zeros(len(batch), width + 1, size)
    fused = "final" in batch[0]  # else the features are the final norm's output themselves
    final = torch.zeros(len(batch), width + 1, batch[0]["final"].shape[1]) if fused else feats
    tokens = torch.zeros(len(batch), width, dtype=torch.long)
    labels = torch.full((len(batch), width), -1, dtype=torch.long)
    weight = torch.zeros(len(batch), width)
    for b, r in enumerate(batch):
        n = len(r["ids"]) - 1  # pairs of this sequence
        feats[b, : n + 1] = r["features"].float()
        if fused:
            final[b, : n + 1] = r["final"].float()
        tokens[b, :n] = r["ids"][1:].long()
        labels[b, :n] = inv_map[r["argmax"][1:].long()]
        w = torch.ones(n)
        w[: max(r["prompt_len"] - 2, 0)] = prompt_weight  # label of pair t is token t+2
        weight[b, :n] = w
    return feats[:, :-1], final[:, 1:], tokens, labels, weight


# -- the loss -----------------------------------------------------------------------------------
def pass_mask(width: int, step: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Pass `step` (1-based) query t sees pass 1 keys j <= t-step+1 and pass i keys j == t-step+i:
    bool [T, step*T]."""
    t = torch.arange(width, device=device)[:, None]
    j = torch.arange(width, device=device)[None, :]
    blocks = [j <= t - step + 1] + [j == t - step + i for i in range(2, step + 1)]
    return torch.cat(blocks, dim=1)


def head_loss(head: FeatureHead, feats, next_final, tokens, labels, weight, settings: TrainSettings):
    """Mean loss over the passes of training-time test, and pass 1's top-1 agreement. next_final
    [B, T, H] is the target's final norm output one position on: its distribution is the soft label
    and, for feedback="fc" heads (whose features are that output), the regression target."""
    layer = head.midlayer
    attn = layer.self_attn
    device = head.fc.weight.device
    feats, next_final, tokens, labels, weight = (x.to(device) for x in (feats, next_final, tokens, labels, weight))
    batch, width = tokens.shape
    embed = head.get_input_embeddings()
    embeds = embed(tokens.to(embed.weight.device)).detach().to(device, torch.float32)  # [B, T, H]
    cos, sin = head.rotary(torch.arange(width, device=device)[None].expand(batch, width), embeds.dtype)
    with torch.no_grad():
        teacher = F.softmax(next_final @ head.lm_head.weight.T, dim=-1)  # [B, T, K]
    keys, values = [], []
    fed = None
    total, agree = 0.0, None
    for step in range(1, settings.ttt_steps + 1):
        if step == 1:
            hidden = head.hidden_in(feats, feedback=False)
        else:
            shifted = torch.cat([torch.zeros_like(fed[:, :1]), fed[:, :-1]], dim=1)  # position t reads t-1's
            hidden = head.hidden_in(shifted, feedback=True)
        q, k, v = attn.qkv(layer.inputs(embeds, hidden), cos, sin)
        keys.append(k)
        values.append(v)
        mask = pass_mask(width, step, device)[None, None]
        pre = layer.finish(hidden, attn.attend(q, torch.cat(keys, 2), torch.cat(values, 2), mask))
        normed = head.norm(pre)
        fed = head.feedback_of(pre, normed)
        logp = F.log_softmax(head.lm_head(normed), dim=-1)  # [B, T, K]
        w = weight.clone()
        w[:, : step - 1] = 0.0  # no exact pair before them
        hard = -logp.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1) * (labels >= 0)
        soft = -(teacher * logp).sum(-1)
        loss = hard + soft
        if head.cfg.feedback == "fc":
            loss = loss + settings.regress_weight * F.smooth_l1_loss(normed, next_final, reduction="none").mean(-1)
        total = total + (loss * w).sum() / w.sum().clamp(min=1) * (0.8 ** (step - 1))
        if step == 1:
            hit = (logp.argmax(-1) == labels) & (labels >= 0)
            agree = float((hit * (w > 0)).sum() / (w > 0).sum().clamp(min=1))
    return total, agree


# -- the loop -----------------------------------------------------------------------------------
def _progress(state: dict, settings: TrainSettings) -> float:
    """How far through the schedule training is, 0..1: by steps when max_steps is set, else by time."""
    if settings.max_steps:
        return state["step"] / settings.max_steps
    return state["elapsed"] / settings.time_budget


def train_head(head: FeatureHead, rows: list[dict], settings: TrainSettings, checkpoint: Path) -> dict:
    """Train in place for settings.time_budget seconds, or settings.max_steps optimiser steps when
    set (resuming `checkpoint` when present)."""
    vocab = head.cfg.vocab_size
    inv_map = torch.full((vocab,), -1, dtype=torch.long)
    token_map = head.draft_token_map.cpu()
    inv_map[token_map] = torch.arange(len(token_map))
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0, betas=(0.9, 0.95))
    state = {"step": 0, "elapsed": 0.0, "epoch": 0, "batch": 0}
    if checkpoint.is_file():
        saved = torch.load(checkpoint)
        head.load_state_dict(saved["head"], strict=False)
        opt.load_state_dict(saved["optimizer"])
        state = saved["progress"]
    head.train()
    bar = tqdm(total=int(settings.time_budget), initial=int(state["elapsed"]), unit="s", desc="train")
    last_save = time.perf_counter()
    agree_avg = state.get("top1")
    batches: list = []
    while _progress(state, settings) < 1.0 and state["epoch"] < settings.max_epochs:
        batches = make_batches(rows, settings.batch_tokens, random.Random(settings.seed + state["epoch"]))
        while state["batch"] < len(batches) and _progress(state, settings) < 1.0:
            began = time.perf_counter()
            lr = settings.lr * min(1.0, (state["step"] + 1) / settings.warmup_steps) * max(
                0.1, 1.0 - _progress(state, settings))
            for group in opt.param_groups:
                group["lr"] = lr
            loss, agree = head_loss(head, *collate(batches[state["batch"]], inv_map, settings.prompt_weight),
                                    settings)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            state["step"] += 1
            state["batch"] += 1
            spent = time.perf_counter() - began
            state["elapsed"] += spent
            agree_avg = agree if agree_avg is None else 0.95 * agree_avg + 0.05 * agree
            state["top1"] = agree_avg
            bar.update(min(spent, max(settings.time_budget - bar.n, 0.0)))
            bar.set_postfix(epoch=state["epoch"], loss=f"{loss.item():.3f}", top1=f"{agree_avg:.3f}")
            if time.perf_counter() - last_save > settings.checkpoint_every:
                _save(checkpoint, head, opt, state)
                last_save = time.perf_counter()
        if state["batch"] >= len(batches):
            state["epoch"] += 1
            state["batch"] = 0
    bar.close()
    _save(checkpoint, head, opt, state)
    head.eval()
    return {"steps": state["step"], "epochs": round(state["epoch"] + state["batch"] / max(1, len(batches)), 2),
            "train_seconds": round(state["elapsed"], 1), "train_top1_ema": round(agree_avg or 0.0, 4)}


def _save(path: Path, head: FeatureHead, opt, state: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"head": head.state_dict(), "optimizer": opt.state_dict(), "progress": dict(state)}, tmp)
    tmp.rename(path)


def pairs_of(rows: list[dict]) -> int:
    return sum(len(r["ids"]) - 1 for r in rows)


def describe(rows: list[dict]) -> dict:
    answer = sum(len(r["ids"]) - r["prompt_len"] for r in rows)
    return {"sequences": len(rows), "positions": pairs_of(rows), "answer_tokens": answer}


