"""Tiny random Llama-family models and an offline character tokenizer.

Used by the test-suite and by the ``tiny-llama`` / ``tiny-qwen3`` aliases for smoke runs with no
download. Weights are random (seeded): numbers from these models say nothing about quality.
"""

from __future__ import annotations

import string

import torch

# 5 specials + printable ASCII -> fits a 128-token vocabulary.
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<mask>"]
CHARS = list(string.printable)


def char_tokenizer(*, with_pad: bool = False, vocab_size: int = 128):
    """A character-level ``PreTrainedTokenizerFast`` built offline (no hub).

    Args:
        with_pad: register ``<pad>`` as the pad token; False mimics tokenizers without one (Llama).
        vocab_size: must be >= 105 (specials + printable ASCII).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    assert len(vocab) <= vocab_size, "vocab_size too small for the character tokenizer"
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    kw = {"tokenizer_object": tk, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    if with_pad:
        kw["pad_token"] = "<pad>"
    return PreTrainedTokenizerFast(**kw)


#: Gemma 3's shape rules at tiny size: MQA (one KV head for four query heads), head_dim 32 != D / H,
#: a sliding-window layer (window 8, shorter than test sequences) and a global one with its own RoPE
#: base, tied embeddings, and a query scale (query_pre_attn_scalar) that is not head_dim.
_GEMMA3 = {
    "num_key_value_heads": 1,
    "head_dim": 32,
    "layer_types": ["sliding_attention", "full_attention"],
    "sliding_window": 8,
    "query_pre_attn_scalar": 24,
    "tie_word_embeddings": True,
    "pad_token_id": 3,
}


def tiny_config(kind: str = "llama", **overrides):
    """A small seeded config: 2 layers, D=64, H=4, H_kv=2, F=128, vocab 128 (STYLE.md tests).

    Args:
        kind: ``llama``, ``mistral``, ``qwen2``, ``qwen3`` or ``gemma3`` (text-only Gemma 3 with
            the shape rules in ``_GEMMA3``).
        overrides: any config field.
    """
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    base = {
        "vocab_size": 128,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "max_position_embeddings": 512,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        # Wider than HF's 0.02 so that random logits are far from uniform (loader smoke checks).
        "initializer_range": 0.1,
    }
    if kind == "gemma3":
        base.update(_GEMMA3)
    base.update(overrides)
    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
           "gemma3": Gemma3TextConfig}[kind]
    cfg = cls(**base)
    cfg.architectures = ["Gemma3ForCausalLM" if kind == "gemma3" else cls.__name__.replace("Config", "ForCausalLM")]
    return cfg


def tiny_model(kind: str = "llama", seed: int = 0, dtype=torch.float32, **overrides):
    """A seeded random ``*ForCausalLM`` from ``tiny_config`` (eval mode, eager-free sdpa)."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(kind, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    # Non-zero biases so that a dropped bias shows up; and Gemma's norm weights (stored as w in
    # ``x * (1 + w)``, zero at init) away from zero so that a runtime scaling by w or by 1 shows up.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(".bias") or (kind == "gemma3" and "norm" in n):
                p.normal_(0.0, 0.1)
    return model.eval()
