"""Tiny models for tests and demos, built in code (no hub): a byte-level tokenizer + seeded Llamas.

Tokenizer: ids 0..255 are the 256 bytes, then three special tokens. Any text round-trips, and a
multi-byte character spans several tokens, which is what exercises incremental detokenisation.
"""
from __future__ import annotations

import copy
import functools

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 256, 257, 258
EOS_TOKEN_IDS = [256, 258]  # <|endoftext|>, <|im_end|>
VOCAB_SIZE = 260  # 256 bytes + 3 specials, padded to an even size
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_chars() -> list[str]:
    """The printable character standing for each byte 0..255 in byte-level BPE vocabularies."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


@functools.lru_cache(maxsize=None)
def byte_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {c: b for b, c in enumerate(_byte_chars())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_llama(seed: int = 0, layers: int = 2, hidden_size: int = 64, max_position_embeddings: int = 512,
               noise: float = 0.0, noise_seed: int = 1) -> LlamaForCausalLM:
    """A seeded random Llama over the byte vocabulary; with noise > 0, its weights plus relative noise."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings, bos_token_id=None, eos_token_id=EOS_TOKEN_IDS,
        pad_token_id=None,
    )
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).eval()
    if noise > 0:
        model = _with_noise(model, noise, noise_seed)
    model.generation_config.eos_token_id = EOS_TOKEN_IDS
    return model


def _with_noise(model: torch.nn.Module, scale: float, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            spread = p.std() if p.numel() > 1 else torch.tensor(1.0)
            p.add_(torch.randn(p.shape, generator=gen) * scale * spread)
    return twin
