"""The backend interface, the backend-neutral weights it receives, and the one table of backends.

The engine (``runtime/engine.py``) owns everything dense and shared: embeddings, RMSNorms,
routers, RoPE, the KV cache, residual adds and the LM head. A backend owns the routed work of a
decoder layer (Q/O projections, SwiGLU FFN, attention) and the weight layout that makes that
work fast on its hardware; it receives the weights once through ``prepare_layer`` and gets them
back, prepared, on every call.

Masks are group-level ``bool`` tensors, ``True`` = execute, ``None`` = every group executes
(see ``runtime/ops.py`` for the operator semantics every backend must reproduce).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from wide_cli.errors import ConfigError


@dataclass
class RouterWeights:
    """One learned router (fp32): ``Linear(D, r) -> Linear(r, 2G)``, logits ``[..., G, 2]``.

    Attributes:
        wc, bc: compressor ``[r, D]``, ``[r]``.
        wr, br: router ``[2G, r]``, ``[2G]``.
        standin: ``[G, D]`` what each skipped group adds to the module output
            (``RoutingConfig.standin``), or None (skipped groups add nothing).
        standin_in, standin_out: ``[G, R, D]`` each, the low-rank stand-in maps (``lowrank:R``:
            a skipped group also adds ``(x @ standin_in[g].T) @ standin_out[g]`` of the module's
            normed input), or None.
    """

    wc: torch.Tensor
    bc: torch.Tensor
    wr: torch.Tensor
    br: torch.Tensor
    standin: torch.Tensor | None = None
    standin_in: torch.Tensor | None = None
    standin_out: torch.Tensor | None = None

    @property
    def groups(self) -> int:
        return self.wr.shape[0] // 2


@dataclass
class LayerWeights:
    """One decoder layer in Hugging Face layout (``Linear.weight`` is ``[out, in]``).

    Sizes are read from the tensors, never from the model config: a layer may have fewer
    query heads, KV heads or channels than its neighbours.

    Attributes:
        index: layer number.
        wq ``[H*d, D]``, wk/wv ``[H_kv*d, D]``, wo ``[D, H*d]``; bq/bk/bv/bo biases or None
            (Qwen2 has q/k/v biases).
        w_gate, w_up ``[F, D]``, w_down ``[D, F]``.
        ln_attn, ln_ffn ``[D]``: the RMSNorm weights of the attention and FFN inputs (Llama:
            input / post-attention; Gemma 3: input / pre-feedforward, ``1 + w`` folded, fp32).
        ln_attn_out, ln_ffn_out ``[D]`` or None: the RMSNorms of the attention and FFN outputs
            before the residual add (Gemma 3's sandwich norms: post-attention / post-feedforward,
            ``1 + w`` folded, fp32); a token that executes no group of a block adds nothing then.
        q_norm, k_norm ``[d]`` or None: Qwen3 / Gemma 3 per-head RMSNorms.
        head_dim: d. num_heads, num_kv_heads, intermediate_size: from the weight shapes.
        attn_group_size, ffn_group_size: heads / channels per routed group of this layer.
        router_attention, router_ffn: learned routers, or None.
        keep_attention, keep_ffn: static ``[G]`` bool keep masks (static-width), or None.
        window: sliding-window size in slots, or None.
        act: the gating activation of the FFN, ``silu`` (SwiGLU) or ``gelu_tanh`` (Gemma 3's
            ``gelu_pytorch_tanh``).
        attn_scale: softmax scale of the attention scores, or None for ``head_dim ** -0.5``
            (Gemma 3: ``query_pre_attn_scalar ** -0.5``).
        rope: ``(inv_freq [d/2] fp32, attention_scaling)`` of this layer's RoPE, or None for the
            model's (Gemma 3: one per layer type, the same tuple object for layers of one type).
    """

    index: int
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    ln_attn: torch.Tensor
    ln_ffn: torch.Tensor
    head_dim: int
    attn_group_size: int
    ffn_group_size: int
    bq: torch.Tensor | None = None
    bk: torch.Tensor | None = None
    bv: torch.Tensor | None = None
    bo: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    router_attention: RouterWeights | None = None
    router_ffn: RouterWeights | None = None
    keep_attention: torch.Tensor | None = None
    keep_ffn: torch.Tensor | None = None
    window: int | None = None
    ln_attn_out: torch.Tensor | None = None
    ln_ffn_out: torch.Tensor | None = None
    act: str = "silu"
    attn_scale: float | None = None
    rope: tuple[torch.Tensor, float] | None = None

    @property
    def num_heads(self) -> int:
        return self.wq.shape[0] // self.head_dim

    @property
    def num_kv_heads(self) -> int:
        return self.wk.shape[0] // self.head_dim

    @property
    def intermediate_size(self) -> int:
        return self.w_gate.shape[0]

    @property
    def attn_groups(self) -> int:
        return self.num_heads // self.attn_group_size

    @property
    def ffn_groups(self) -> int:
        return self.intermediate_size // self.ffn_group_size

    def qkv_bias(self) -> torch.Tensor | None:
        """The Q, K and V biases as one ``[(H + 2 H_kv) d]`` vector, the bias of a fused QKV
        projection (zeros where one of them is missing), or None when the layer has none."""
        if all(b is None for b in (self.bq, self.bk, self.bv)):
            return None
        return torch.cat([
            b if b is not None else torch.zeros(w.shape[0], dtype=w.dtype)
            for b, w in ((self.bq, self.wq), (self.bk, self.wk), (self.bv, self.wv))
        ])  # fmt: skip


@dataclass
class ModelWeights:
    """A whole model in backend-neutral form (what ``Runtime`` builds from an export or a model).

    Attributes:
        embed ``[V, D]``; lm_head ``[V, D]`` (the same tensor when tied); final_norm ``[D]``.
        layers: one ``LayerWeights`` per decoder layer.
        rms_eps: RMSNorm epsilon. inv_freq ``[d/2]`` fp32 and rope_scale: RoPE tables computed
            by transformers' ``ROPE_INIT_FUNCTIONS`` (so scaled RoPE such as ``llama3`` matches).
        eos_token_ids: ids that end generation.
        tied: lm_head is embed.
        max_positions: the model's context length (config ``max_position_embeddings``), None
            when the config declares none.
        embed_scale: the factor the embeddings are multiplied by (Gemma 3: sqrt(D), applied in
            the compute dtype as transformers does), or None.
        norm_fp32: the RMSNorm weights (``final_norm``, every layer's) are fp32 and multiply the
            fp32 normalised value before the one cast to the compute dtype (Gemma 3, whose
            weights are stored as ``w`` in ``x * (1 + w)`` and arrive here as ``1 + w``); False:
            Llama's rounding (normalised value cast first, weight in the compute dtype).
    """

    embed: torch.Tensor
    lm_head: torch.Tensor
    final_norm: torch.Tensor
    layers: list[LayerWeights]
    rms_eps: float
    inv_freq: torch.Tensor
    rope_scale: float
    eos_token_ids: tuple[int, ...] = ()
    tied: bool = False
    extra: dict = field(default_factory=dict)
    max_positions: int | None = None
    embed_scale: float | None = None
    norm_fp32: bool = False


class Counter:
    """What a backend executed, counted while it runs (``wide bench``'s executed share, tests).

    Attributes:
        macs: multiply-adds of the weight GEMMs actually issued (a dense GEMM whose result is
            masked afterwards counts in full), LM head included.
        attn_macs: multiply-adds of attention scores and of the weighted sum of V, per head the
            kernel computed (a dense pass that masks heads afterwards counts every head).
        router_macs: multiply-adds of the routers (the engine counts them).
        weight_bytes: bytes of weights (int8: and scales) the GEMMs read.
        trace: None, or a list that receives ``(first_byte_address, nbytes)`` of every weight and
            scale block a GEMM reads (tests check that skipped groups are never read).
    """

    def __init__(self):
        self.macs = 0
        self.attn_macs = 0
        self.router_macs = 0
        self.weight_bytes = 0
        self.trace: list | None = None

    def reset(self) -> None:
        self.macs = self.attn_macs = self.router_macs = self.weight_bytes = 0

    @property
    def total(self) -> int:
        return self.macs + self.attn_macs + self.router_macs


@runtime_checkable
class Backend(Protocol):
    """What a backend implements. ``P`` below is whatever ``prepare_layer`` returned.

    Attributes:
        name: the key in ``BACKENDS``.
        device: where its tensors live (the engine allocates activations and the cache there).
    """

    name: str
    device: torch.device

    def prepare_layer(self, layer: LayerWeights, dtype: torch.dtype) -> Any:
        """Arrange one layer's weights for this backend (called once at load)."""
        ...

    def attn_in(
        self, p: Any, x: torch.Tensor, mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q (routed, ``gemm_mn``) and dense K/V projections.

        Args:
            x: ``[M, D]`` normed hidden states. mask: ``[M, G_a]`` bool or None.
        Returns:
            ``q [M, H*d]`` (exact zeros on skipped head groups, bias included),
            ``k, v [M, H_kv*d]`` (dense: every token, since later tokens attend to them whatever this one skipped).
        """
        ...

    def attn_out(self, p: Any, o: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """O projection over active head groups (``gemm_k``): ``o [M, H*d] -> [M, D]``."""
        ...

    def mlp(self, p: Any, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Routed gated FFN: ``gemm_mn_swiglu`` (with the layer's ``act``) then ``gemm_k``;
        ``x [M, D] -> [M, D]``. mask: ``[M, G_f]`` bool or None."""
        ...

    def attention_prefill(self, q, k, v, head_mask, *, key_valid, q_offset, scale, window) -> torch.Tensor:
        """Same contract as ``ops.attention_prefill``."""
        ...

    def attention_decode(self, q, k_cache, v_cache, head_mask, key_valid, *, scale, window) -> torch.Tensor:
        """Same contract as ``ops.attention_decode``."""
        ...


# name -> class, or "module:Class" imported on first use (the CUDA backend needs cupy, which must
# not be imported by `wide --help` or on CPU-only machines).
BACKENDS: dict[str, Any] = {
    "reference": "wide_cli.runtime.reference:ReferenceBackend",
    "cpu": "wide_cli.runtime.cpu:CpuBackend",
    "cupy": "wide_cli.runtime.cupy_backend:CupyBackend",
}

# Backends that need an NVIDIA GPU.
CUDA_BACKENDS = ("cupy",)


def backend_class(name: str) -> type:
    """Resolve a backend name from ``BACKENDS`` to its class.

    Raises:
        ConfigError: unknown name; ``cupy`` without a CUDA device or without cupy installed.
    """
    if name not in BACKENDS:
        raise ConfigError(f"unknown backend {name!r}", f"choose one of {', '.join(BACKENDS)}")
    if name in CUDA_BACKENDS and not torch.cuda.is_available():
        raise ConfigError(
            f"backend {name!r} needs an NVIDIA GPU: no CUDA device (torch.cuda.is_available() is False)",
            "use --backend cpu, or run on a machine with a GPU and a CUDA build of torch",
        )
    entry = BACKENDS[name]
    if isinstance(entry, str):
        mod, _, cls = entry.partition(":")
        try:
            module = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            raise ConfigError(
                f"backend {name!r} is not available ({e.name} is not installed or not built yet)",
                "install the cuda extra (`pip install -e '.[cuda]'`)" if name in CUDA_BACKENDS else None,
            ) from None
        entry = getattr(module, cls)
    return entry


def get_backend(name: str, device: str | torch.device | None = None) -> Backend:
    """Instantiate the backend ``name`` (see ``backend_class``) on ``device`` (its default if None)."""
    cls = backend_class(name)
    return cls() if device is None else cls(device=device)
