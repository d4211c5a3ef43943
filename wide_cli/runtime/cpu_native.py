"""The cpu backend's native decode step: one new token for each of 1-64 batch rows in one C call
(``kernels/cpu_decode.c``).

The PyTorch decode path issues ~700 small ops per token, and on small models that overhead, not
weight traffic, set the speed. The C step runs the same routed math (DESIGN.md §1) with one call
per step on the weight layouts of ``runtime/cpu_proj.py`` (only bf16 O and down are re-blocked,
a copy of those two). Each row computes only the groups it executes, and a group's weight bytes
are read once per step for all the rows that execute it (none when no row does). The PyTorch
path stays: it runs prefill, batches of more than 64 rows and byte tracing, and it is the test
oracle. The same library has the prefill GEMM (``gemm``): bf16 prefill projections run
on it where PyTorch's are slow (``cpu_proj._native_gemm_dtypes`` says where), gathering each routed group's tokens itself.

Build: on first use the C source is compiled with the system compiler (``$CC``, default ``cc``;
``-O3 -march=native -fopenmp``) into ``$WIDE_CACHE/native/<key>/`` (default ``~/.cache/wide``), keyed by the
source, the compiler and this CPU's flags, written to a temporary name and renamed into place.
``make native`` (run by ``make test``) builds it once. Without a compiler (or with ``WIDE_CPU_NATIVE=0``) the runtime uses
the PyTorch path and says so once in the log.

Threads: the step uses ``torch.get_num_threads()`` threads of the process's OpenMP team, the one
PyTorch's ops run on (the library links ``libgomp.so.1``, which resolves to the copy PyTorch has
loaded), so the two never spin against each other; the portable build keeps a pthread pool. In a
process forked after the library was loaded, the OpenMP build runs every call on one thread (GNU
OpenMP's team does not survive fork); the pthread pool starts new workers at its next resize.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE_NAME = "cpu_decode.c"
# Sources the main one includes (one translation unit): part of the build key.
INCLUDED_SOURCES = ("cpu_prefill_gather.c", "cpu_prefill_ops.c")
ABI = 14
#: Rows of one native step (the C WIDE_MAX_BATCH: a group's rows are one 64-bit set).
MAX_BATCH = 64
FMT_CODE = {torch.float32: 0, torch.bfloat16: 1}
# The C enum FMT_* of a quantized Proj's format.
QUANT_CODE = {"int8": 2, "int4": 3}
# The step's counters, in the order of the C enum CNT_*.
COUNTERS = ("macs", "attn_macs", "router_macs", "weight_bytes")
_I64 = ctypes.c_int64
_P = ctypes.c_void_p


class _WLayer(ctypes.Structure):
    _fields_ = [(n, _I64) for n in ("H", "Hkv", "d", "ag", "GA", "fg", "GF", "window", "blocked")] + [
        (n, _P) for n in ("qkv", "qkv_s", "o", "o_s", "gu", "gu_s", "down", "down_s", "bqkv", "bo", "ln_attn",
                          "ln_ffn", "q_norm", "k_norm", "ra_w", "ra_b", "rf_w", "rf_b", "sa", "sf", "sa_in",
                          "sa_out", "sf_in", "sf_out")
    ] + [("sa_r", _I64), ("sf_r", _I64)] + [(n, _P) for n in ("keep_a", "keep_f", "k_cache", "v_cache")] + [
        (n, _I64) for n in ("keep_a_stride", "keep_f_stride")] + [
        (n, _P) for n in ("ln_attn_out", "ln_ffn_out", "inv_freq")] + [("gelu", _I64)] + [
        (n, ctypes.c_float) for n in ("rope_scale", "attn_scale")]  # fmt: skip


class _WModel(ctypes.Structure):
    _fields_ = [(n, _I64) for n in ("L", "D", "V", "max_len", "wfmt", "act_bf16", "head_fmt", "routing", "nthreads",
                                    "norm_fp32")] + [
        ("eps", ctypes.c_float), ("embed_scale", ctypes.c_float),
    ] + [(n, _P) for n in ("embed", "final_norm", "head", "head_s", "layers", "stat_skipped",
                           "stat_decisions")]  # fmt: skip


def _source() -> Path:
    from wide_cli.resources import shipped_dir

    return shipped_dir("kernels") / SOURCE_NAME


def cpu_flags() -> str:
    """This CPU's feature flags (the ``flags`` line of /proc/cpuinfo; elsewhere the processor name)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def cpu_model() -> str | None:
    """The CPU's model name (``/proc/cpuinfo``; None elsewhere): speed numbers differ between
    machines of the same kind, so every bench report names its CPU."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def fast_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX): PyTorch's bf16 GEMMs are
    fast there and run a slow path elsewhere (on an AVX2 EPYC, 1 thread: about 7 against 55
    GFLOP/s for fp32; a bf16 training step 20-40x slower than fp32)."""
    flags = cpu_flags().split()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _cache_root() -> Path:
    return Path(os.environ.get("WIDE_CACHE") or "~/.cache/wide").expanduser() / "native"


COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
# Without -march=native: the portable C paths only (no AVX-512), for tests of those paths.
PORTABLE_FLAGS = ("-O2", "-shared", "-fPIC", "-std=gnu11")


def build(force: bool = False, *, portable: bool = False) -> Path:
    """Compile ``kernels/cpu_decode.c`` (once per source, compiler, flags and CPU) and return the
    library path. ``portable``: without ``-march=native`` (the fallback C paths).

    Raises:
        RuntimeError: no C compiler, or the compile failed (its output in the message).
    """
    src = _source()
    if not src.is_file():
        raise RuntimeError(f"{src} is missing (a broken install)")
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler {cc!r} on PATH")
    try:
        version = subprocess.run([cc, "--version"], check=False, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"{cc} --version failed: {e}") from e
    flags = PORTABLE_FLAGS if portable else COMPILE_FLAGS
    texts = [src.read_text()] + [(src.parent / name).read_text() for name in INCLUDED_SOURCES]
    key = hashlib.sha256(
        b"\0".join(x.encode() for x in (*texts, cc, version, " ".join(flags), cpu_flags()))
    ).hexdigest()[:16]
    out = _cache_root() / key / "libwide_cpu_decode.so"
    if out.is_file() and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cc, *flags, "-o", tmp, str(src), "-lm", "-lpthread"]
    try:
        r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr.strip()}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


_LIB: ctypes.CDLL | None = None
_LIB_ERROR: str | None = None


def _check_layout(lib: ctypes.CDLL) -> None:
    """Raise RuntimeError unless ``_WLayer`` / ``_WModel`` have the C structs' sizes and field
    offsets (``wide_decode_layout``): a mismatch would hand the step wrong pointers."""
    want = [ctypes.sizeof(_WLayer), ctypes.sizeof(_WModel)]
    for st in (_WLayer, _WModel):
        want += [getattr(st, name).offset for name, _ in st._fields_]
    buf = (_I64 * (len(want) + 8))()
    if not hasattr(lib, "wide_decode_layout"):
        raise RuntimeError("native library without wide_decode_layout (built from another source)")
    lib.wide_decode_layout.restype = _I64
    lib.wide_decode_layout.argtypes = [_P, _I64]
    n = lib.wide_decode_layout(buf, len(buf))
    got = list(buf[: min(n, len(buf))])
    if got != want:
        raise RuntimeError(f"native library struct layout {got[:2]}... differs from the Python mirror {want[:2]}...")


