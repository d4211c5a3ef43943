"""The elementwise pieces of the cpu backend's bf16 prefill as native calls
(``kernels/cpu_prefill_ops.c``): RMSNorm, RoPE and the residual add with stand-ins, each one call
for all the tokens of a step; and the routers of a bf16 or fp32 prefill step (``router``).

PyTorch runs each of them as several full-width bf16 ops with fp32 round trips: on SmolLM2-135M
(1,024-token prefill, 1 thread, a Xeon with AMX) they took about a third of a routed prefill whose
projections ran on AMX tiles. The native versions compute the engine's formulas with the same
bf16 roundings (``runtime/engine.py``); their sums run in another order, so a value on a rounding
boundary can land one bf16 step away. Each function returns None where it does not apply (another
dtype, a layout it does not take, no native library): the engine then runs its PyTorch ops.
"""

from __future__ import annotations

import torch

from wide_cli.runtime import cpu_native

#: Tokens per call from which the engine uses these (decode steps of a few rows stay in PyTorch
#: or the native decode step).
MIN_TOKENS = 17


def _lib():
    return cpu_native.library()


def _rows2d(x: torch.Tensor) -> torch.Tensor | None:
    """``x [..., n]`` as a ``[M, n]`` view with unit inner stride, or None."""
    if x.dtype != torch.bfloat16 or x.stride(-1) != 1:
        return None
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:  # not viewable as rows (non-uniform strides)
        return None


def router(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """The execute decisions ``w x + b >= 0`` of a folded router (``engine._decide``) for bf16 or
    fp32 ``x [B, T, D]``, ``w [G, D]`` and ``b [G]`` fp32, computed in fp32 with the native decode
    step's products (a token gets the same decisions in prefill and decode). Returns ``[B, T, G]``
    bool, or None (no native library, another dtype, rows not viewable)."""
    lib = _lib()
    if lib is None or x.dtype not in (torch.bfloat16, torch.float32) or x.stride(-1) != 1:
        return None
    if w.dtype != torch.float32 or b.dtype != torch.float32 or not w.is_contiguous() or not b.is_contiguous():
        return None
    try:
        x2 = x.view(-1, x.shape[-1])
    except RuntimeError:  # not viewable as rows (non-uniform strides)
        return None
    G = w.shape[0]
    mask = torch.empty(*x.shape[:-1], G, dtype=torch.bool)
    rc = lib.wide_router_rows(cpu_native.context(lib), x2.data_ptr(), x2.stride(0), x2.shape[0], x2.shape[1],
                              int(x.dtype == torch.float32), w.data_ptr(), b.data_ptr(), G, mask.data_ptr(),
                              torch.get_num_threads())  # fmt: skip
    return mask if rc == 0 else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``engine.rms_norm`` of bf16 ``x [..., D]``: Llama's with a bf16 ``weight``, Gemma 3's with
    an fp32 one (``1 + w`` folded). Returns a new bf16 tensor of ``x``'s shape, or None."""
    lib = _lib()
    x2 = _rows2d(x)
    if lib is None or x2 is None or weight.dtype not in (torch.bfloat16, torch.float32):
        return None
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    w = weight.to(torch.float32).contiguous()
    rc = lib.wide_rms_norm_rows(cpu_native.context(lib), x2.data_ptr(), x2.stride(0), x2.shape[0], x2.shape[1],
                                w.data_ptr(), int(weight.dtype == torch.float32), eps, out.data_ptr(), x2.shape[1],
                                torch.get_num_threads())  # fmt: skip
    return out if rc == 0 else None


def rope_(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor | None:
    """``engine.apply_rope`` in place on bf16 ``x [B, T, heads, d]`` (heads contiguous) with bf16
    tables ``[B, T, 1, d]``; returns ``x``, or None (nothing changed)."""
    lib = _lib()
    if lib is None or x.dtype != torch.bfloat16 or cos.dtype != torch.bfloat16 or sin_signed.dtype != torch.bfloat16:
        return None
    B, T, H, d = x.shape
    if x.stride(3) != 1 or x.stride(2) != d or x.stride(0) != T * x.stride(1):
        return None
    c, s = cos.expand(B, T, 1, d).reshape(B * T, d).contiguous(), sin_signed.expand(B, T, 1, d).reshape(B * T, d).contiguous()
    rc = lib.wide_rope_rows(cpu_native.context(lib), x.data_ptr(), x.stride(1), B * T, H, d, c.data_ptr(), s.data_ptr(),
                            torch.get_num_threads())  # fmt: skip
    return x if rc == 0 else None


def residual(x: torch.Tensor, y: torch.Tensor, execute: torch.Tensor | None,
             standin: torch.Tensor | None) -> torch.Tensor | None:
    """``x + y`` plus the constant stand-ins of the skipped groups (``engine._add_standin`` with
    ``execute [B, T, G]`` bool and ``standin [G, D]``, or neither), bf16 ``[B, T, D]``; written
    into ``y``'s storage when it is contiguous. Returns the sum, or None."""
    lib = _lib()
    x2, y2 = _rows2d(x), _rows2d(y)
    if lib is None or x2 is None or y2 is None or not y.is_contiguous() or x2.shape != y2.shape:
        return None
    M, D = y2.shape
    ex = st = None
    if execute is not None and standin is not None:
        ex = execute.reshape(M, -1).to(torch.uint8).contiguous()
        st = standin.to(torch.float32).contiguous()
    rc = lib.wide_residual_rows(cpu_native.context(lib), x2.data_ptr(), x2.stride(0), y2.data_ptr(), y2.data_ptr(), D,
                                M, D, None if ex is None else ex.data_ptr(), 0 if ex is None else ex.shape[1],
                                0 if ex is None else ex.shape[1], None if st is None else st.data_ptr(),
                                torch.get_num_threads())  # fmt: skip
    return y if rc == 0 else None
