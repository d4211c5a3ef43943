"""The routed operators on NVIDIA GPUs: CuPy-launched CUDA kernels (DESIGN.md §3), and the
dispatch that picks, per call, a kernel build, cuBLAS or the reference.

Every public operator has the exact signature and semantics of its reference in
``runtime/ops.py``; the kernels' sources live in the top-level ``kernels/``. Below this module,
``runtime/cuda/`` holds one concern per file: ``builds`` (tile tables, shape arithmetic),
``launch`` (availability, build cache, launches), ``verify`` (fallbacks, first-use checks),
``autotune``, and ``registry`` (``REGISTRY``: the process-wide state and settings, with
``fallback_counts()``, ``dispatch_counts()`` and ``broken_builds()``).

- **Dispatch** (``dispatch_path``; measured by ``make gpu-check`` on an H200, where the
  ``mma.sync`` kernels are slower per FLOP than cuBLAS): a call of at most
  ``WIDE_CUPY_GEMV_MAX_M`` tokens (default 2: decode) takes the GEMV kernels, whose skipped groups
  skip their weight reads; a call of up to ``AUTO_MIN_M`` tokens runs cuBLAS on the masked input,
  which is exactly the same function and needs no host sync; from ``AUTO_MIN_M`` tokens one host
  sync reads the live fraction of the mask (executing pairs for ``gemm_mn``, live 16-row
  fragments for ``gemm_k``) and the mask-reordered tensor-core GEMMs run only at or below
  ``WIDE_CUPY_DENSE_ABOVE`` (default 0.1), with a tile picked per shape by a small heuristic or
  by measurement (``WIDE_CUPY_AUTOTUNE=1``). During CUDA-graph capture the sync is skipped and
  cuBLAS runs. ``WIDE_CUPY_DENSE_ABOVE=1`` runs the kernels for every masked call (GEMV up to
  ``GEMV_MAX_M`` tokens). ``mask=None`` goes to cuBLAS. ``REGISTRY.dispatch_counts()`` says which
  ran.
- **Attention**: decode and prefills under ``AUTO_MIN_M`` tokens run the routed kernels; longer
  prefills run PyTorch's fused ``scaled_dot_product_attention`` over every head with the skipped
  heads zeroed (the same function), which was faster on an H200 there (``_attention_path``).
- **Never a wrong answer**: unsupported shapes, dtypes or layouts go to the PyTorch reference, and
  the first call of every build is checked against it (``runtime/cuda/verify.py``).

Dtypes: bf16 and fp16 run on the kernels (fp32 accumulate); fp32 uses the reference.
Importing this module needs neither CuPy nor a GPU; calling an operator needs both.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from wide_cli.runtime import ops
from wide_cli.runtime.cuda.autotune import pick_tile
from wide_cli.runtime.cuda.builds import (
    DECODE_HEAD_DIMS,
    GEMM_K_TILES,
    GEMM_MN_TILES,
    GEMV_MAX_M,
    PREFILL_BM,
    GemmTile,
    decode_split,
    heuristic_tile,
    next_pow2,
)
from wide_cli.runtime.cuda.launch import arg, get_kernel, i32, i64, launch
from wide_cli.runtime.cuda.registry import REGISTRY
from wide_cli.runtime.cuda.verify import checked, fallback

DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
AUTO_MIN_M = 512  # from this many tokens a host sync to pick kernel vs cuBLAS is cheap enough


CUBLAS_MASKED = "cuBLAS on the masked input"


def dispatch_path(M: int, live: Callable[[], float | torch.Tensor] | None, *, dense_above: float, gemv_max_m: int,
                  capturing: bool = False) -> str:  # fmt: skip
    """Which implementation a masked GEMM of ``M`` tokens runs: ``"GEMV"``, ``"kernel"`` (the
    tensor-core GEMMs) or ``CUBLAS_MASKED`` (pure Python; see the module docstring).

    ``live()`` returns the mask's live fraction in [0, 1]; it is called (one host sync) only for
    ``M >= AUTO_MIN_M`` outside CUDA-graph capture.
    """
    if dense_above >= 1.0:  # every masked call on the kernels (gpu-check times them so)
        return "GEMV" if M <= GEMV_MAX_M else "kernel"
    if M <= gemv_max_m:
        return "GEMV" if M <= GEMV_MAX_M else "kernel"
    if M < AUTO_MIN_M or capturing or live is None:
        return CUBLAS_MASKED
    return "kernel" if float(live()) <= dense_above else CUBLAS_MASKED


def _path(op: str, M: int, live: Callable[[], torch.Tensor]) -> str:
    """``dispatch_path`` with this process's settings, counted in ``REGISTRY.dispatch``."""
    path = dispatch_path(
        M, live, dense_above=REGISTRY.dense_above(), gemv_max_m=REGISTRY.gemv_max_m(),
        capturing=torch.cuda.is_current_stream_capturing(),
    )  # fmt: skip
    REGISTRY.dispatch[(op, path)] += 1
    return path


