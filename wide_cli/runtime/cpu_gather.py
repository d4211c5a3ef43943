"""Routed prefill in bf16 as one native call per module, gathering each group's tokens inside the
kernel (``kernels/cpu_prefill_gather.c``): the cpu backend's projections, gated FFN and causal
attention of calls of more than ``cpu_plan.SMALL_M`` tokens, on AMX tiles where the CPU has them
(Sapphire Rapids and later) and with AVX512-BF16 dot products (``vdpbf16ps``) where it has those
only (AMD Zen 4 and later, Cooper Lake).

With bf16 matrix hardware PyTorch's oneDNN runs a dense bf16 GEMM close to its peak, and the
PyTorch routed path (one GEMM per group, with gathers, scatters and SwiGLU ops between them) ran
slower than dense at half the groups skipped (0.61x on AMX; on a Zen 4 EPYC twelve per-group GEMM
pairs of a SmolLM2-135M FFN took 1.22x the dense GEMMs' time for the same multiply-adds). Here per
group the tokens that execute it are multiplied with the group's weights, packed once per
projection on first use (``pack_rows`` / ``pack_groups``: a bf16 copy of the weights in the tile
layout, which is also ``vdpbf16ps``'s operand order). Activations are bf16 (the compute dtype of
the bf16, int8 and int4 formats: int8 / int4 prefill multiplies the dequantized bf16 copy, as the
PyTorch path does), products accumulate in fp32.

Where the bf16 kernels run on AVX512-BF16, the same kernels also run fp32 prefill (fp32 weights
packed in fp32 tiles, AVX-512 FMAs: ``f32_ready``). ``WIDE_CPU_GATHER`` = ``auto`` | ``amx`` |
``avx512`` | ``off`` chooses (``isa``); ``off`` runs the PyTorch path, as on CPUs with neither ISA.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from wide_cli.runtime import cpu_native

TILE_K = 32  # reduction channels of one tile row (bf16)
TILE_N = 16  # output columns of one tile
TILE_K_F32 = 16  # reduction channels of one fp32 tile (16 x 16 values: 1 KiB, as a bf16 tile)


# What runs the kernels' block products: AVX512-BF16 (vdpbf16ps), AMX tiles (both bf16), or
# AVX-512 FMAs (fp32 activations and weights).
ISA_VDP, ISA_AMX, ISA_F32 = 1, 2, 3
ISA_NAMES = {"amx": ISA_AMX, "avx512": ISA_VDP}


@functools.cache
def isa() -> int:
    """What runs the gather kernels in this process: ``ISA_AMX`` where the CPU has AMX-BF16 and
    the OS grants the tile state, else ``ISA_VDP`` where it has AVX512-BF16, else 0 (the PyTorch
    path runs). ``WIDE_CPU_GATHER`` = ``auto`` (default), ``amx``, ``avx512`` or ``off`` forces a
    choice (one the CPU lacks gives 0). Raises ValueError for another value."""
    choice = os.environ.get("WIDE_CPU_GATHER", "auto")
    if choice not in ("auto", "off", *ISA_NAMES):
        raise ValueError(f"WIDE_CPU_GATHER={choice!r}: expected auto, amx, avx512 or off")
    lib = cpu_native.library()
    if lib is None or choice == "off":
        return 0
    if choice in ("auto", "amx") and lib.wide_amx_ready():
        return ISA_AMX
    if choice in ("auto", "avx512") and lib.wide_vdp_ready():
        return ISA_VDP
    return 0


def ready() -> bool:
    """Whether the bf16 gather kernels run in this process (``isa`` is not 0)."""
    return isa() != 0


def f32_ready() -> bool:
    """Whether the fp32 gather kernels (AVX-512 FMA, ``ISA_F32``) run in this process: where the
    bf16 ones run on AVX512-BF16 (``isa() == ISA_VDP``), the CPUs they were measured on (against
    PyTorch's fp32 GEMMs, 1.21x / 1.37x on a dense SmolLM2-135M FFN of 128 / 1,024 tokens, Zen 4,
    1 thread); on AMX CPUs fp32 prefill stays on PyTorch (not measured there)."""
    return isa() == ISA_VDP and bool(cpu_native.library().wide_f32_ready())


def runs(dtype: torch.dtype) -> bool:
    """Whether the gather kernels run activations of ``dtype`` here (bf16: ``ready``; fp32:
    ``f32_ready``)."""
    return ready() if dtype == torch.bfloat16 else f32_ready() if dtype == torch.float32 else False


def _call_isa(dtype: torch.dtype) -> int:
    return ISA_F32 if dtype == torch.float32 else isa()


def _tile_k(packed: torch.Tensor) -> int:
    """Reduction channels of one packed tile: 32 bf16 pairs' worth, or 16 fp32 values."""
    return TILE_K_F32 if packed.dtype == torch.float32 else TILE_K


