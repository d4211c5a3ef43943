"""The routed operators on NVIDIA GPUs: CuPy-launched CUDA kernels (DESIGN.md §3).

Every public operator has the exact signature and semantics of its reference in
``runtime/ops.py``; the kernels' sources live in the top-level ``kernels/``.

- **Build**: each kernel is compiled once per (source, dtype, tile config, arch) with
  ``cupy.RawModule(backend="nvrtc")`` and kept in a process cache (CuPy also caches the cubin on
  disk, keyed by source text + options). ``-arch=sm_XX`` comes from the device at run time.
- **Sharing**: torch tensors are passed to kernels zero-copy, on torch's current stream. By
  default kernels receive raw device pointers (``Tensor.data_ptr``); ``WIDE_CUPY_ARGS=dlpack``
  passes CuPy views made with ``cupy.from_dlpack`` instead (same memory, more launch overhead).
- **Dispatch**: ``M <= 8`` tokens take the GEMV kernels (decode: skipped groups skip weight
  reads); larger ``M`` the mask-reordered tensor-core GEMMs, with a tile picked per shape by a
  small heuristic, or by measurement with ``WIDE_CUPY_AUTOTUNE=1`` (stored on disk, keyed by
  device, op, dtype, N, K, group size and next-pow2(M)). ``mask=None`` goes to cuBLAS.
- **Dense when routing skips little**: the kernels use ``mma.sync`` tensor cores, slower per FLOP
  than cuBLAS on Hopper, so for ``M >= AUTO_MIN_M`` one host sync reads the live fraction of the
  mask (executing pairs for ``gemm_mn``, live 16-row fragments for ``gemm_k``); above
  ``WIDE_CUPY_DENSE_ABOVE`` (default 0.6) the op runs cuBLAS on the masked input instead, which is
  exactly the same function. Never during CUDA-graph capture; ``dispatch_counts()`` says which ran.
- **Never a wrong answer** (B08): shapes, dtypes or layouts a kernel does not support go to the
  PyTorch reference (logged once per reason, counted in ``fallback_counts()``). With
  ``WIDE_CUPY_VERIFY=1`` (the default) the first call of every kernel build is also computed by
  the reference and compared; a build that disagrees is disabled and logged as an error
  (``broken_builds()``), and the reference result is returned.

Dtypes: bf16 and fp16 run on the kernels (fp32 accumulate); fp32 uses the reference.
Importing this module needs neither CuPy nor a GPU; calling an operator needs both.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from wide_cli.runtime import ops
from wide_cli.runtime.cuda import sources

log = logging.getLogger("wide.cupy")

DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
GEMV_MAX_M = 8  # calls with at most this many tokens take the GEMV kernels
PREFILL_BM = 64  # query rows per attention-prefill block (4 warps x 16)
VERIFY_TOL = {"bf16": 2e-2, "fp16": 5e-3}  # relative Frobenius error vs the reference
AUTO_MIN_M = 512  # from this many tokens a host sync to pick kernel vs cuBLAS is cheap enough

# ----------------------------------------------------------------------------------------------
# tile tables (what the dispatcher may build; ``kernel_builds`` lists them for the CI compile)


@dataclass(frozen=True)
class GemmTile:
    """One tensor-core GEMM tile: BM tokens x BN weight rows, WARPS_M x WARPS_N warps."""

    bm: int
    bn: int
    warps_m: int
    warps_n: int
    stages: int = 4

    @property
    def name(self) -> str:
        return f"{self.bm}x{self.bn}"

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n

    def bn_out(self, swiglu: bool) -> int:
        """Output channels per tile (a SwiGLU tile holds gate and up rows of BN/2 channels)."""
        return self.bn // 2 if swiglu else self.bn

    def valid(self, swiglu: bool) -> bool:
        wtm, wtn = self.bm // self.warps_m, self.bn // self.warps_n
        ok = wtm % 16 == 0 and wtn % 16 == 0
        return ok and (not swiglu or (wtn // 2) % 16 == 0)

    def smem(self) -> int:
        return self.stages * (self.bm + self.bn) * (32 + 8) * 2

    def defines(self, swiglu: bool | None = None) -> dict[str, int]:
        d = {
            "BM": self.bm,
            "BN": self.bn,
            "WARPS_M": self.warps_m,
            "WARPS_N": self.warps_n,
            "STAGES": self.stages,
        }
        if swiglu is not None:
            d["SWIGLU"] = int(swiglu)
        return d


GEMM_MN_TILES: tuple[GemmTile, ...] = (
    GemmTile(128, 128, 2, 2), GemmTile(64, 128, 2, 2), GemmTile(32, 128, 2, 2), GemmTile(16, 128, 1, 4),
    GemmTile(128, 64, 2, 2), GemmTile(64, 64, 2, 2), GemmTile(32, 64, 2, 2), GemmTile(16, 64, 1, 4),
    GemmTile(64, 32, 2, 2), GemmTile(32, 32, 2, 2),
)  # fmt: skip
GEMM_K_TILES: tuple[GemmTile, ...] = (
    GemmTile(128, 128, 2, 2), GemmTile(64, 128, 2, 2), GemmTile(32, 128, 2, 2), GemmTile(16, 128, 1, 4),
    GemmTile(64, 64, 2, 2),
)  # fmt: skip
GEMV_MMAX = (1, 2, 4, 8)
PREFILL_HEAD_DIMS = (16, 32, 64, 128, 256)  # any multiple of 16 up to 256 works; these are CI-built
DECODE_HEAD_DIMS = (16, 32, 64, 128, 256)  # 8 * lanes-per-key must divide a warp
DECODE_HQ_CI = (1, 2, 3, 4, 8)  # query heads per KV head built in CI (any 1..16 at run time)


@dataclass(frozen=True)
class Build:
    """One compilation unit: a source file with its defines (dtype and arch come on top)."""

    source: str
    defines: tuple[tuple[str, int], ...] = ()

    @property
    def label(self) -> str:
        return self.source + "".join(f" {k}={v}" for k, v in self.defines)


def _b(source: str, defines: dict[str, int] | None = None) -> Build:
    return Build(source, tuple(sorted((defines or {}).items())))


def kernel_builds() -> list[Build]:
    """Every build the dispatcher can ask for (decode attention: the CI subset of head counts)."""
    builds = [_b("reorder.cu")]
    for sw in (False, True):
        builds += [_b("gemm_mn.cu", t.defines(sw)) for t in GEMM_MN_TILES if t.valid(sw)]
    builds += [_b("gemm_k.cu", t.defines()) for t in GEMM_K_TILES]
    builds += [_b("gemv.cu", {"MMAX": m, "SWIGLU": sw}) for m in GEMV_MMAX for sw in (0, 1)]
    builds += [_b("attn_prefill.cu", {"HEAD_DIM": d}) for d in PREFILL_HEAD_DIMS]
    builds += [_b("attn_decode.cu", {"HEAD_DIM": d, "HQ": hq}) for d in (64, 128) for hq in DECODE_HQ_CI]
    builds += [_b("attn_decode.cu", {"HEAD_DIM": 16, "HQ": 2}), _b("attn_decode.cu", {"HEAD_DIM": 32, "HQ": 2}),
               _b("attn_decode.cu", {"HEAD_DIM": 256, "HQ": 16})]  # fmt: skip
    return builds


# ----------------------------------------------------------------------------------------------
# availability, arch, compile cache, launch


def cuda_status() -> str | None:
    """None when the kernels can run here, else the reason (one line, says what is missing)."""
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    try:
        import cupy
    except ImportError as e:
        return f"cupy is not installed ({e}); install the cuda extra: pip install -e '.[cuda]'"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except RuntimeError as e:  # CUDARuntimeError: no driver / insufficient driver
        return f"no CUDA device visible to CuPy ({type(e).__name__}: {e})"
    return None if n > 0 else "no CUDA device visible to CuPy (device count 0)"


def device_arch(device: torch.device) -> str:
    """``sm_XY`` for ``device``, capped at the newest arch this NVRTC can target (cached)."""
    idx = torch.device(device).index
    arch = _ARCH.get(idx)
    if arch is None:
        arch = _ARCH[idx] = _query_arch(device)
    return arch


_ARCH: dict[int | None, str] = {}


def _query_arch(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    cc = 10 * major + minor
    try:
        from cupy_backends.cuda.libs import nvrtc

        supported = [int(a) for a in nvrtc.getSupportedArchs()]
        cc = max(a for a in supported if a <= cc) if any(a <= cc for a in supported) else cc
    except (ImportError, AttributeError, RuntimeError):  # old binding: trust the device
        log.debug("NVRTC supported-arch query failed; using the device arch sm_%d", cc)
    return f"sm_{cc}"


_LOCK = threading.Lock()
_KERNELS: dict[tuple, Any] = {}
_SMEM_SET: dict[int, int] = {}
_STREAMS: dict[tuple[int, int], Any] = {}
_BROKEN: set[tuple] = set()
_VERIFIED: set[tuple] = set()
_FALLBACKS: Counter = Counter()
_DISPATCH: Counter = Counter()
_WARNED: set[tuple[str, str]] = set()


def get_kernel(source: str, func: str, dtype: str, defines: dict[str, int], device: torch.device):
    """The compiled ``cupy.RawKernel`` ``func`` of ``source`` for this build (compiled once)."""
    import cupy

    arch = device_arch(device)
    key = (source, func, dtype, tuple(sorted(defines.items())), arch)
    kern = _KERNELS.get(key)
    if kern is None:
        with _LOCK:
            kern = _KERNELS.get(key)
            if kern is None:
                mod = cupy.RawModule(
                    code=sources.load_source(source),
                    options=sources.compile_options(dtype, arch, defines),
                    backend="nvrtc",
                )
                with cupy.cuda.Device(device.index):
                    kern = mod.get_function(func)  # compiles (or loads CuPy's disk cache) now
                _KERNELS[key] = kern
    return kern


def _stream(device: torch.device):
    import cupy

    s = torch.cuda.current_stream(device)
    key = (device.index, s.cuda_stream)
    st = _STREAMS.get(key)
    if st is None:
        st = _STREAMS[key] = cupy.cuda.ExternalStream(s.cuda_stream, device.index)
    return st


_ARGS_MODE = os.environ.get("WIDE_CUPY_ARGS", "ptr")


def _arg(t: torch.Tensor):
    """A kernel pointer argument for tensor ``t`` (zero-copy)."""
    if _ARGS_MODE == "dlpack":
        import cupy

        view = t.view(torch.uint8) if t.dtype == torch.bool else t
        if view.dtype in (torch.bfloat16, torch.float16):
            view = view.view(torch.int16)
        return cupy.from_dlpack(view)
    return np.uint64(t.data_ptr())


def _i32(x) -> np.int32:
    return np.int32(x)


def _i64(x) -> np.int64:
    return np.int64(x)


def launch(kern, grid: tuple, block: tuple, args: tuple, smem: int, device: torch.device) -> None:
    """Launch on torch's current stream of ``device``; raises the kernel's dynamic-smem limit once."""
    import cupy

    with cupy.cuda.Device(device.index):
        if smem > 48 * 1024 and _SMEM_SET.get(id(kern), 0) < smem:
            kern.max_dynamic_shared_size_bytes = smem
            _SMEM_SET[id(kern)] = smem
        with _stream(device):
            kern(grid, block, args, shared_mem=smem)


def _fallback(op: str, why: str, ref: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Run the PyTorch reference instead of a kernel, logging the reason once."""
    _FALLBACKS[(op, why)] += 1
    if (op, why) not in _WARNED:
        _WARNED.add((op, why))
        log.warning("cupy %s: %s; using the PyTorch reference for this shape", op, why)
    return ref()


