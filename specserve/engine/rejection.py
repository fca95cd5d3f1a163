"""The acceptance rule of speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

For each row b with g_b draft tokens x_1..x_g proposed from distributions q_1..q_g, and target
distributions p_1..p_{g+1} (p_j is the target's distribution for the position of x_j):
accept x_j while u_j < p_j(x_j) / q_j(x_j). At the first rejection j, the row's next token is the
*recovered* token, sampled from norm(max(0, p_j - q_j)); when all g are accepted it is the *bonus*
token, sampled from p_{g+1}. Greedy rows have one-hot p and q, so the same rule reduces to "accept
while the draft equals the target's argmax", which `greedy_accept` computes from token ids alone.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import sample_with_uniforms


@dataclass(frozen=True)
class AcceptResult:
    num_accepted: torch.Tensor  # [B] int64, accepted draft tokens per row (0..g_b)
    next_token: torch.Tensor  # [B] int64, the recovered (a < g_b) or bonus (a == g_b) token

    def tokens(self, draft_tokens: torch.Tensor) -> list[list[int]]:
        """The tokens each row gains this step: accepted drafts then the next token."""
        drafts = draft_tokens.tolist()
        return [
            drafts[b][:a] + [t]
            for b, (a, t) in enumerate(zip(self.num_accepted.tolist(), self.next_token.tolist()))
        ]


def _leading_true(accepted: torch.Tensor) -> torch.Tensor:
    """accepted [B, G] bool -> [B] int64 count of leading True values."""
    return accepted.long().cumprod(dim=-1).sum(dim=-1)


def greedy_accept(
    target_argmax: torch.Tensor, draft_tokens: torch.Tensor, num_draft: torch.Tensor
) -> AcceptResult:
    """Greedy rule. target_argmax [B, G+1], draft_tokens [B, G], num_draft [B] (g_b <= G)."""
    gamma = draft_tokens.shape[1]
    if gamma == 0:  # no drafts (a plain step): the target's choice, and none of the rule's kernels
        next_token = target_argmax[:, 0]
        return AcceptResult(torch.zeros_like(next_token), next_token)
    in_range = torch.arange(gamma, device=draft_tokens.device)[None, :] < num_draft[:, None]  # [B, G]
    num_accepted = _leading_true((draft_tokens == target_argmax[:, :-1]) & in_range)  # [B]
    next_token = target_argmax.gather(1, num_accepted[:, None]).squeeze(1)  # [B]
    return AcceptResult(num_accepted, next_token)


def rejection_sample(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    num_draft: torch.Tensor,
    accept_uniforms: torch.Tensor,
    final_uniforms: torch.Tensor,
) -> AcceptResult:
    """Stochastic rule.

    target_probs [B, G+1, V]; draft_tokens [B, G]; draft_probs [B, G, V] (the exact q each draft
    token was sampled from); num_draft [B] (g_b <= G); accept_uniforms [B, G] and final_uniforms [B]
    in [0, 1). Positions j >= g_b of a row are ignored.
    """
    batch, gamma = draft_tokens.shape
    idx = draft_tokens[..., None]  # [B, G, 1]
    p_of_x = target_probs[:, :-1].gather(-1, idx).squeeze(-1)  # [B, G]
    q_of_x = draft_probs.gather(-1, idx).squeeze(-1)  # [B, G]
    in_range = torch.arange(gamma, device=draft_tokens.device)[None, :] < num_draft[:, None]
    # u < p/q, written without the division (q(x) > 0 because x was drawn from q).
    accepted = (accept_uniforms.to(p_of_x.dtype) * q_of_x < p_of_x) & in_range  # [B, G]
    num_accepted = _leading_true(accepted)  # [B]

    rows = torch.arange(batch, device=draft_tokens.device)
    p_next = target_probs[rows, num_accepted]  # [B, V]
    padded_q = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)  # [B, G+1, V]
    q_next = padded_q[rows, num_accepted]  # [B, V]; zeros where the bonus token is due
    rejected = (num_accepted < num_draft)[:, None]  # [B, 1]
    residual = torch.where(rejected, (p_next - q_next).clamp_min(0.0), p_next)  # [B, V]
    # A rejection implies p(x) < q(x) somewhere, so the residual has mass; guard float round-off.
    empty = residual.sum(-1, keepdim=True) <= 0
    residual = torch.where(empty, p_next, residual)
    next_token = sample_with_uniforms(residual, final_uniforms)
    return AcceptResult(num_accepted, next_token)


def rejection_sample_deterministic(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_draft: torch.Tensor,
    accept_uniforms: torch.Tensor,
    final_uniforms: torch.Tensor,
) -> AcceptResult:
    """The stochastic rule for drafts a deterministic drafter chose (prompt lookup): q is one-hot
    at each draft, so x is accepted with probability p(x) and a rejection samples from p with x
    removed (max(0, p - onehot(x)), renormalised); no [B, G, V] q is ever built.

    target_probs [B, G+1, V]; draft_tokens [B, G]; num_draft [B]; accept_uniforms [B, G];
    final_uniforms [B].
    """
    batch, gamma = draft_tokens.shape
    p_of_x = target_probs[:, :-1].gather(-1, draft_tokens[..., None]).squeeze(-1)  # [B, G]
    in_range = torch.arange(gamma, device=draft_tokens.device)[None, :] < num_draft[:, None]
    num_accepted = _leading_true((accept_uniforms.to(p_of_x.dtype) < p_of_x) & in_range)  # [B]
    rows = torch.arange(batch, device=draft_tokens.device)
    p_next = target_probs[rows, num_accepted]  # [B, V]
    padded = torch.cat([draft_tokens, draft_tokens.new_zeros(batch, 1)], dim=1)  # [B, G+1]
    rejected_token = padded[rows, num_accepted]  # [B]; meaningless where the bonus token is due
    rejected = (num_accepted < num_draft)[:, None]  # [B, 1]
    residual = torch.where(rejected, p_next.scatter(-1, rejected_token[:, None], 0.0), p_next)  # [B, V]
    empty = residual.sum(-1, keepdim=True) <= 0  # p was one-hot at x: float round-off only
    residual = torch.where(empty, p_next, residual)
    return AcceptResult(num_accepted, sample_with_uniforms(residual, final_uniforms))