def load(path: Path) -> ctypes.CDLL:
    """Load a built library and declare its functions.

    Raises:
        RuntimeError: its ABI or struct layout is not this module's. OSError: not loadable.
    """
    lib = ctypes.CDLL(str(path))
    lib.wide_decode_abi.restype = _I64
    if lib.wide_decode_abi() != ABI:
        raise RuntimeError(f"native library ABI {lib.wide_decode_abi()} != {ABI}")
    _check_layout(lib)
    lib.wide_decode_scratch_floats.restype = _I64
    lib.wide_decode_scratch_floats.argtypes = [ctypes.POINTER(_WModel), _I64]
    lib.wide_ffn_rows.restype = _I64
    lib.wide_ffn_rows.argtypes = [_P, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _P, _P, _P, _P,
                                  _I64, _P, _P, _P, _P, _P]  # fmt: skip
    lib.wide_out_rows.restype = _I64
    lib.wide_out_rows.argtypes = [_P, _I64, _I64, _I64, _I64, _P, _P, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _I64, _P,
                                  _P, _P, _P]  # fmt: skip
    lib.wide_route_rows.restype = _I64
    lib.wide_route_rows.argtypes = [_P, _P, _I64, _P, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _P]
    lib.wide_decode_batch.restype = _I64
    lib.wide_decode_batch.argtypes = [_P, ctypes.POINTER(_WModel), _I64, _P, _P, _I64, _P, _P, _P, _P]
    lib.wide_gemm.restype = _I64
    lib.wide_gemm.argtypes = [_P, _I64, _I64, _I64, _P, _I64, _I64, _I64, _P, _I64, _P, _I64, _P, _I64, _P, _I64, _I64]
    lib.wide_ctx_new.restype = _P
    lib.wide_ctx_free.argtypes = [_P]
    lib.wide_gemm_simd.restype = _I64
    lib.wide_amx_ready.restype = _I64
    lib.wide_vdp_ready.restype = _I64
    lib.wide_f32_ready.restype = _I64
    lib.wide_gather_proj.restype = _I64
    lib.wide_gather_proj.argtypes = [_P, _I64, _P, _I64, _I64, _I64, _I64, _P, _I64, _I64, _P, _I64, _P, _I64, _I64, _P,
                                  _I64, _I64]  # fmt: skip
    lib.wide_rms_norm_rows.restype = _I64
    lib.wide_rms_norm_rows.argtypes = [_P, _P, _I64, _I64, _I64, _P, _I64, ctypes.c_float, _P, _I64, _I64]
    lib.wide_router_rows.restype = _I64
    lib.wide_router_rows.argtypes = [_P, _P, _I64, _I64, _I64, _I64, _P, _P, _I64, _P, _I64]
    lib.wide_rope_rows.restype = _I64
    lib.wide_rope_rows.argtypes = [_P, _P, _I64, _I64, _I64, _I64, _P, _P, _I64]
    lib.wide_residual_rows.restype = _I64
    lib.wide_residual_rows.argtypes = [_P, _P, _I64, _P, _P, _I64, _I64, _I64, _P, _I64, _I64, _P, _I64]
    lib.wide_gather_attention.restype = _I64
    lib.wide_gather_attention.argtypes = [_P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _P, _P, _I64, _I64, _I64, _I64,
                                       _I64, _I64, _P, ctypes.c_float, _P, _P, _P, _I64, _I64]  # fmt: skip
    lib.wide_gather_ffn.restype = _I64
    lib.wide_gather_ffn.argtypes = [_P, _P, _P, _I64, _I64, _I64, _P, _I64, _I64, _P, _I64, _I64, _P, _P, _I64, _I64]
    return lib


def context(lib: ctypes.CDLL) -> int:
    """The native context of ``lib`` in this process (``WCtx``: its thread pool and buffers; the C
    code keeps no other mutable state), created on first use and kept for the process's life.

    Raises:
        MemoryError: the context could not be allocated.
    """
    ctx = getattr(lib, "_wide_ctx", None)
    if ctx is None:
        ctx = lib.wide_ctx_new()
        if not ctx:
            raise MemoryError("wide_ctx_new failed")
        lib._wide_ctx = ctx
    return ctx