def fallback_counts() -> dict[str, int]:
    """``"op: reason" -> calls`` routed to the reference so far in this process."""
    return {f"{op}: {why}": n for (op, why), n in _FALLBACKS.items()}


def dispatch_counts() -> dict[str, int]:
    """``"op: path" -> calls`` for the large-M kernel-vs-cuBLAS choice made so far."""
    return {f"{op}: {path}": n for (op, path), n in _DISPATCH.items()}


def _dense_is_faster(op: str, live: torch.Tensor, M: int) -> bool:
    """True when the mask leaves so much work that cuBLAS on the masked input wins (one sync)."""
    threshold = float(os.environ.get("WIDE_CUPY_DENSE_ABOVE", "0.6"))
    if M < AUTO_MIN_M or threshold >= 1.0 or torch.cuda.is_current_stream_capturing():
        _DISPATCH[(op, "kernel")] += 1
        return False
    dense = float(live) > threshold
    _DISPATCH[(op, "cuBLAS on the masked input" if dense else "kernel")] += 1
    return dense


def broken_builds() -> list[str]:
    """Kernel builds disabled because their first result disagreed with the reference."""
    return sorted(str(k) for k in _BROKEN)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    o, r = out.float(), ref.float()
    if not torch.isfinite(o).all() and torch.isfinite(r).all():
        return float("inf")
    return float((o - r).norm() / r.norm().clamp_min(1e-12)) if r.numel() else 0.0


