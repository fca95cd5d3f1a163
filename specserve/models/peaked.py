"""Random weights whose greedy choice is robust: what a planted-acceptance benchmark needs.

A random model's next-token logits are nearly flat, so its greedy token can flip between two
kernels that round differently (a γ+1-token verify and a 1-token decode in bf16, a batch of 1 and
one of 32). A planted drafter proposes the target's *reference* tokens (measured once), so such
flips would move the measured α away from the planted one. `peak` fixes that without changing
any shape or cost: the embedding gets a large scale, so that the residual stream is dominated by
the current token, and the output head is the embedding with its rows permuted, so that one next
token per current token wins by tens of standard deviations. This module imports torch only.
"""
from __future__ import annotations

import torch

EMBED_STD = 16.0


@torch.no_grad()
def peak(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Make `model`'s greedy next token robust to kernel noise (see the module's docstring), in
    place, on the device and in the dtype its weights already have."""
    embed = model.get_input_embeddings().weight  # [V, H]
    output = model.get_output_embeddings().weight  # [V, H]
    if output.data_ptr() == embed.data_ptr():
        raise ValueError("peaked random weights need an output head of its own (tie_word_embeddings: false)")
    embed.normal_(0.0, EMBED_STD, generator=torch.Generator(device=embed.device).manual_seed(seed))
    perm = torch.randperm(embed.shape[0], generator=torch.Generator().manual_seed(seed)).to(embed.device)
    output.copy_(embed[perm] / EMBED_STD)
    return model