def library() -> ctypes.CDLL | None:
    """The loaded native library, or None (disabled by ``WIDE_CPU_NATIVE=0`` or not buildable;
    the reason is logged once and kept in ``unavailable_reason()``)."""
    global _LIB, _LIB_ERROR
    if os.environ.get("WIDE_CPU_NATIVE", "1") == "0":
        return None
    if _LIB is not None or _LIB_ERROR is not None:
        return _LIB
    try:
        _LIB = load(build())
    except (RuntimeError, OSError) as e:
        _LIB_ERROR = str(e)
        log.warning("native cpu decode unavailable, using the PyTorch path: %s", str(e).splitlines()[0])
    return _LIB


def unavailable_reason() -> str | None:
    """Why ``library()`` is None (None when it loaded or was not tried)."""
    if os.environ.get("WIDE_CPU_NATIVE", "1") == "0":
        return "WIDE_CPU_NATIVE=0"
    return _LIB_ERROR


_GEMM_FMT = {torch.float32: 0, torch.bfloat16: 1}


def gemm_library() -> ctypes.CDLL | None:
    """The native library when its prefill GEMM runs vector code on this CPU (AVX-512), else None:
    the portable twin is slower than PyTorch's GEMMs and only exists for the tests."""
    lib = library()
    return lib if lib is not None and lib.wide_gemm_simd() else None


def gemm(a: torch.Tensor, w: torch.Tensor, layout: str, out: torch.Tensor, *, arows: torch.Tensor | None = None,
         orows: torch.Tensor | None = None, accumulate: bool = False, lib: ctypes.CDLL | None = None) -> bool:
    """``out[orows] (+)= a[arows] @ W^T`` with the native prefill GEMM (``wide_gemm`` in
    ``kernels/cpu_decode.c``), on the runtime's thread count.

    Args:
        a: ``[*, K]`` activations, fp32 or bf16 (``w``'s dtype), unit stride along K.
        w: ``[N, K]`` (``layout="rows"``) or ``[K, N]`` (``layout="w_t"``), unit inner stride.
        out: ``[*, N]`` fp32 or bf16 (bf16 rounded to nearest even), unit inner stride.
        arows / orows: integer ``[M]`` rows of ``a`` to read / of ``out`` to write (None: all
            ``a``'s rows, in order); ``orows`` distinct.
        lib: the library to use (default ``gemm_library()``).
    Returns:
        False (nothing written) when the native GEMM cannot take these operands (no library with
        vector code, another dtype, strides, an odd K in bf16): the caller runs its PyTorch GEMM.
    """
    lib = lib or gemm_library()
    fmt = _GEMM_FMT.get(w.dtype)
    if lib is None or fmt is None or a.dtype != w.dtype or out.dtype not in _GEMM_FMT:
        return False
    if a.stride(-1) != 1 or w.stride(-1) != 1 or out.stride(-1) != 1 or a.dim() != 2 or out.dim() != 2:
        return False
    N, K = (w.shape if layout == "rows" else w.shape[::-1])
    if a.shape[1] != K or out.shape[1] != N:
        raise ValueError(f"gemm shapes: a {tuple(a.shape)}, w {tuple(w.shape)} ({layout}), out {tuple(out.shape)}")
    M = arows.numel() if arows is not None else a.shape[0]
    if orows is None and out.shape[0] != M:
        raise ValueError(f"gemm: {M} rows into out {tuple(out.shape)} without orows")
    arows, orows = (None if r is None else r.to(torch.int64).contiguous() for r in (arows, orows))
    if M == 0:
        return True
    rc = lib.wide_gemm(context(lib), fmt, _GEMM_FMT[out.dtype], 0 if layout == "rows" else 1, w.data_ptr(), w.stride(0), N, K,
                       a.data_ptr(), a.stride(0), _ptr(arows), M, out.data_ptr(), out.stride(0), _ptr(orows),
                       int(accumulate), torch.get_num_threads())
    return rc == 0


def _proj_fmt(p) -> int | None:
    """The C format code of a ``cpu_proj.Proj`` (None: a dtype the library does not run)."""
    return QUANT_CODE[p.fmt] if p.quantized else FMT_CODE.get(p.dtype)