def _checked(
    key: tuple,
    dtype: str,
    run: Callable[[], torch.Tensor],
    ref: Callable[[], torch.Tensor],
    written: Callable[[torch.Tensor], torch.Tensor] | None = None,
):
    """Run a kernel build; on its first use also the reference, and disable it if they disagree.

    ``written`` keeps only the entries a build defines (outputs it leaves unwritten are zeroed
    before the comparison).
    """
    if key in _BROKEN:
        return ref()
    if key in _VERIFIED or os.environ.get("WIDE_CUPY_VERIFY", "1") == "0":
        return run()
    out, expect = run(), ref()
    err = _rel_err(out if written is None else written(out), expect)
    if err <= VERIFY_TOL[dtype]:
        _VERIFIED.add(key)
        return out
    _BROKEN.add(key)
    log.error("cupy kernel %s disagrees with the reference (relative error %.3g); disabled", key, err)
    return expect


# ----------------------------------------------------------------------------------------------
# shape checks and helpers


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x - 1).bit_length())


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


# ---- autotune (optional): best tile per (device, op, dtype, N, K, g, next-pow2(M)), on disk

_TUNE: dict[str, str] | None = None


def _tune_path() -> Path:
    root = os.environ.get("WIDE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "wide")
    return Path(root) / "cupy_autotune.json"


def _tune_table() -> dict[str, str]:
    global _TUNE
    if _TUNE is None:
        try:
            _TUNE = json.loads(_tune_path().read_text())
        except (OSError, ValueError):
            _TUNE = {}
    return _TUNE


def _tune_save() -> None:
    path = _tune_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(_tune_table(), indent=1, sort_keys=True))
    os.replace(tmp, path)


