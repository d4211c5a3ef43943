"""Weight formats of the runtime: ``fp32``, ``bf16`` and ``int8`` weight-only.

int8 is symmetric, per output row and per group of ``group_k`` reduction channels (one scale per
``(row, group)``; ``group_k = K`` gives one scale per row), the layout of ``torch``'s CPU int8
weight-only GEMM (``aten._weight_int8pack_mm``: int8 ``[N, K]``, one scale per row, activations in
bf16) applied block by block. A projection routed along its reduction axis (O, down) is quantized
per routed group, so each group is a self-contained block ``[N, g]`` with its own scales: a
skipped group reads neither its weights nor its scales.

Scales are rounded up to bf16-representable values before quantizing (the kernel multiplies in
bf16): the kernel's weight is then exactly ``q * scale``, and the quantization error of every
element is at most ``scale / 2`` (round to nearest, no clipping).
"""

from __future__ import annotations

import torch

from wide_cli.errors import ConfigError

WEIGHT_FORMATS = ("fp32", "bf16", "int8")
# Compute (activation) dtype of each format: the int8 kernel takes bf16 activations (its fp32
# path is a slow fallback, ~10x slower than bf16 on this CPU).
COMPUTE_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.bfloat16}
# The int8 kernel reads K in blocks of 16 (it crashed on K = 8, 24, 40 in torch 2.13); every
# reduction width it sees must be a multiple of this.
INT8_K_MULTIPLE = 16
SCALE_SUFFIX = "_scale"


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


def quantize_int8(w: torch.Tensor, group_k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row and per group of ``group_k`` reduction channels.

    Args:
        w: ``[N, K]`` float weight (HF ``Linear.weight`` layout).
        group_k: reduction channels per scale (None = K: one scale per row); must divide K.
    Returns:
        ``q [N, K]`` int8 in ``[-127, 127]`` and ``scale [N, K // group_k]`` fp32, every value
        bf16-representable, with ``|w - q * scale| <= scale / 2`` elementwise (per its group).
        All-zero groups get scale 1 (and q = 0).
    """
    N, K = w.shape
    gk = K if group_k is None else group_k
    if gk <= 0 or K % gk:
        raise ValueError(f"group_k {gk} does not divide K={K}")
    wg = w.detach().float().reshape(N, K // gk, gk)
    amax = wg.abs().amax(-1)  # [N, G]
    s = (amax / 127).to(torch.bfloat16)
    low = s.float() * 127 < amax  # rounded down: step to the next bf16 up so no element clips
    if bool(low.any()):
        s = torch.where(low, torch.nextafter(s, torch.full_like(s, float("inf"))), s)
    scale = torch.where(amax > 0, s.float(), torch.ones_like(amax))
    q = torch.round(wg / scale[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(N, K), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of ``quantize_int8``: ``q [N, K]`` int8, ``scale [N, G]`` -> fp32 ``[N, K]``."""
    N, K = q.shape
    G = scale.shape[1]
    return (q.float().reshape(N, G, K // G) * scale.float()[..., None]).reshape(N, K)


def int8_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [M, K] (bf16) @ (q [N, K] int8 * scale [N])^T -> [M, N]`` in x's dtype (torch's
    weight-only int8 CPU GEMM). ``q`` must be contiguous and K a multiple of 16."""
    return torch.ops.aten._weight_int8pack_mm(x, q, scale)
