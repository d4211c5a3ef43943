"""Weight formats of the runtime: ``fp32``, ``bf16`` and ``int8`` weight-only.

int8 is the scheme of ``wide_cli/quant.py`` (symmetric, per output row and per group of reduction
channels, bf16-representable scales) in the layout of ``torch``'s CPU int8 weight-only GEMM
(``aten._weight_int8pack_mm``: int8 ``[N, K]``, one scale per row, activations in bf16) applied
block by block.
"""

from __future__ import annotations

import torch

from wide_cli.errors import ConfigError
from wide_cli.quant import dequantize_int8, quantize_int8

WEIGHT_FORMATS = ("fp32", "bf16", "int8")
# Compute (activation) dtype of each format: the int8 kernel takes bf16 activations (its fp32
# path is a slow fallback, ~10x slower than bf16 on this CPU).
COMPUTE_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.bfloat16}
# The int8 kernel reads K in blocks of 16 (it crashed on K = 8, 24, 40 in torch 2.13); every
# reduction width it sees must be a multiple of this.
INT8_K_MULTIPLE = 16


def check_format(fmt: str | None) -> str:
    """``fmt`` or ``fp32`` when None.

    Raises:
        ConfigError: an unknown format name.
    """
    if fmt is None:
        return "fp32"
    if fmt not in WEIGHT_FORMATS:
        raise ConfigError(f"unknown weight format {fmt!r}", f"use --weights {' | '.join(WEIGHT_FORMATS)}")
    return fmt


def check_int8_width(k: int, what: str) -> None:
    """Raise ``ConfigError`` unless a reduction width ``k`` fits the int8 kernel."""
    if k % INT8_K_MULTIPLE:
        raise ConfigError(
            f"int8 weights need reduction widths that are multiples of {INT8_K_MULTIPLE}; {what} has {k}",
            "use --weights bf16 or fp32 for this model",
        )


def fake_quantize(weights):
    """A copy of ``weights`` (``backend.ModelWeights``) whose projections and LM head hold the
    values the int8 kernels use (``dequantize(quantize(w))`` with the cpu backend's grouping: per
    row for Q/K/V, gate/up and the LM head, per row and routed group for O and down; the
    embedding is handled by the engine)."""
    import dataclasses

    def fq(w, gk=None):
        return dequantize_int8(*quantize_int8(w, gk))

    layers = []
    for lw in weights.layers:
        cols = lw.attn_group_size * lw.head_dim
        layers.append(dataclasses.replace(
            lw, wq=fq(lw.wq), wk=fq(lw.wk), wv=fq(lw.wv), wo=fq(lw.wo, cols), w_gate=fq(lw.w_gate),
            w_up=fq(lw.w_up), w_down=fq(lw.w_down, lw.ffn_group_size),
        ))  # fmt: skip
    return dataclasses.replace(weights, layers=layers, lm_head=fq(weights.lm_head), tied=False)


def int8_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [M, K] (bf16) @ (q [N, K] int8 * scale [N])^T -> [M, N]`` in x's dtype (torch's
    weight-only int8 CPU GEMM). ``q`` must be contiguous and K a multiple of 16."""
    return torch.ops.aten._weight_int8pack_mm(x, q, scale)