def pack_rows(w: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``w [N, K]`` (rows layout: ``y = x @ w^T``) in the tile layout of
    ``kernels/cpu_prefill_gather.c``: bf16 ``[N / 16, K / 32, 16, 16, 2]``,
    ``P[nb, kb, kp, c, p] = w[16 nb + c, 32 kb + 2 kp + p]``; fp32 (``dtype``) ``[N / 16, K / 16,
    16, 16]``, ``P[nb, kb, k, c] = w[16 nb + c, 16 kb + k]`` (1 KiB tiles either way). Raises
    ValueError unless N % 16 == 0 and K % 32 == 0."""
    N, K = w.shape
    if N % TILE_N or K % TILE_K:
        raise ValueError(f"tile packing needs N % {TILE_N} == 0 and K % {TILE_K} == 0, got [{N}, {K}]")
    if dtype == torch.float32:
        v = w.to(torch.float32).reshape(N // TILE_N, TILE_N, K // TILE_K_F32, TILE_K_F32)
        return v.permute(0, 2, 3, 1).contiguous()
    v = w.to(torch.bfloat16).reshape(N // TILE_N, TILE_N, K // TILE_K, TILE_K // 2, 2)
    return v.permute(0, 2, 3, 1, 4).contiguous()


def pack_groups(w_t: torch.Tensor, g: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """An axis-k projection ``w_t [K, N]`` (``y = a @ w_t``, ``K = G g`` reduction channels in
    groups of ``g``) -> each group's ``[N, g]`` slice packed as ``pack_rows``: bf16
    ``[G, N / 16, g / 32, 16, 16, 2]``, fp32 ``[G, N / 16, g / 16, 16, 16]``. Raises ValueError
    unless N % 16 == 0 and g % 32 == 0."""
    K, N = w_t.shape
    if N % TILE_N or g % TILE_K or K % g:
        raise ValueError(f"tile packing needs N % {TILE_N} == 0, g % {TILE_K} == 0 and K % g == 0, got [{K}, {N}], g={g}")
    if dtype == torch.float32:
        v = w_t.to(torch.float32).reshape(K // g, g // TILE_K_F32, TILE_K_F32, N // TILE_N, TILE_N)
        return v.permute(0, 3, 1, 2, 4).contiguous()
    v = w_t.to(torch.bfloat16).reshape(K // g, g // TILE_K, TILE_K // 2, 2, N // TILE_N, TILE_N)
    return v.permute(0, 4, 1, 2, 5, 3).contiguous()


def _mask_arg(mask: torch.Tensor | None, M: int, G: int) -> tuple[int | None, int, torch.Tensor | None]:
    """(pointer, row stride in bytes, the tensor kept alive) of a ``[M, G]`` bool mask (None: every
    token executes every group)."""
    if mask is None:
        return None, 0, None
    if mask.shape != (M, G) or mask.dtype != torch.bool:
        raise ValueError(f"mask {tuple(mask.shape)} {mask.dtype}, expected [{M}, {G}] bool")
    m = mask.contiguous()
    return m.data_ptr(), G, m


def _check_x(x: torch.Tensor, K: int, packed: torch.Tensor) -> None:
    dt = packed.dtype
    if x.dtype != dt or x.dim() != 2 or x.shape[1] < K or x.stride(1) != 1:
        raise ValueError(f"activations {tuple(x.shape)} {x.dtype}, expected [M, >= {K}] {dt} with unit stride")


def rows(packed: torch.Tensor, x: torch.Tensor, out: torch.Tensor, mask: torch.Tensor | None, group_rows: int,
         bias: torch.Tensor | None = None) -> bool:
    """``out[t, j r : (j + 1) r] = x[t] @ W_j^T (+ bias)`` for the groups ``j`` token ``t``
    executes (``r = group_rows``, ``W`` the rows ``packed`` holds, ``pack_rows``); other entries
    of ``out`` are left as they are.

    Args:
        packed: ``pack_rows``'s bf16 or fp32 tiles (a row range of a packed projection is a
            slice of its first dimension).
        x: ``[M, K]`` in ``packed``'s dtype. out: ``[M, N]`` fp32 or bf16, unit inner stride.
        mask: ``[M, N / r]`` bool, or None (every token, every group).
        bias: fp32 ``[N]`` or None.
    Returns:
        False when the kernel cannot take the operands (nothing written): the caller runs PyTorch.
    """
    N, K = packed.shape[0] * TILE_N, packed.shape[1] * _tile_k(packed)
    M = x.shape[0]
    _check_x(x, K, packed)
    if N % group_rows or out.shape != (M, N) or out.stride(1) != 1 or out.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"out {tuple(out.shape)} for {M} tokens x {N} rows in groups of {group_rows}")
    G = N // group_rows
    if not runs(x.dtype):  # the tile state is the OS's to grant (ready asks for it once)
        return False
    mp, ms, _keep = _mask_arg(mask, M, G)
    b = None if bias is None else bias.to(torch.float32).contiguous()
    lib = cpu_native.library()
    rc = lib.wide_gather_proj(cpu_native.context(lib), 0, packed.data_ptr(), N, K, G, group_rows, x.data_ptr(), x.stride(0),
                           M, mp, ms, out.data_ptr(), out.stride(0), 0 if out.dtype == torch.float32 else 1,
                           None if b is None else b.data_ptr(), _call_isa(x.dtype), torch.get_num_threads())  # fmt: skip
    return rc == 0


def acc(packed: torch.Tensor, a: torch.Tensor, out: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """``out[t] += a[t, j g : (j + 1) g] @ W_j`` for the groups ``j`` token ``t`` executes
    (``packed`` from ``pack_groups``, bf16 or fp32).

    Args:
        a: ``[M, G g]`` in ``packed``'s dtype. out: ``[M, N]`` fp32, unit inner stride. mask: ``[M, G]`` bool or None.
    Returns:
        False when the kernel cannot take the operands (nothing written).
    """
    G, N, g = packed.shape[0], packed.shape[1] * TILE_N, packed.shape[2] * _tile_k(packed)
    M = a.shape[0]
    _check_x(a, G * g, packed)
    if out.shape != (M, N) or out.dtype != torch.float32 or out.stride(1) != 1:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype}, expected [{M}, {N}] fp32")
    if not runs(a.dtype):
        return False
    mp, ms, _keep = _mask_arg(mask, M, G)
    lib = cpu_native.library()
    rc = lib.wide_gather_proj(cpu_native.context(lib), 1, packed.data_ptr(), N, G * g, G, g, a.data_ptr(), a.stride(0), M,
                           mp, ms, out.data_ptr(), out.stride(0), 0, None, _call_isa(a.dtype), torch.get_num_threads())  # fmt: skip
    return rc == 0


def ffn(packed_gu: torch.Tensor, packed_down: torch.Tensor, x: torch.Tensor, out: torch.Tensor,
        mask: torch.Tensor | None, act: str = "silu") -> int | None:
    """The routed gated FFN: ``out[t] = sum_j act(x[t] @ gate_j^T) * (x[t] @ up_j^T) @ down_j``
    over the groups ``j`` token ``t`` executes, the gated activations rounded to bf16 between the
    products (kept in fp32 for fp32 operands).

    Args:
        packed_gu: ``pack_rows`` of the grouped gate/up rows ``[G 2 g, D]``
            (``cpu_proj.grouped_gate_up``). packed_down: ``pack_groups(down_t, g)``.
        x: ``[M, D]`` in the packed weights' dtype (bf16 or fp32). out: ``[M, D]`` fp32, every row written. mask: ``[M, G]`` bool or
            None. act: ``silu`` (SwiGLU) or ``gelu_tanh``.
    Returns:
        The multiply-adds executed (the gate/up products of the executed pairs; the down product
        runs, per block of tokens -- 32 on AMX tiles, 8 on vdpbf16ps and fp32 FMAs, each window of
        256 tokens sorted by the groups its tokens skip -- every group some token of the block
        executes, with zeros for the block's skipped pairs: ``kernels/cpu_prefill_gather.c`` says
        why), or None when the kernel cannot take the operands (nothing written).
    """
    tk = _tile_k(packed_down)
    G, D, g = packed_down.shape[0], packed_down.shape[1] * TILE_N, packed_down.shape[2] * tk
    M = x.shape[0]
    _check_x(x, D, packed_down)
    if packed_gu.dtype != packed_down.dtype or packed_gu.shape[0] * TILE_N != 2 * G * g or packed_gu.shape[1] * tk != D:
        raise ValueError(f"gate/up {tuple(packed_gu.shape)} does not match down {tuple(packed_down.shape)}")
    if out.shape != (M, D) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out {tuple(out.shape)} {out.dtype}, expected contiguous [{M}, {D}] fp32")
    if act not in ("silu", "gelu_tanh") or not runs(x.dtype):
        return None
    mp, ms, _keep = _mask_arg(mask, M, G)
    lib = cpu_native.library()
    macs = ctypes.c_int64(0)
    rc = lib.wide_gather_ffn(cpu_native.context(lib), packed_gu.data_ptr(), packed_down.data_ptr(), D, G, g, x.data_ptr(),
                          x.stride(0), M, mp, ms, int(act == "gelu_tanh"), out.data_ptr(), ctypes.byref(macs),
                          _call_isa(x.dtype), torch.get_num_threads())  # fmt: skip
    return macs.value if rc == 0 else None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_mask: torch.Tensor | None, *,
              key_valid: torch.Tensor | None, q_offset: int, scale: float, window: int | None) -> tuple | None:
    """``ops.attention_prefill`` in the gather kernels (tiles or vdpbf16ps): causal attention of the (token, head) pairs
    ``head_mask`` marks, flash-style (online softmax over blocks of 32 keys, the probabilities
    rounded to bf16 for the P V product, as they are for the sum they are divided by).

    Args:
        q: ``[B, T, H, d]`` bf16, heads contiguous. k, v: ``[B, S, H_kv, d]`` bf16 (views of the
            cache) with unit inner stride. head_mask: ``[B, T, H]`` bool or None (every pair).
        key_valid: ``[B, S]`` bool or None; q_offset: the slot of query 0; window: or None.
    Returns:
        ``(out [B, T, H, d] bf16, pairs)``: zeros for skipped pairs and for queries that see no
        key; ``pairs`` the (query, key) pairs computed. None when the kernel does not take the
        operands (d not a multiple of 32 or above 256, strides).
    """
    B, T, H, d = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    if not ready() or q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16:
        return None
    if d % TILE_K or d > 256 or q.stride(3) != 1 or q.stride(2) != d or q.stride(0) != T * q.stride(1):
        return None
    if k.stride() != v.stride() or k.stride(3) != 1:
        return None
    kv = None if key_valid is None else key_valid[:, :S].to(torch.uint8).contiguous()
    hm = None if head_mask is None else head_mask.to(torch.uint8).contiguous()
    out = torch.empty(B, T, H, d, dtype=torch.bfloat16)
    pairs = ctypes.c_int64(0)
    lib = cpu_native.library()
    rc = lib.wide_gather_attention(cpu_native.context(lib), q.data_ptr(), q.stride(1), B, T, H, Hkv, d, k.data_ptr(),
                                v.data_ptr(), k.stride(0), k.stride(1), k.stride(2), S, q_offset, window or 0,
                                None if kv is None else kv.data_ptr(), scale, None if hm is None else hm.data_ptr(),
                                out.data_ptr(), ctypes.byref(pairs), isa(), torch.get_num_threads())  # fmt: skip
    return (out, pairs.value) if rc == 0 else None
