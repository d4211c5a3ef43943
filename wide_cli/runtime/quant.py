"""Weight formats of the runtime: ``fp32``, ``bf16`` and ``int8``.

int8 is the scheme of ``wide_cli/quant.py`` (symmetric, blocks of 32 reduction channels, one
bf16-representable scale per row and block). The native decode step (``kernels/cpu_decode.c``)
reads the int8 blocks and their scales; the PyTorch path (prefill, batches) multiplies a bf16 copy
of the same dequantized values (torch's int8 CPU GEMM takes one scale per row only, and at
prefill sizes its bf16 GEMM was 2.6x faster anyway).
"""

from __future__ import annotations

import torch

from wide_cli.errors import ConfigError
from wide_cli.quant import INT8_BLOCK, dequantize_int8, quantize_int8

WEIGHT_FORMATS = ("fp32", "bf16", "int8")
# Compute (activation) dtype of each format: int8 runs bf16 activations on the PyTorch path.
COMPUTE_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.bfloat16}
# Every reduction width (hidden size, attention group channels, FFN group size) must hold whole
# int8 blocks, so that a routed group owns its scales.
INT8_K_MULTIPLE = INT8_BLOCK


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
    values the int8 kernels use (``dequantize(quantize(w))`` in blocks of ``INT8_BLOCK``; the
    embedding is handled by the engine)."""
    import dataclasses

    layers = []
    for lw in weights.layers:
        layers.append(dataclasses.replace(
            lw, wq=int8_values(lw.wq), wk=int8_values(lw.wk), wv=int8_values(lw.wv), wo=int8_values(lw.wo),
            w_gate=int8_values(lw.w_gate), w_up=int8_values(lw.w_up), w_down=int8_values(lw.w_down),
        ))  # fmt: skip
    head = weights.embed if weights.tied else weights.lm_head
    return dataclasses.replace(weights, layers=layers, lm_head=int8_values(head), tied=False)


def int8_values(w: torch.Tensor) -> torch.Tensor:
    """``w [N, K]`` as the int8 scheme represents it: ``dequantize(quantize(w, INT8_BLOCK))``, fp32."""
    return dequantize_int8(*quantize_int8(w, INT8_BLOCK))
