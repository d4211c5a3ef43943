"""The routed operators on NVIDIA GPUs: CuPy-launched CUDA kernels (DESIGN.md §3), and the
dispatch that picks, per call, a kernel build, cuBLAS or the reference.

Every public operator has the exact signature and semantics of its reference in
``runtime/ops.py``; the kernels' sources live in the top-level ``kernels/``. Below this module,
``runtime/cuda/`` holds one concern per file: ``builds`` (tile tables, shape arithmetic),
``launch`` (availability, build cache, launches), ``verify`` (fallbacks, first-use checks),
``autotune``, and ``registry`` (``REGISTRY``: the process-wide state and settings, with
``fallback_counts()``, ``dispatch_counts()`` and ``broken_builds()``).

- **Dispatch**: ``M <= 8`` tokens take the GEMV kernels (decode: skipped groups skip weight
  reads); larger ``M`` the mask-reordered tensor-core GEMMs, with a tile picked per shape by a
  small heuristic, or by measurement with ``WIDE_CUPY_AUTOTUNE=1``. ``mask=None`` goes to cuBLAS.
- **Dense when routing skips little**: the kernels use ``mma.sync`` tensor cores, slower per FLOP
  than cuBLAS on Hopper, so for ``M >= AUTO_MIN_M`` one host sync reads the live fraction of the
  mask (executing pairs for ``gemm_mn``, live 16-row fragments for ``gemm_k``); above
  ``WIDE_CUPY_DENSE_ABOVE`` (default 0.6) the op runs cuBLAS on the masked input instead, which is
  exactly the same function. Never during CUDA-graph capture; ``REGISTRY.dispatch_counts()`` says
  which ran.
- **Never a wrong answer**: unsupported shapes, dtypes or layouts go to the PyTorch reference, and
  the first call of every build is checked against it (``runtime/cuda/verify.py``).

Dtypes: bf16 and fp16 run on the kernels (fp32 accumulate); fp32 uses the reference.
Importing this module needs neither CuPy nor a GPU; calling an operator needs both.
"""

from __future__ import annotations

import math

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


def _dense_is_faster(op: str, live: torch.Tensor, M: int) -> bool:
    """True when the mask leaves so much work that cuBLAS on the masked input wins (one sync)."""
    threshold = REGISTRY.dense_above()
    if M < AUTO_MIN_M or threshold >= 1.0 or torch.cuda.is_current_stream_capturing():
        REGISTRY.dispatch[(op, "kernel")] += 1
        return False
    dense = float(live) > threshold
    REGISTRY.dispatch[(op, "cuBLAS on the masked input" if dense else "kernel")] += 1
    return dense


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
    a_, w_ = _aligned_rows(a), _aligned_rows(w)
    w2_ = w_ if w2 is None else _aligned_rows(w2)
    if w2 is not None and w2_.stride(0) != w_.stride(0):
        w2_, w_ = w2_.contiguous(), w_.contiguous()
    mask_ = _bool_on(mask, dev)
    out = torch.empty(M, N, dtype=a.dtype, device=dev)
    bias_ = bias.contiguous() if bias is not None else None
    bias_arg, has_bias = (arg(bias_), 1) if bias_ is not None else (arg(out), 0)
    written = None
    if not zero_skipped:

        def written(o):
            return torch.where(
                ops.expand_mask(mask_, group_size), o, torch.zeros((), dtype=o.dtype, device=dev)
            )

    if M <= GEMV_MAX_M and group_size % 2 == 0:
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
    if _dense_is_faster(op, counts.sum() / max(1, counts.numel() * M), M):
        return ref()  # dense cuBLAS, then the mask: the same function

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
    a_, w_ = _aligned_rows(a), _aligned_rows(w)
    mask_ = _bool_on(mask, dev)
    G = Kd // group_size
    out = torch.empty(M, N, dtype=a.dtype, device=dev)
    bias_ = bias.contiguous() if bias is not None else None
    bias_arg, has_bias = (arg(bias_), 1) if bias_ is not None else (arg(out), 0)

    if M <= GEMV_MAX_M:
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
    packed = pack_mask(mask_)
    words = packed.shape[0]
    halves = torch.stack([packed & 0xFFFF, (packed >> 16) & 0xFFFF])  # 16-row fragments x groups
    if _dense_is_faster("gemm_k", (halves != 0).float().mean(), M):
        return ref()  # cuBLAS on the masked activations: the same function

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
