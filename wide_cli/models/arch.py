"""Architecture facts the router needs, read from a Hugging Face config.

Supported: the Llama family, whose decoder layers share one layout
(``input_layernorm -> self_attn(q,k,v,o) -> post_attention_layernorm -> mlp(gate,up,down)``):
LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM (q/k/v bias) and
Qwen3ForCausalLM (per-head q_norm/k_norm); and Gemma3ForCausalLM (text), whose layer wraps each
block in two RMSNorms ("sandwich" norms: ``input_layernorm -> attn -> post_attention_layernorm``,
``pre_feedforward_layernorm -> mlp -> post_feedforward_layernorm``, each norm scaling by
``1 + w``), with per-head q/k norms, GELU-tanh gating, embeddings scaled by sqrt(D), and sliding-
window and global layers with their own RoPE bases (Gemma Team, "Gemma 3 Technical Report", 2025).
"""

from __future__ import annotations

from dataclasses import dataclass

from wide_cli.errors import ConfigError, ModelSourceError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
)
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
#: model types whose decoder layer normalises each block's output again before the residual add
SANDWICH_NORM_MODEL_TYPES = ("gemma3_text",)
#: architectures people try that are not supported, and why (named in the refusal)
_NOT_SUPPORTED = {
    "Gemma3ForConditionalGeneration": "the multimodal Gemma 3 (vision tower); wide prunes the text-only "
                                      "Gemma3ForCausalLM (gemma-3-270m, or a text_config checkpoint)",
    "Gemma2ForCausalLM": "Gemma 2 (attention and final logit soft-capping)",
    "GemmaForCausalLM": "Gemma 1",
}
#: the two routed blocks of a decoder layer (attention: query-head groups; ffn: channel groups),
#: in the order every table, file and tensor name of wide lists them
ROUTED_MODULES = ("attention", "ffn")


@dataclass(frozen=True)
class ModelShape:
    """Per-layer sizes of a decoder (identical for every layer in the supported family).

    Attributes:
        num_layers: number of decoder layers.
        hidden_size: D, width of the residual stream.
        num_heads: H, query heads.
        num_kv_heads: H_kv, key/value heads (H % H_kv == 0; GQA when H_kv < H).
        head_dim: d, per-head width (may differ from D / H, e.g. Qwen3).
        intermediate_size: F, SwiGLU channels.
        vocab_size: vocabulary size.
        model_type: the Hugging Face ``model_type`` string.
    """

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    model_type: str

    @property
    def heads_per_kv(self) -> int:
        """Query heads sharing one KV head (H / H_kv)."""
        return self.num_heads // self.num_kv_heads

    @property
    def sandwich_norms(self) -> bool:
        """True when each block's output is RMS-normalised before the residual add (Gemma 3)."""
        return self.model_type in SANDWICH_NORM_MODEL_TYPES


def check_supported(config) -> None:
    """Raise ModelSourceError unless ``config`` is a supported decoder (``SUPPORTED_ARCHITECTURES``;
    the message names a known unsupported relative, e.g. the multimodal Gemma 3, and why)."""
    archs = list(getattr(config, "architectures", None) or [])
    model_type = getattr(config, "model_type", None)
    if model_type in SUPPORTED_MODEL_TYPES:
        _check_variant(config)
        return
    if str(model_type).removeprefix("wide_") in SUPPORTED_MODEL_TYPES and hasattr(config, "wide_routing"):
        return  # an `--format hf` export of a supported model (``wide_llama``, ...)
    if any(a in SUPPORTED_ARCHITECTURES for a in archs):
        return
    name = archs[0] if archs else model_type
    why = _NOT_SUPPORTED.get(name)
    raise ModelSourceError(
        f"unsupported architecture {name!r}" + (f" ({why})" if why else ""),
        f"wide supports {', '.join(SUPPORTED_ARCHITECTURES)}",
    )


def _check_variant(config) -> None:
    """Refuse options of a supported model type that the routed layer does not implement."""
    if getattr(config, "model_type", None) != "gemma3_text":
        return
    for attr, what in (("attn_logit_softcapping", "attention logit soft-capping"),
                       ("final_logit_softcapping", "final logit soft-capping"),
                       ("use_bidirectional_attention", "bidirectional attention")):
        if getattr(config, attr, None):
            raise ModelSourceError(f"Gemma 3 with {what} ({attr}={getattr(config, attr)!r}) is not supported",
                                   "wide supports the released Gemma 3 text checkpoints (causal, no soft-capping)")


def model_shape(config) -> ModelShape:
    """Read a ModelShape from a Hugging Face config (after ``check_supported``)."""
    check_supported(config)
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return ModelShape(
        num_layers=int(config.num_hidden_layers),
        hidden_size=int(config.hidden_size),
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=int(head_dim),
        intermediate_size=int(config.intermediate_size),
        vocab_size=int(config.vocab_size),
        model_type=str(config.model_type),
    )


#: config attributes that hold a model's context length, in lm-eval's order of preference.
CONTEXT_ATTRS = ("n_positions", "max_position_embeddings", "n_ctx")


def context_length(config) -> int | None:
    """The model's context length (positions) from its config, or None when it declares none."""
    cfg = getattr(config, "text_config", None) or config
    for attr in CONTEXT_ATTRS:
        v = getattr(cfg, attr, None)
        if v is not None:
            return int(v)
    return None


def check_context(n_tokens: int, max_len: int | None, what: str, fix: str) -> None:
    """The one context-length rule of every stage: ``n_tokens`` positions must fit in
    ``max_len`` (None = no limit declared).

    Raises:
        ConfigError: "``what`` exceeds the model's context length ``max_len``" with ``fix``.
    """
    if max_len is not None and n_tokens > max_len:
        raise ConfigError(f"{what} exceeds the model's context length {max_len}", fix)
