"""Weight formats of the runtime: ``fp32``, ``bf16``, ``int8`` and ``int4``.

int8 and int4 are the schemes of ``wide_cli/quant.py`` (blocks of 32 reduction channels, one
bf16-representable scale per row and block; int8 symmetric as Q8_0, int4 as Q4_0 with a searched
scale). The native decode step (``kernels/cpu_decode.c``) reads the quantized blocks and their
scales; the PyTorch path (prefill, batches) multiplies a bf16 copy of the same dequantized values
(torch's int8 CPU GEMM takes one scale per row only, and at prefill sizes its bf16 GEMM was 2.6x
faster anyway).
"""

from __future__ import annotations

import torch

from wide_cli.errors import ConfigError
from wide_cli.quant import INT8_BLOCK, values

WEIGHT_FORMATS = ("fp32", "bf16", "int8", "int4")
# Formats whose projections are stored in blocks with scales (``wide_cli/quant.py``).
QUANTIZED_FORMATS = ("int8", "int4")
# Bytes per weight each format's decode step reads (scales included: int8 fp32, int4 bf16 per 32).
BYTES_PER_WEIGHT = {"fp32": 4.0, "bf16": 2.0, "int8": 1 + 4 / 32, "int4": 0.5 + 2 / 32}
# Compute (activation) dtype of each format: int8 / int4 run bf16 activations on the PyTorch path.
COMPUTE_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.bfloat16, "int4": torch.bfloat16}
# Every reduction width (hidden size, attention group channels, FFN group size) must hold whole
# blocks, so that a routed group owns its scales.
QUANT_K_MULTIPLE = INT8_BLOCK


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


def check_quant_width(k: int, what: str, fmt: str = "int8") -> None:
    """Raise ``ConfigError`` unless a reduction width ``k`` fits the ``fmt`` (int8 / int4) kernels."""
    if k % QUANT_K_MULTIPLE:
        raise ConfigError(
            f"{fmt} weights need reduction widths that are multiples of {QUANT_K_MULTIPLE}; {what} has {k}",
            "use --weights bf16 or fp32 for this model",
        )


def fake_quantize(weights, fmt: str = "int8"):
    """A copy of ``weights`` (``backend.ModelWeights``) whose projections and LM head hold the
    values the ``fmt`` (int8 / int4) kernels use (``dequantize(quantize(w))`` in blocks of 32; the
    embedding is handled by the engine)."""
    import dataclasses

    def v(w):
        return values(w, fmt)

    layers = []
    for lw in weights.layers:
        layers.append(dataclasses.replace(
            lw, wq=v(lw.wq), wk=v(lw.wk), wv=v(lw.wv), wo=v(lw.wo), w_gate=v(lw.w_gate), w_up=v(lw.w_up),
            w_down=v(lw.w_down),
        ))  # fmt: skip
    head = weights.embed if weights.tied else weights.lm_head
    return dataclasses.replace(weights, layers=layers, lm_head=v(head), tied=False)