def _proj_ptrs(p) -> tuple[int, int | None]:
    """Weight and scale pointers of a ``Proj`` in the layouts the C step reads."""
    if p.quantized:
        return p.q.data_ptr(), p.s.data_ptr()
    return (p.w if p.axis == "n" else p.w_t).data_ptr(), None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class NativeDecoder:
    """The native decode step of one ``Runtime`` on the cpu backend (1 to ``MAX_BATCH`` rows).

    Holds fp32 copies of the small per-layer vectors (norms, biases) and pointers to the backend's
    weights (``_CpuLayer`` / ``Proj``), the engine's routers, stand-ins and keep masks, and the
    sparsity statistics (the C step adds its decisions to them directly).

    Raises:
        ValueError: ``ineligible(rt)`` names a reason (ask it first).
    """

    def __init__(self, rt, lib: ctypes.CDLL):
        why = self.ineligible(rt)
        if why:
            raise ValueError(why)
        self.lib, self.rt = lib, rt
        self._keep: list = []  # tensors whose pointers the C structs hold
        f32 = self._f32
        L = rt.num_layers
        self.layers = (_WLayer * L)()
        for i, (m, p) in enumerate(zip(rt.meta, rt.layers)):
            w = self.layers[i]
            w.H, w.Hkv, w.d, w.ag = m.num_heads, m.num_kv_heads, m.head_dim, m.attn_group_size
            w.GA, w.fg, w.GF, w.window = m.attn_groups, m.ffn_group_size, m.ffn_groups, m.window or 0
            for name, proj in (("qkv", p.qkv), ("o", p.o), ("gu", p.gu), ("down", p.down)):
                wt, s = _proj_ptrs(proj)
                setattr(w, name, wt)
                setattr(w, name + "_s", s)
            if p.o.fmt == "bf16":
                # bf16 O / down as per-group blocks [G, D, g]: a block is a dot product over its g
                # channels (AVX512-BF16 pairs along the reduction) instead of the w_t axpy form
                # (routed bf16 decode 92 -> 111 tokens/s); a copy of these two projections (~1/3 of
                # a layer's weights) for this step.
                w.blocked = 1
                w.o, w.down = self._blocked(p.o), self._blocked(p.down)
            w.bqkv, w.bo = f32(p.bqkv), f32(p.bo)
            w.ln_attn, w.ln_ffn, w.q_norm, w.k_norm = f32(m.ln_attn), f32(m.ln_ffn), f32(m.q_norm), f32(m.k_norm)
            w.ln_attn_out, w.ln_ffn_out = f32(m.ln_attn_out), f32(m.ln_ffn_out)
            inv, w.rope_scale = rt.ropes[m.rope]
            w.inv_freq, w.attn_scale, w.gelu = f32(inv), m.attn_scale, int(p.act == "gelu_tanh")
            ra, rf = m.routers["attention"], m.routers["ffn"]
            w.ra_w, w.ra_b = (f32(ra[0]), f32(ra[1])) if ra is not None else (None, None)
            w.rf_w, w.rf_b = (f32(rf[0]), f32(rf[1])) if rf is not None else (None, None)
            w.sa, w.sf = f32(m.standins["attention"]), f32(m.standins["ffn"])
            for mod, pre in (("attention", "sa"), ("ffn", "sf")):
                maps = m.standin_maps[mod]
                if maps is not None:
                    setattr(w, pre + "_in", f32(maps[0]))
                    setattr(w, pre + "_out", f32(maps[1]))
                    setattr(w, pre + "_r", maps[0].shape[1])
            w.keep_a, w.keep_f = self._u8(m.keeps["attention"]), self._u8(m.keeps["ffn"])
        mdl = self.model = _WModel()
        mdl.L, mdl.D, mdl.V = L, rt.hidden_size, rt.vocab_size
        mdl.wfmt = _proj_fmt(rt.layers[0].qkv)
        mdl.act_bf16 = int(rt.dtype == torch.bfloat16)
        mdl.eps = float(rt.eps)
        mdl.embed_scale = 1.0 if rt.embed_scale is None else float(rt.embed_scale)
        mdl.norm_fp32 = int(rt.norm_fp32)
        mdl.final_norm = f32(rt.final_norm)
        mdl.embed = _ptr(rt.embed)
        mdl.head, mdl.head_s = _proj_ptrs(rt.head)
        mdl.head_fmt = _proj_fmt(rt.head)
        mdl.layers = ctypes.cast(self.layers, _P)
        mdl.stat_skipped, mdl.stat_decisions = _ptr(rt.stats.skipped), _ptr(rt.stats.decisions)
        self._cache_id = None
        self._scratch = None
        self.counts = torch.zeros(len(COUNTERS), dtype=torch.int64)

    @staticmethod
    def ineligible(rt) -> str | None:
        """Why ``rt`` cannot use the native step (None when it can): among others an export
        feature the step does not run (``wide_cli.features``, row ``native``)."""
        from wide_cli.features import unsupported

        bad = unsupported(getattr(rt, "export_features", None) or (), "native")
        if bad:
            return f"the export uses {bad[0]}, which the native step does not run"
        be = rt.backend
        if getattr(be, "name", None) != "cpu" or rt.device.type != "cpu":
            return "not the cpu backend"
        if rt.dtype not in (torch.float32, torch.bfloat16):
            return f"compute dtype {rt.dtype}"
        if rt.head is None:
            return "no LM head in the backend's format"
        d = {m.head_dim for m in rt.meta}
        if len(d) > 1 or any(2 * rt.ropes[m.rope][0].numel() != m.head_dim for m in rt.meta):
            return "head dims differ between layers"
        if any(p.act not in ("silu", "gelu_tanh") for p in rt.layers):
            return "an FFN activation the step does not run"
        for m in rt.meta:
            if max(m.attn_groups, m.ffn_groups, m.num_heads) > 4096 or m.attn_group_size * m.head_dim > 4096:
                return "more than 4096 groups or heads in a layer"
        if rt.stats.skipped.dtype != torch.float64 or not rt.stats.skipped.is_contiguous():
            return "sparsity statistics layout"
        return None

    def _held(self, t: torch.Tensor | None, dtype: torch.dtype) -> int | None:
        """Pointer to a contiguous CPU copy of ``t`` in ``dtype``, kept alive with this object."""
        if t is None:
            return None
        t = t.detach().to("cpu", dtype).contiguous()
        self._keep.append(t)
        return t.data_ptr()

    def _f32(self, t: torch.Tensor | None) -> int | None:
        return self._held(t, torch.float32)

    def _u8(self, t: torch.Tensor | None) -> int | None:
        return self._held(t, torch.uint8)

    def _blocked(self, p) -> int:
        """A float axis-k ``Proj`` (``w_t [K, N]``) as ``[K / g, N, g]`` blocks; returns the pointer."""
        K, N = p.w_t.shape
        b = p.w_t.view(K // p.g, p.g, N).transpose(1, 2).contiguous()
        self._keep.append(b)
        return b.data_ptr()

    def _bind(self, cache) -> None:
        for i, w in enumerate(self.layers):
            w.k_cache, w.v_cache = cache.k[i].data_ptr(), cache.v[i].data_ptr()
        self.model.max_len = cache.max_len
        n = self.lib.wide_decode_scratch_floats(ctypes.byref(self.model), cache.batch)
        if self._scratch is None or self._scratch.numel() < n:
            self._scratch = torch.empty(n, dtype=torch.float32)
        self._cache_id = id(cache)
        self._cache_ref = cache

    def usable(self, cache) -> bool:
        """Whether this step can run on ``cache``: 1 to ``MAX_BATCH`` rows in the runtime's dtype
        (padding slots are fine)."""
        return (
            1 <= cache.batch <= MAX_BATCH and cache.k[0].dtype == self.rt.dtype
            and all(k.is_contiguous() and v.is_contiguous() for k, v in zip(cache.k, cache.v))
            and cache.key_valid.is_contiguous()
        )  # fmt: skip

    def _force(self, slot: int, batch: int) -> list:
        """Point the layers' keep masks at the forced decisions of ``slot`` (``Runtime.forced``:
        ``[G]`` for every token, or ``[B, S_max, G]`` by row and slot, ``B`` 1 or the batch; they
        win over routers as in the engine). Returns what to restore."""
        rows, plan = [], []  # every mask built before any pointer changes
        for i, w in enumerate(self.layers):
            for mod, attr in (("attention", "keep_a"), ("ffn", "keep_f")):
                f = self.rt.forced.get((i, mod))
                if f is None:
                    continue
                if f.dim() == 1:
                    row, stride = f.to("cpu", torch.uint8).contiguous(), 0
                else:
                    row = f[:, slot].expand(batch, f.shape[-1]).to("cpu", torch.uint8).contiguous()
                    stride = row.shape[1]
                rows.append(row)
                plan.append((w, attr, row.data_ptr(), stride))
        saved = [(w, w.keep_a, w.keep_f, w.keep_a_stride, w.keep_f_stride) for w in self.layers]
        for w, attr, ptr, stride in plan:
            setattr(w, attr, ptr)
            setattr(w, attr + "_stride", stride)
        self._forced_rows = rows  # alive until the next step
        return saved

    def step(self, tokens: list[int], cache, valid: torch.Tensor | None = None) -> torch.Tensor:
        """Run one new token per row of ``cache`` (``tokens[b]`` for row b) through every layer into
        the cache's next slot; returns fp32 logits ``[B, V]``. ``valid [B, 1]`` bool, False for rows whose
        token is padding (finished rows riding along: they compute nothing and get zero logits;
        their slot stays masked). Adds executed multiply-adds and the weight bytes read to the runtime's
        ``Counter`` and decisions to its sparsity statistics.

        Raises:
            ValueError: a token id outside the vocabulary, a full cache, or a batch that does not
                match the cache.
        """
        B = len(tokens)
        if B != cache.batch:
            raise ValueError(f"{B} tokens for a cache of {cache.batch} rows")
        for t in tokens:
            if not 0 <= t < self.model.V:
                raise ValueError(f"token id {t} outside the vocabulary [0, {self.model.V})")
        if self._cache_id != id(cache):
            self._bind(cache)
        if B == 1 and (valid is None or bool(valid.all())):
            slot, p = cache.append_one()
            pos = torch.tensor([p], dtype=torch.int64)
        else:
            ok = torch.ones(B, 1, dtype=torch.bool) if valid is None else valid.to("cpu", torch.bool).reshape(B, 1)
            slot, positions = cache.append_slots(ok)
            pos = positions[:, 0].contiguous()
        tok = torch.tensor(tokens, dtype=torch.int64)
        kvalid = None if cache.all_valid else cache.key_valid.data_ptr()
        self.model.nthreads = torch.get_num_threads()
        self.model.routing = int(self.rt.routing)
        logits = torch.empty(B, self.model.V, dtype=torch.float32)
        c = self.counts
        c.zero_()
        saved = self._force(slot, B) if self.rt.forced else None
        try:
            rc = self.lib.wide_decode_batch(context(self.lib), ctypes.byref(self.model), B, tok.data_ptr(),
                                            pos.data_ptr(), slot, kvalid, logits.data_ptr(), c.data_ptr(),
                                            self._scratch.data_ptr())  # fmt: skip
        finally:
            if saved is not None:
                for w, ka, kf, sa, sf in saved:
                    w.keep_a, w.keep_f, w.keep_a_stride, w.keep_f_stride = ka, kf, sa, sf
        if rc != 0:
            raise ValueError(f"native decode step refused tokens {tokens} at slot {slot}")
        ctr = self.rt.counter
        for name, v in zip(COUNTERS, c.tolist(), strict=True):
            setattr(ctr, name, getattr(ctr, name) + v)
        return logits


if __name__ == "__main__":  # `make native`: build (or find) the library, print its path
    import sys

    try:
        print(build())
    except RuntimeError as e:
        print(f"error: the native cpu decode step does not build: {e}", file=sys.stderr)
        sys.exit(1)
