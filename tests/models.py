"""Tiny seeded models built in code (no hub access): targets, drafts and deliberately wrong drafts."""
from __future__ import annotations

import copy

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

VOCAB = 96


def tiny_llama(
    seed: int, layers: int = 2, vocab: int = VOCAB, init_range: float = 0.02, attn: str = "sdpa", hidden: int = 48
):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=init_range, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    config._attn_implementation = attn
    return LlamaForCausalLM(config).eval()


def tiny_gpt2(seed: int, layers: int = 2, vocab: int = VOCAB):
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=vocab, n_embd=48, n_layer=layers, n_head=4, n_positions=256,
                        bos_token_id=None, eos_token_id=None)
    config._attn_implementation = "sdpa"
    return GPT2LMHeadModel(config).eval()


def tiny_qwen2(seed: int, layers: int = 2, vocab: int = VOCAB):
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab, hidden_size=48, intermediate_size=96, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config._attn_implementation = "sdpa"
    return Qwen2ForCausalLM(config).eval()


def perturbed(model: torch.nn.Module, scale: float, seed: int) -> torch.nn.Module:
    """A copy with Gaussian noise on every weight: an ordinary draft that is right some of the time."""
    torch.manual_seed(seed)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.add_(torch.randn_like(p) * scale * (p.std() if p.numel() > 1 else 1.0))
    return twin


class ShiftedDraft(torch.nn.Module):
    """Wraps a copy of the target and rolls its logits by one token: its argmax is never the target's."""

    def __init__(self, target: torch.nn.Module) -> None:
        super().__init__()
        self.inner = copy.deepcopy(target)
        self.config = self.inner.config

    def get_input_embeddings(self):
        return self.inner.get_input_embeddings()

    def forward(self, **kwargs):
        out = self.inner(**kwargs)
        out.logits = out.logits.roll(1, dims=-1)
        return out


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()
