"""Held-out acceptance of a feature head: the engine with the head against the target alone."""
from __future__ import annotations

import time

from specserve.engine.step import per_token_alpha
from specserve.prompts import GENERAL, by_category, encode, load_records
from specserve.engine import SamplingParams, SpeculativeEngine
from specserve.engine.feature_drafter import FeatureDrafterSpec


def _run(model, prompts, spec, gamma: int, adaptive: bool, max_tokens: int) -> dict:
    engine = SpeculativeEngine(model, drafter=spec, num_speculative_tokens=gamma if spec else 0, adaptive=adaptive)
    if spec and adaptive:
        engine.calibrate()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    began = time.perf_counter()
    outs = [engine.generate([p], params)[0] for p in prompts]  # batch 1
    seconds = time.perf_counter() - began
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    rejections = sum(o.metrics.num_rejections for o in outs)
    tokens = sum(len(o.token_ids) for o in outs)
    alpha = per_token_alpha(accepted, rejections)
    return {"tokens": tokens, "seconds": round(seconds, 3), "tok_s": round(tokens / seconds, 2),
            "drafted": drafted, "accepted": accepted,
            "alpha": None if alpha is None else round(alpha, 4),
            "accept_ratio": round(accepted / drafted, 4) if drafted else None,
            "outputs": [o.token_ids for o in outs]}


def acceptance_report(model, tokenizer, head_path, per_category: int, max_tokens: int, gamma: int) -> dict:
    """Per held-out category (chat, code, summarise): greedy α of the head at fixed γ, and tok/s of
    target-only vs the head with adaptive γ (batch 1, one after the other in this process)."""
    spec = FeatureDrafterSpec(str(head_path))
    out = {}
    for category, records in by_category(load_records(GENERAL)).items():
        prompts = [encode(tokenizer, r) for r in records[:per_category]]
        base = _run(model, prompts, None, 0, False, max_tokens)
        fixed = _run(model, prompts, spec, gamma, False, max_tokens)
        adaptive = _run(model, prompts, spec, gamma, True, max_tokens)
        same = base["outputs"] == fixed["outputs"] == adaptive["outputs"]
        out[category] = {
            "prompts": len(prompts), "alpha_fixed_gamma": fixed["alpha"], "gamma": gamma,
            "accept_ratio_fixed_gamma": fixed["accept_ratio"],
            "target_tok_s": base["tok_s"], "head_fixed_tok_s": fixed["tok_s"], "head_adaptive_tok_s": adaptive["tok_s"],
            "speedup_fixed": round(fixed["tok_s"] / base["tok_s"], 3),
            "speedup_adaptive": round(adaptive["tok_s"] / base["tok_s"], 3),
            "alpha_adaptive": adaptive["alpha"], "identical": same,
        }
    return out


def format_report(report: dict) -> str:
    head = (f"{'category':<11}{'α@γ':>7}{'acc/dr':>7}{'target tok/s':>14}{'head tok/s':>12}{'speedup':>9}"
            f"{'adaptive':>10}{'same':>6}")
    lines = [head, "-" * len(head)]
    for category, r in report.items():
        alpha = "".join(f"{r[k]:>7.3f}" if r.get(k) is not None else f"{'-':>7}"
                        for k in ("alpha_fixed_gamma", "accept_ratio_fixed_gamma"))
        lines.append(f"{category:<11}{alpha}{r['target_tok_s']:>14.1f}{r['head_fixed_tok_s']:>12.1f}"
                     f"{r['speedup_fixed']:>9.2f}{r['speedup_adaptive']:>10.2f}{'yes' if r['identical'] else 'NO':>6}")
    return "\n".join(lines)