def _time_ms(fn: Callable[[], Any], reps: int = 5) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def _pick_tile(
    key: str, cands: list[GemmTile], default: GemmTile, run: Callable[[GemmTile], Any]
) -> GemmTile:
    """The heuristic's tile, or with WIDE_CUPY_AUTOTUNE=1 the measured best (stored on disk)."""
    if os.environ.get("WIDE_CUPY_AUTOTUNE", "0") != "1" or len(cands) < 2:
        return default
    table = _tune_table()
    byname = {t.name: t for t in cands}
    if table.get(key) in byname:
        return byname[table[key]]
    times = {t.name: _time_ms(lambda t=t: run(t)) for t in cands}
    best = min(times, key=times.get)
    table[key] = best
    _tune_save()
    log.info("cupy autotune %s: %s (%s)", key, best, ", ".join(f"{k} {v:.3f} ms" for k, v in times.items()))
    return byname[best]


def _heuristic_tile(cands: list[GemmTile], M: int, n_tiles: int, sms: int, density: float) -> GemmTile:
    """Largest BM that still gives about two waves of live blocks at the expected density."""
    cands = sorted(cands, key=lambda t: -t.bm)
    for t in cands:
        if t.bm > max(16, _next_pow2(M)):
            continue
        if n_tiles * math.ceil(max(1, M * density) / t.bm) >= 2 * sms:
            return t
    fitting = [t for t in cands if t.bm <= max(16, _next_pow2(M))]
    return fitting[-1] if fitting else cands[-1]


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
        args = (_arg(m3), _i64(s_b), _i64(s_m), _i64(s_g), _i32(M), _i32(G), _arg(order), _arg(counts))
        launch(kern, (G, B, 1), (256, 1, 1), args, 0, mask.device)
    return (order, counts) if batched else (order[0], counts[0])


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """GPU ``schedule.pack_mask`` (int32 words; read as unsigned by the kernels)."""
    M, G = mask.shape
    words = -(-M // 32)
    packed = torch.empty(words, G, dtype=torch.int32, device=mask.device)
    kern = get_kernel("reorder.cu", "wide_pack_mask", "bf16", {}, mask.device)
    args = (_arg(mask), _i64(mask.stride(0)), _i64(mask.stride(1)), _i32(M), _i32(G), _arg(packed))
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
        return _fallback(op, why, ref)
    dev, dt = a.device, DTYPES[a.dtype]
    a_, w_ = _aligned_rows(a), _aligned_rows(w)
    w2_ = w_ if w2 is None else _aligned_rows(w2)
    if w2 is not None and w2_.stride(0) != w_.stride(0):
        w2_, w_ = w2_.contiguous(), w_.contiguous()
    mask_ = _bool_on(mask, dev)
    out = torch.empty(M, N, dtype=a.dtype, device=dev)
    bias_ = bias.contiguous() if bias is not None else None
    bias_arg, has_bias = (_arg(bias_), 1) if bias_ is not None else (_arg(out), 0)
    written = None
    if not zero_skipped:

        def written(o):
            return torch.where(
                ops.expand_mask(mask_, group_size), o, torch.zeros((), dtype=o.dtype, device=dev)
            )

    if M <= GEMV_MAX_M and group_size % 2 == 0:
        mmax = _next_pow2(M)
        defines = {"MMAX": mmax, "SWIGLU": int(swiglu)}
        kern = get_kernel("gemv.cu", "wide_gemv_mn", dt, defines, dev)
        rows = 8 * (1 if swiglu else 2)  # WARPS * output rows per warp

        def run():
            args = (_arg(a_), _i64(a_.stride(0)), _arg(w_), _arg(w2_), _i64(w_.stride(0)), bias_arg, _i32(has_bias),
                    _arg(mask_), _i64(mask_.stride(0)), _i64(mask_.stride(1)), _arg(out), _i64(N),
                    _i32(M), _i32(N), _i32(Kd), _i32(group_size), _i32(int(zero_skipped)))  # fmt: skip
            launch(kern, (-(-N // rows), 1, 1), (256, 1, 1), args, 0, dev)
            return out

        return _checked(("gemv.cu", op, dt, tuple(defines.items())), dt, run, ref, written)

    cands = [t for t in GEMM_MN_TILES if t.valid(swiglu) and group_size % t.bn_out(swiglu) == 0]
    if not cands:
        return _fallback(op, f"group_size {group_size} is not a multiple of 16 (32 for SwiGLU)", ref)
    widest = max(t.bn_out(swiglu) for t in cands)
    cands = [t for t in cands if t.bn_out(swiglu) == widest]
    order, counts = reorder(mask_)  # counted in the op's time (one launch)
    if _dense_is_faster(op, counts.sum() / max(1, counts.numel() * M), M):
        return ref()  # dense cuBLAS, then the mask: the same function

    def run_tile(t: GemmTile):
        kern = get_kernel("gemm_mn.cu", "wide_gemm_mn", dt, t.defines(swiglu), dev)
        args = (_arg(a_), _i64(a_.stride(0)), _arg(w_), _arg(w2_), _i64(w_.stride(0)), bias_arg, _i32(has_bias),
                _arg(order), _arg(counts), _arg(out), _i64(N), _i32(M), _i32(N), _i32(Kd), _i32(group_size),
                _i32(int(zero_skipped)))  # fmt: skip
        launch(kern, (-(-M // t.bm), N // t.bn_out(swiglu), 1), (t.threads, 1, 1), args, t.smem(), dev)
        return out

    default = _heuristic_tile(cands, M, N // widest, _sms(dev), 0.5)
    key = f"{torch.cuda.get_device_name(dev)}|{op}|{dt}|N{N}|K{Kd}|g{group_size}|M{_next_pow2(M)}"
    tile = _pick_tile(key, cands, default, run_tile)
    return _checked(("gemm_mn.cu", op, dt, tile.name), dt, lambda: run_tile(tile), ref, written)


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
        return _fallback("gemm_k", why, ref)
    dev, dt = a.device, DTYPES[a.dtype]
    a_, w_ = _aligned_rows(a), _aligned_rows(w)
    mask_ = _bool_on(mask, dev)
    G = Kd // group_size
    out = torch.empty(M, N, dtype=a.dtype, device=dev)
    bias_ = bias.contiguous() if bias is not None else None
    bias_arg, has_bias = (_arg(bias_), 1) if bias_ is not None else (_arg(out), 0)

    if M <= GEMV_MAX_M:
        defines = {"MMAX": _next_pow2(M), "SWIGLU": 0}
        kern = get_kernel("gemv.cu", "wide_gemv_k", dt, defines, dev)

        def run():
            args = (_arg(a_), _i64(a_.stride(0)), _arg(w_), _i64(w_.stride(0)), bias_arg, _i32(has_bias),
                    _arg(mask_), _i64(mask_.stride(0)), _i64(mask_.stride(1)), _arg(out), _i64(N),
                    _i32(M), _i32(N), _i32(Kd), _i32(group_size))  # fmt: skip
            launch(kern, (-(-N // 16), 1, 1), (256, 1, 1), args, G * 5, dev)
            return out

        return _checked(("gemv.cu", "gemm_k", dt, tuple(defines.items())), dt, run, ref)

    if group_size % 32:
        return _fallback("gemm_k", f"group_size {group_size} is not a multiple of 32", ref)
    packed = pack_mask(mask_)
    words = packed.shape[0]
    halves = torch.stack([packed & 0xFFFF, (packed >> 16) & 0xFFFF])  # 16-row fragments x groups
    if _dense_is_faster("gemm_k", (halves != 0).float().mean(), M):
        return ref()  # cuBLAS on the masked activations: the same function

    def run_tile(t: GemmTile):
        kern = get_kernel("gemm_k.cu", "wide_gemm_k", dt, t.defines(), dev)
        smem = t.smem() + G * max(1, t.bm // 32) * 4 + G * 4
        args = (_arg(a_), _i64(a_.stride(0)), _arg(w_), _i64(w_.stride(0)), bias_arg, _i32(has_bias),
                _arg(packed), _i32(words), _arg(out), _i64(N), _i32(M), _i32(N), _i32(Kd), _i32(group_size))  # fmt: skip
        launch(kern, (-(-N // t.bn) * -(-M // t.bm), 1, 1), (t.threads, 1, 1), args, smem, dev)
        return out

    cands = list(GEMM_K_TILES)
    default = _heuristic_tile([t for t in cands if t.bn == 128], M, -(-N // 128), _sms(dev), 1.0)
    key = f"{torch.cuda.get_device_name(dev)}|gemm_k|{dt}|N{N}|K{Kd}|g{group_size}|M{_next_pow2(M)}"
    tile = _pick_tile(key, cands, default, run_tile)
    return _checked(("gemm_k.cu", dt, tile.name), dt, lambda: run_tile(tile), ref)


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

    B, T, H, d = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    assert H % Hkv == 0, f"{H} query heads vs {Hkv} KV heads"
    assert S >= q_offset + T, f"{S} key slots < q_offset {q_offset} + {T} queries"
    assert v.shape == k.shape
    if head_mask is not None:
        assert tuple(head_mask.shape) == (B, T, H), f"head_mask {tuple(head_mask.shape)} != {(B, T, H)}"
    why = _why_not(q, k, v)
    if why is None and (d % 16 or d > 256):
        why = f"head dim {d} is not a multiple of 16 up to 256"
    if why:
        return _fallback("attention_prefill", why, ref)
    if T == 0 or B == 0:
        return ref()
    dev, dt = q.device, DTYPES[q.dtype]
    q_, k_, v_ = (t if _attn_strides_ok(t) else t.contiguous() for t in (q, k, v))
    hm = torch.ones(B, T, H, dtype=torch.bool, device=dev) if head_mask is None else _bool_on(head_mask, dev)
    order, counts = reorder(hm)  # [B, H, T], [B, H]
    out = torch.empty(B, T, H, d, dtype=q.dtype, device=dev)
    if key_valid is None:
        kv_arg, kv_sb, has_kv = _arg(counts), 0, 0
    else:
        kvv = _bool_on(key_valid, dev)
        kvv = kvv if kvv.stride(-1) == 1 else kvv.contiguous()
        kv_arg, kv_sb, has_kv = _arg(kvv), kvv.stride(0), 1
    bn = 32 if d > 128 else 64
    smem = (PREFILL_BM + 4 * bn) * (d + 8) * 2 + 2 * bn
    kern = get_kernel("attn_prefill.cu", "wide_attn_prefill", dt, {"HEAD_DIM": d}, dev)

    def run():
        args = (_arg(q_), *map(_i64, (q_.stride(0), q_.stride(1), q_.stride(2))),
                _arg(k_), *map(_i64, (k_.stride(0), k_.stride(1), k_.stride(2))),
                _arg(v_), *map(_i64, (v_.stride(0), v_.stride(1), v_.stride(2))),
                kv_arg, _i64(kv_sb), _i32(has_kv), _arg(order), _arg(counts),
                _arg(out), *map(_i64, out.stride()[:3]), _i32(T), _i32(S), _i32(H), _i32(Hkv), _i32(q_offset),
                np.float32(scale * math.log2(math.e)), _i32(window or 0), _i32(1))  # fmt: skip
        launch(kern, (-(-T // PREFILL_BM), H, B), (128, 1, 1), args, smem, dev)
        return out

    return _checked(("attn_prefill.cu", dt, d), dt, run, ref)


def decode_split(batch: int, kv_heads: int, slots: int, sms: int) -> tuple[int, int]:
    """``(keys per block, blocks per (row, KV head))`` for decode: about eight blocks per SM
    before skipping (so about four live ones at 50 % sparsity, enough 16-byte loads in flight to
    stream the cache), 64..1024 keys each (a power of two)."""
    want = max(1, (slots * batch * kv_heads) // (8 * sms))
    chunk = min(1024, max(64, _next_pow2(want)))
    return chunk, -(-slots // chunk)


def attention_decode(q, k_cache, v_cache, head_mask, key_valid, *, scale, window=None):
    """``ops.attention_decode`` on the GPU kernels (same arguments, result and errors)."""

    def ref():
        return ops.attention_decode(q, k_cache, v_cache, head_mask, key_valid, scale=scale, window=window)

    B, H, d = q.shape
    Hkv, S_max = k_cache.shape[1], k_cache.shape[2]
    S = key_valid.shape[1]
    assert S <= S_max and H % Hkv == 0
    if head_mask is not None:
        assert tuple(head_mask.shape) == (B, H)
    hq = H // Hkv
    why = _why_not(q, k_cache, v_cache)
    if why is None and d not in DECODE_HEAD_DIMS:
        why = f"head dim {d} is not one of {DECODE_HEAD_DIMS}"
    if why is None and hq > 16:
        why = f"{hq} query heads per KV head (at most 16)"
    if why:
        return _fallback("attention_decode", why, ref)
    if S == 0 or B == 0:
        return ref()
    dev, dt = q.device, DTYPES[q.dtype]
    q_ = q if (q.stride(-1) == 1 and q.stride(0) % 8 == 0 and q.stride(1) % 8 == 0 and q.data_ptr() % 16 == 0) \
        else q.contiguous()  # fmt: skip
    kc = k_cache if _attn_strides_ok(k_cache) else k_cache.contiguous()
    vc = v_cache if _attn_strides_ok(v_cache) else v_cache.contiguous()
    kvv = _bool_on(key_valid, dev)
    if head_mask is None:
        hm_arg, hm_sb, hm_sh, has_hm = _arg(kvv), 0, 0, 0
    else:
        hm = _bool_on(head_mask, dev)
        hm_arg, hm_sb, hm_sh, has_hm = _arg(hm), hm.stride(0), hm.stride(1), 1
    chunk, nsplit = decode_split(B, Hkv, S, _sms(dev))
    o_part = torch.empty(B, H, nsplit, d, dtype=torch.float32, device=dev)
    ml_part = torch.empty(B, H, nsplit, 2, dtype=torch.float32, device=dev)
    out = torch.empty(B, H, d, dtype=q.dtype, device=dev)
    defines = {"HEAD_DIM": d, "HQ": hq}
    split = get_kernel("attn_decode.cu", "wide_attn_decode_split", dt, defines, dev)
    combine = get_kernel("attn_decode.cu", "wide_attn_decode_combine", dt, defines, dev)
    smem = (hq * chunk + 4 * hq * d + 2 * hq) * 4

    def run():
        args = (_arg(q_), _i64(q_.stride(0)), _i64(q_.stride(1)),
                _arg(kc), _i64(kc.stride(0)), _i64(kc.stride(1)), _i64(kc.stride(2)),
                _arg(vc), _i64(vc.stride(0)), _i64(vc.stride(1)), _i64(vc.stride(2)),
                hm_arg, _i64(hm_sb), _i64(hm_sh), _i32(has_hm), _arg(kvv), _i64(kvv.stride(0)), _i64(kvv.stride(1)),
                _arg(o_part), _arg(ml_part), _i32(S), _i32(H), _i32(Hkv), _i32(chunk), _i32(nsplit),
                np.float32(scale * math.log2(math.e)), _i32(window or 0))  # fmt: skip
        launch(split, (nsplit, Hkv, B), (128, 1, 1), args, smem, dev)
        args = (_arg(o_part), _arg(ml_part), hm_arg, _i64(hm_sb), _i64(hm_sh), _i32(has_hm),
                _arg(out), _i64(out.stride(0)), _i64(out.stride(1)), _i32(H), _i32(nsplit))  # fmt: skip
        launch(combine, (H, B, 1), (max(d, 32), 1, 1), args, 0, dev)
        return out

    return _checked(("attn_decode.cu", dt, d, hq), dt, run, ref)


def mlp(x, w_gate, w_up, w_down, mask, group_size):
    """Routed SwiGLU FFN ``x [M, D] -> [M, D]``: ``gemm_mn_swiglu`` then ``gemm_k``, with the
    intermediate's skipped entries left unwritten (``gemm_k`` never reads them)."""
    if mask is None:
        return ops.gemm_k(ops.gemm_mn_swiglu(x, w_gate, w_up, None, group_size), w_down, None, group_size)
    h = _gemm_mn(x, w_gate, w_up, mask, group_size, None, swiglu=True, zero_skipped=False)
    return gemm_k(h, w_down, mask, group_size)
