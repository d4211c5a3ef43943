"""Architecture facts the router needs, read from a Hugging Face config.

Supported: the Llama family, whose decoder layers share one layout
(``input_layernorm -> self_attn(q,k,v,o) -> post_attention_layernorm -> mlp(gate,up,down)``):
LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM (q/k/v bias) and
Qwen3ForCausalLM (per-head q_norm/k_norm).
"""

from __future__ import annotations

from dataclasses import dataclass

from wide_cli.errors import ConfigError, ModelSourceError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
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


def check_supported(config) -> None:
    """Raise ModelSourceError unless ``config`` is a supported Llama-family decoder."""
    archs = list(getattr(config, "architectures", None) or [])
    model_type = getattr(config, "model_type", None)
    if model_type in SUPPORTED_MODEL_TYPES:
        return
    if str(model_type).removeprefix("wide_") in SUPPORTED_MODEL_TYPES and hasattr(config, "wide_routing"):
        return  # an `--format hf` export of a supported model (``wide_llama``, ...)
    if any(a in SUPPORTED_ARCHITECTURES for a in archs):
        return
    name = archs[0] if archs else model_type
    raise ModelSourceError(
        f"unsupported architecture {name!r}",
        f"wide supports {', '.join(SUPPORTED_ARCHITECTURES)}",
    )


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