def masked_dense_mn(a, w, w2, mask, group_size, bias=None) -> torch.Tensor:
    """``ops.gemm_mn`` (``w2`` None) or ``ops.gemm_mn_swiglu`` as cuBLAS plus one in-place
    multiply by the mask: the same function with the fewest launches (each small elementwise
    launch costs about as much as a decode-sized GEMM on a GPU)."""
    M, N = a.shape[0], w.shape[0]
    out = torch.nn.functional.linear(a, w, bias)
    if w2 is not None:
        out = torch.nn.functional.silu(out).mul_(torch.nn.functional.linear(a, w2))
    out.view(M, N // group_size, group_size).mul_(mask.view(M, -1, 1))
    return out


def masked_dense_k(a, w, mask, group_size, bias=None) -> torch.Tensor:
    """``ops.gemm_k`` as one ``where`` on the activations (skipped channels may hold NaN) plus
    cuBLAS."""
    M, K = a.shape
    a0 = torch.where(mask.view(M, -1, 1), a.view(M, K // group_size, group_size), a.new_zeros(()))
    return torch.nn.functional.linear(a0.view(M, K), w, bias)


# ----------------------------------------------------------------------------------------------
# shape checks and helpers


def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _aligned_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (2-D) with unit column stride, row stride % 8 and a 16-byte aligned base (else a copy)."""
    if t.stride(-1) == 1 and t.stride(0) % 8 == 0 and t.data_ptr() % 16 == 0:
        return t
    return t.contiguous()


def _why_not(dtype_src: torch.Tensor, *tensors: torch.Tensor | None) -> str | None:
    if not dtype_src.is_cuda:
        return f"tensors are on {dtype_src.device}, not a CUDA device"
    if dtype_src.dtype not in DTYPES:
        return f"dtype {dtype_src.dtype} has no kernel (bf16/fp16 only)"
    for t in tensors:
        if t is not None and (t.dtype != dtype_src.dtype or t.device != dtype_src.device):
            return (
                f"mixed dtypes/devices ({t.dtype} on {t.device} vs {dtype_src.dtype} on {dtype_src.device})"
            )
    return None


# ----------------------------------------------------------------------------------------------
# mask reordering on the GPU


def reorder(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GPU ``schedule.reorder_mask``: ``[M, G]`` -> order ``[G, M]``, counts ``[G]``;
    ``[B, M, G]`` -> ``[B, G, M]``, ``[B, G]`` (int32, one launch)."""
    batched = mask.dim() == 3
    m3 = mask if batched else mask.unsqueeze(0)
    B, M, G = m3.shape
    order = torch.empty(B, G, M, dtype=torch.int32, device=mask.device)
    counts = torch.empty(B, G, dtype=torch.int32, device=mask.device)
    if M > 0 and G > 0 and B > 0:
        kern = get_kernel("reorder.cu", "wide_reorder", "bf16", {}, mask.device)
        s_b, s_m, s_g = m3.stride()
        args = (arg(m3), i64(s_b), i64(s_m), i64(s_g), i32(M), i32(G), arg(order), arg(counts))
        launch(kern, (G, B, 1), (256, 1, 1), args, 0, mask.device)
    return (order, counts) if batched else (order[0], counts[0])


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """GPU ``schedule.pack_mask`` (int32 words; read as unsigned by the kernels)."""
    M, G = mask.shape
    words = -(-M // 32)
    packed = torch.empty(words, G, dtype=torch.int32, device=mask.device)
    kern = get_kernel("reorder.cu", "wide_pack_mask", "bf16", {}, mask.device)
    args = (arg(mask), i64(mask.stride(0)), i64(mask.stride(1)), i32(M), i32(G), arg(packed))
    launch(kern, (-(-G // 128), words, 1), (128, 1, 1), args, 0, mask.device)
    return packed


def _bool_on(mask: torch.Tensor, device: torch.device) -> torch.Tensor:
    return mask.to(device=device, dtype=torch.bool)


# ----------------------------------------------------------------------------------------------
# GEMMs


def gemm_mn(a, w, mask, group_size, bias=None):
    """``ops.gemm_mn`` on the GPU kernels (same arguments, result and errors)."""
    return _gemm_mn(a, w, None, mask, group_size, bias, swiglu=False, zero_skipped=True)


def gemm_mn_swiglu(a, w_gate, w_up, mask, group_size):
    """``ops.gemm_mn_swiglu`` on the GPU kernels (same arguments, result and errors)."""
    return _gemm_mn(a, w_gate, w_up, mask, group_size, None, swiglu=True, zero_skipped=True)


def _gemm_mn(a, w, w2, mask, group_size, bias, *, swiglu: bool, zero_skipped: bool) -> torch.Tensor:
    """Shared body; ``zero_skipped=False`` leaves skipped outputs unwritten (only for consumers
    that never read them, e.g. the FFN's ``gemm_k``)."""
    op = "gemm_mn_swiglu" if swiglu else "gemm_mn"
    if swiglu:

        def ref():
            return ops.gemm_mn_swiglu(a, w, w2, mask, group_size)
    else:

        def ref():
            return ops.gemm_mn(a, w, mask, group_size, bias)

    M, Kd = a.shape
    N = w.shape[0]
    if w.shape[1] != Kd or (w2 is not None and w2.shape != w.shape):
        raise ValueError(f"{op}: weight {tuple(w.shape)} does not fit activations {tuple(a.shape)}")
    ops._check_groups(N, mask, group_size, f"{op} output", M)
    if mask is None:
        return ref()  # dense: cuBLAS
    why = _why_not(a, w, w2, bias)
    if why is None and (Kd % 8 or N % 8):
        why = f"K={Kd} and N={N} must be multiples of 8"
    if why:
        return fallback(op, why, ref)
    dev, dt = a.device, DTYPES[a.dtype]
    mask_ = _bool_on(mask, dev)
    path = _path(op, M, lambda: mask_.float().mean())
    if path == CUBLAS_MASKED:  # before any copy or allocation the kernels need
        return masked_dense_mn(a, w, w2, mask_, group_size, bias)
    a_, w_ = _aligned_rows(a), _aligned_rows(w)
    w2_ = w_ if w2 is None else _aligned_rows(w2)
    if w2 is not None and w2_.stride(0) != w_.stride(0):
        w2_, w_ = w2_.contiguous(), w_.contiguous()
    out = torch.empty(M, N, dtype=a.dtype, device=dev)
    bias_ = bias.contiguous() if bias is not None else None
    bias_arg, has_bias = (arg(bias_), 1) if bias_ is not None else (arg(out), 0)
    written = None
    if not zero_skipped:

        def written(o):
            return torch.where(
                ops.expand_mask(mask_, group_size), o, torch.zeros((), dtype=o.dtype, device=dev)
            )

    if path == "GEMV" and group_size % 2 == 0:
        mmax = next_pow2(M)
        defines = {"MMAX": mmax, "SWIGLU": int(swiglu)}
        kern = get_kernel("gemv.cu", "wide_gemv_mn", dt, defines, dev)
        rows = 8 * (1 if swiglu else 2)  # WARPS * output rows per warp

        def run():
            args = (arg(a_), i64(a_.stride(0)), arg(w_), arg(w2_), i64(w_.stride(0)), bias_arg, i32(has_bias),
                    arg(mask_), i64(mask_.stride(0)), i64(mask_.stride(1)), arg(out), i64(N),
                    i32(M), i32(N), i32(Kd), i32(group_size), i32(int(zero_skipped)))  # fmt: skip
            launch(kern, (-(-N // rows), 1, 1), (256, 1, 1), args, 0, dev)
            return out

        return checked(("gemv.cu", op, dt, tuple(defines.items())), dt, run, ref, written)

    cands = [t for t in GEMM_MN_TILES if t.valid(swiglu) and group_size % t.bn_out(swiglu) == 0]
    if not cands:
        return fallback(op, f"group_size {group_size} is not a multiple of 16 (32 for SwiGLU)", ref)
    widest = max(t.bn_out(swiglu) for t in cands)
    cands = [t for t in cands if t.bn_out(swiglu) == widest]
    order, counts = reorder(mask_)  # counted in the op's time (one launch)

    def run_tile(t: GemmTile):
        kern = get_kernel("gemm_mn.cu", "wide_gemm_mn", dt, t.defines(swiglu), dev)
        args = (arg(a_), i64(a_.stride(0)), arg(w_), arg(w2_), i64(w_.stride(0)), bias_arg, i32(has_bias),
                arg(order), arg(counts), arg(out), i64(N), i32(M), i32(N), i32(Kd), i32(group_size),
                i32(int(zero_skipped)))  # fmt: skip
        launch(kern, (-(-M // t.bm), N // t.bn_out(swiglu), 1), (t.threads, 1, 1), args, t.smem(), dev)
        return out

    default = heuristic_tile(cands, M, N // widest, _sms(dev), 0.5)
    key = f"{torch.cuda.get_device_name(dev)}|{op}|{dt}|N{N}|K{Kd}|g{group_size}|M{next_pow2(M)}"
    tile = pick_tile(key, cands, default, run_tile)
    return checked(("gemm_mn.cu", op, dt, tile.name), dt, lambda: run_tile(tile), ref, written)


def gemm_k(a, w, mask, group_size, bias=None):
    """``ops.gemm_k`` on the GPU kernels (same arguments, result and errors)."""

    def ref():
        # the contract ignores a's values on skipped channels, even NaN (ops.gemm_k multiplies)
        a0 = (
            a
            if mask is None
            else torch.where(ops.expand_mask(mask.to(a.device), group_size), a, a.new_zeros(()))
        )
        return ops.gemm_k(a0, w, mask, group_size, bias)

    M, Kd = a.shape
    N = w.shape[0]
    if w.shape[1] != Kd:
        raise ValueError(f"gemm_k: weight {tuple(w.shape)} does not fit activations {tuple(a.shape)}")
    ops._check_groups(Kd, mask, group_size, "gemm_k reduction", M)
    if mask is None:
        return ref()
    why = _why_not(a, w, bias)
    if why is None and (Kd % 8 or N % 8 or group_size % 8):
        why = f"K={Kd}, N={N} and group_size={group_size} must be multiples of 8"
    if why:
        return fallback("gemm_k", why, ref)
    dev, dt = a.device, DTYPES[a.dtype]
    mask_ = _bool_on(mask, dev)
    packed_box: list[torch.Tensor] = []

    def live_fragments() -> torch.Tensor:  # live 16-row fragments x groups (what the GEMM reads)
        packed_box.append(pack_mask(mask_))
        halves = torch.stack([packed_box[0] & 0xFFFF, (packed_box[0] >> 16) & 0xFFFF])
        return (halves != 0).float().mean()

    path = _path("gemm_k", M, live_fragments)
    if path == CUBLAS_MASKED:  # before any copy or allocation the kernels need
        return masked_dense_k(a, w, mask_, group_size, bias)
    a_, w_ = _aligned_rows(a), _aligned_rows(w)
    G = Kd // group_size
    out = torch.empty(M, N, dtype=a.dtype, device=dev)
    bias_ = bias.contiguous() if bias is not None else None
    bias_arg, has_bias = (arg(bias_), 1) if bias_ is not None else (arg(out), 0)
    if path == "GEMV":
        defines = {"MMAX": next_pow2(M), "SWIGLU": 0}
        kern = get_kernel("gemv.cu", "wide_gemv_k", dt, defines, dev)

        def run():
            args = (arg(a_), i64(a_.stride(0)), arg(w_), i64(w_.stride(0)), bias_arg, i32(has_bias),
                    arg(mask_), i64(mask_.stride(0)), i64(mask_.stride(1)), arg(out), i64(N),
                    i32(M), i32(N), i32(Kd), i32(group_size))  # fmt: skip
            launch(kern, (-(-N // 16), 1, 1), (256, 1, 1), args, G * 5, dev)
            return out

        return checked(("gemv.cu", "gemm_k", dt, tuple(defines.items())), dt, run, ref)

    if group_size % 32:
        return fallback("gemm_k", f"group_size {group_size} is not a multiple of 32", ref)
    packed = packed_box[0] if packed_box else pack_mask(mask_)
    words = packed.shape[0]

    def run_tile(t: GemmTile):
        kern = get_kernel("gemm_k.cu", "wide_gemm_k", dt, t.defines(), dev)
        smem = t.smem() + G * max(1, t.bm // 32) * 4 + G * 4
        args = (arg(a_), i64(a_.stride(0)), arg(w_), i64(w_.stride(0)), bias_arg, i32(has_bias),
                arg(packed), i32(words), arg(out), i64(N), i32(M), i32(N), i32(Kd), i32(group_size))  # fmt: skip
        launch(kern, (-(-N // t.bn) * -(-M // t.bm), 1, 1), (t.threads, 1, 1), args, smem, dev)
        return out

    cands = list(GEMM_K_TILES)
    default = heuristic_tile([t for t in cands if t.bn == 128], M, -(-N // 128), _sms(dev), 1.0)
    key = f"{torch.cuda.get_device_name(dev)}|gemm_k|{dt}|N{N}|K{Kd}|g{group_size}|M{next_pow2(M)}"
    tile = pick_tile(key, cands, default, run_tile)
    return checked(("gemm_k.cu", dt, tile.name), dt, lambda: run_tile(tile), ref)


# ----------------------------------------------------------------------------------------------
# attention


SDPA = "scaled_dot_product_attention, skipped heads zeroed"


def _attention_path(op: str, tokens: int) -> str:
    """The routed kernel, or ``SDPA`` for prefills of at least ``AUTO_MIN_M`` tokens.

    Measured by ``make gpu-check`` on an H200: from 1,024 prompt tokens the prefill kernel took
    1.3-2.5x the time of PyTorch's fused attention (which computes every head) at any share of
    heads skipped short of all; up to 128 tokens and in decode the kernel was faster than the
    fused attention plus its mask and zeroing. ``WIDE_CUPY_DENSE_ABOVE=1`` always runs the kernels.
    """
    use_sdpa = op == "attention_prefill" and tokens >= AUTO_MIN_M and REGISTRY.dense_above() < 1.0
    path = SDPA if use_sdpa else "kernel"
    REGISTRY.dispatch[(op, path)] += 1
    return path


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, vis: torch.Tensor | None, scale: float):
    """PyTorch's fused attention: q ``[B, H, T, d]``, k/v ``[B, H_kv, S, d]``, vis ``[B, T, S]``
    bool or None (causal, ``T == S``) -> ``[B, H, T, d]`` in q's dtype (NaN rows where nothing
    is visible)."""
    Fn = torch.nn.functional
    mask = None if vis is None else vis[:, None]
    if q.shape[1] != k.shape[1]:
        try:  # grouped-query attention without copying the cache (torch >= 2.5)
            return Fn.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=vis is None, scale=scale, enable_gqa=True
            )
        except TypeError:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return Fn.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=vis is None, scale=scale)


def sdpa_attention_prefill(q, k, v, head_mask, *, key_valid=None, q_offset=0, scale, window=None):
    """``ops.attention_prefill`` (same arguments and result) on PyTorch's fused attention: every
    head is computed, then skipped (token, head) pairs and queries that see no key are zeroed.
    Without padding, window or offset it runs causal (flash) attention with no mask tensor."""
    ops.check_prefill_shapes(q, k, v, head_mask, q_offset)
    B, T, S = q.shape[0], q.shape[1], k.shape[1]
    plain = key_valid is None and window is None and q_offset == 0 and S == T
    vis = None if plain else ops.key_visibility(B, T, S, q_offset, key_valid, window, q.device)
    out = _sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), vis, scale).transpose(1, 2)
    keep = torch.ones(B, T, 1, dtype=torch.bool, device=q.device) if vis is None else vis.any(-1, keepdim=True)
    if head_mask is not None:
        keep = keep & head_mask.to(device=q.device, dtype=torch.bool)
    return torch.where(keep[..., None], out, out.new_zeros(()))


def _attn_strides_ok(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1 and all(s % 8 == 0 for s in t.stride()[:-1]) and t.data_ptr() % 16 == 0


def attention_prefill(q, k, v, head_mask, *, key_valid=None, q_offset=0, scale, window=None):
    """``ops.attention_prefill`` on the GPU kernel (same arguments, result and errors)."""

    def ref():
        return ops.attention_prefill(
            q, k, v, head_mask, key_valid=key_valid, q_offset=q_offset, scale=scale, window=window
        )

    ops.check_prefill_shapes(q, k, v, head_mask, q_offset)
    B, T, H, d = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    why = _why_not(q, k, v)
    if why is None and (d % 16 or d > 256):
        why = f"head dim {d} is not a multiple of 16 up to 256"
    if why:
        return fallback("attention_prefill", why, ref)
    if T == 0 or B == 0:
        return ref()
    if _attention_path("attention_prefill", T) == SDPA:
        return sdpa_attention_prefill(
            q, k, v, head_mask, key_valid=key_valid, q_offset=q_offset, scale=scale, window=window
        )
    dev, dt = q.device, DTYPES[q.dtype]
    q_, k_, v_ = (t if _attn_strides_ok(t) else t.contiguous() for t in (q, k, v))
    hm = torch.ones(B, T, H, dtype=torch.bool, device=dev) if head_mask is None else _bool_on(head_mask, dev)
    order, counts = reorder(hm)  # [B, H, T], [B, H]
    out = torch.empty(B, T, H, d, dtype=q.dtype, device=dev)
    if key_valid is None:
        kv_arg, kv_sb, has_kv = arg(counts), 0, 0
    else:
        kvv = _bool_on(key_valid, dev)
        kvv = kvv if kvv.stride(-1) == 1 else kvv.contiguous()
        kv_arg, kv_sb, has_kv = arg(kvv), kvv.stride(0), 1
    bn = 32 if d > 128 else 64
    smem = (PREFILL_BM + 4 * bn) * (d + 8) * 2 + 2 * bn
    kern = get_kernel("attn_prefill.cu", "wide_attn_prefill", dt, {"HEAD_DIM": d}, dev)

    def run():
        args = (arg(q_), *map(i64, (q_.stride(0), q_.stride(1), q_.stride(2))),
                arg(k_), *map(i64, (k_.stride(0), k_.stride(1), k_.stride(2))),
                arg(v_), *map(i64, (v_.stride(0), v_.stride(1), v_.stride(2))),
                kv_arg, i64(kv_sb), i32(has_kv), arg(order), arg(counts),
                arg(out), *map(i64, out.stride()[:3]), i32(T), i32(S), i32(H), i32(Hkv), i32(q_offset),
                np.float32(scale * math.log2(math.e)), i32(window or 0), i32(1))  # fmt: skip
        launch(kern, (-(-T // PREFILL_BM), H, B), (128, 1, 1), args, smem, dev)
        return out

    return checked(("attn_prefill.cu", dt, d), dt, run, ref)


def attention_decode(q, k_cache, v_cache, head_mask, key_valid, *, scale, window=None):
    """``ops.attention_decode`` on the GPU kernels (same arguments, result and errors)."""

    def ref():
        return ops.attention_decode(q, k_cache, v_cache, head_mask, key_valid, scale=scale, window=window)

    ops.check_decode_shapes(q, k_cache, head_mask, key_valid)
    B, H, d = q.shape
    Hkv = k_cache.shape[1]
    S = key_valid.shape[1]
    hq = H // Hkv
    why = _why_not(q, k_cache, v_cache)
    if why is None and d not in DECODE_HEAD_DIMS:
        why = f"head dim {d} is not one of {DECODE_HEAD_DIMS}"
    if why is None and hq > 16:
        why = f"{hq} query heads per KV head (at most 16)"
    if why:
        return fallback("attention_decode", why, ref)
    if S == 0 or B == 0:
        return ref()
    _attention_path("attention_decode", B)
    dev, dt = q.device, DTYPES[q.dtype]
    q_ = q if (q.stride(-1) == 1 and q.stride(0) % 8 == 0 and q.stride(1) % 8 == 0 and q.data_ptr() % 16 == 0) \
        else q.contiguous()  # fmt: skip
    kc = k_cache if _attn_strides_ok(k_cache) else k_cache.contiguous()
    vc = v_cache if _attn_strides_ok(v_cache) else v_cache.contiguous()
    kvv = _bool_on(key_valid, dev)
    if head_mask is None:
        hm_arg, hm_sb, hm_sh, has_hm = arg(kvv), 0, 0, 0
    else:
        hm = _bool_on(head_mask, dev)
        hm_arg, hm_sb, hm_sh, has_hm = arg(hm), hm.stride(0), hm.stride(1), 1
    chunk, nsplit = decode_split(B, Hkv, S, _sms(dev))
    o_part = torch.empty(B, H, nsplit, d, dtype=torch.float32, device=dev)
    ml_part = torch.empty(B, H, nsplit, 2, dtype=torch.float32, device=dev)
    out = torch.empty(B, H, d, dtype=q.dtype, device=dev)
    defines = {"HEAD_DIM": d, "HQ": hq}
    split = get_kernel("attn_decode.cu", "wide_attn_decode_split", dt, defines, dev)
    combine = get_kernel("attn_decode.cu", "wide_attn_decode_combine", dt, defines, dev)
    smem = (hq * chunk + 4 * hq * d + 2 * hq) * 4

    def run():
        args = (arg(q_), i64(q_.stride(0)), i64(q_.stride(1)),
                arg(kc), i64(kc.stride(0)), i64(kc.stride(1)), i64(kc.stride(2)),
                arg(vc), i64(vc.stride(0)), i64(vc.stride(1)), i64(vc.stride(2)),
                hm_arg, i64(hm_sb), i64(hm_sh), i32(has_hm), arg(kvv), i64(kvv.stride(0)), i64(kvv.stride(1)),
                arg(o_part), arg(ml_part), i32(S), i32(H), i32(Hkv), i32(chunk), i32(nsplit),
                np.float32(scale * math.log2(math.e)), i32(window or 0))  # fmt: skip
        launch(split, (nsplit, Hkv, B), (128, 1, 1), args, smem, dev)
        args = (arg(o_part), arg(ml_part), hm_arg, i64(hm_sb), i64(hm_sh), i32(has_hm),
                arg(out), i64(out.stride(0)), i64(out.stride(1)), i32(H), i32(nsplit))  # fmt: skip
        launch(combine, (H, B, 1), (max(d, 32), 1, 1), args, 0, dev)
        return out

    return checked(("attn_decode.cu", dt, d, hq), dt, run, ref)


def mlp(x, w_gate, w_up, w_down, mask, group_size):
    """Routed SwiGLU FFN ``x [M, D] -> [M, D]``: ``gemm_mn_swiglu`` then ``gemm_k``, with the
    intermediate's skipped entries left unwritten (``gemm_k`` never reads them)."""
    if mask is None:
        return ops.gemm_k(ops.gemm_mn_swiglu(x, w_gate, w_up, None, group_size), w_down, None, group_size)
    h = _gemm_mn(x, w_gate, w_up, mask, group_size, None, swiglu=True, zero_skipped=False)
    return gemm_k(h, w_down, mask, group_size)
