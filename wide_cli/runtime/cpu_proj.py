"""Projections of the cpu backend: weights laid out by routed group in a weight format
(``Proj``), and the work-skipping GEMMs and SwiGLU FFN over them (``runtime/cpu.py`` describes
the layout and the strategy).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from wide_cli.runtime import cpu_gather, cpu_native, ops
from wide_cli.runtime.backend import Counter
from wide_cli.runtime.cpu_plan import SMALL_M, gather_pays, group_counts, mask_state, skip_plan


def _native_gemm_dtypes() -> frozenset:
    """Compute dtypes whose projections run on the native GEMM (``cpu_native.gemm``) instead of
    PyTorch's, wherever the native decode step does not run them (prefill, batches of more than
    64 rows, byte tracing). ``WIDE_CPU_GEMM=native`` / ``torch`` forces the choice for bf16 (benchmarks).

    bf16 on CPUs without AVX512-BF16 (or AMX): there the PyTorch CPU build runs bf16 GEMMs on a
    slow path (~9 GFLOP/s against the kernel's ~80 at 1024 x 3072 x 576, and a 16-row call in
    19 ms against 3; AVX2 + FMA EPYC, 1 thread). With AVX512-BF16, PyTorch's oneDNN bf16 GEMMs ran
    prefill 2.3x faster than its fp32 ones (SmolLM2-135M, 1,024 tokens): they stay. fp32 stays on
    PyTorch everywhere: its GEMMs ran as fast as the kernel's dense and faster on a routed FFN's
    per-group calls (the kernel packs each weight panel per call; PyTorch's prepacked path does not).
    """
    choice = os.environ.get("WIDE_CPU_GEMM", "auto")
    if choice == "torch":
        return frozenset()
    if choice == "native":
        return frozenset({torch.bfloat16})
    return frozenset() if cpu_native.fast_bf16() else frozenset({torch.bfloat16})


@functools.cache
def _native_dtypes() -> frozenset:
    """``_native_gemm_dtypes()``, read once per process."""
    return _native_gemm_dtypes()


def prefill_path(dtype: torch.dtype, routed: bool = False) -> str:
    """Which code runs the cpu backend's prefill projections in compute dtype ``dtype`` (of a
    routed model when ``routed``): ``native`` (``cpu_native.gemm``, or the gather kernels of
    ``cpu_gather`` in bf16: for the routed modules, and on AVX512-BF16 without AMX for the dense
    FFN too) or ``torch``."""
    if dtype == torch.bfloat16 and (cpu_gather.isa() == cpu_gather.ISA_VDP or (routed and cpu_gather.ready())):
        return "native"
    if dtype == torch.float32 and cpu_gather.f32_ready():  # the dense FFN and routed projections
        return "native"
    return "native" if dtype in _native_dtypes() and cpu_native.gemm_library() is not None else "torch"


def i8_layout(q: torch.Tensor) -> torch.Tensor:
    """int8 rows ``[..., K]`` (K a multiple of 32) in the native step's byte order (``I8_LAYOUT``
    in ``kernels/cpu_decode.c``): per chunk of 64 bytes, 4-byte groups alternating between its two
    blocks of 32, so that the VNNI dot product's int32 lanes alternate between the blocks; a
    trailing half chunk stays in natural order. Returns a contiguous tensor."""
    K = q.shape[-1]
    k64 = K // 64 * 64
    lead = q.shape[:-1]
    body = q[..., :k64].reshape(*lead, k64 // 64, 2, 8, 4).transpose(-3, -2).reshape(*lead, k64)
    return torch.cat([body, q[..., k64:]], -1).contiguous()


def _with_slack(t: torch.Tensor, slack: int = 8) -> torch.Tensor:
    """A contiguous copy of ``t`` followed in memory by ``slack`` zeros: the native int8 / int4
    kernels read a row's scales 8 at a time, so the last row's read may reach past the tensor."""
    buf = torch.zeros(t.numel() + slack, dtype=t.dtype, device=t.device)
    buf[: t.numel()] = t.reshape(-1)
    return buf[: t.numel()].view(t.shape)


def _span(t: torch.Tensor) -> tuple[int, int]:
    """``(first byte address, nbytes)`` of a contiguous block."""
    return t.data_ptr(), t.numel() * t.element_size()


class Proj:
    """One projection ``y = x @ W^T`` (``W [N, K]``, HF layout) stored so that a block of routed
    groups is one contiguous read, in a weight format (``runtime/quant.py``).

    axis ``n`` (QKV, gate/up): blocks are row ranges ``[r0, r1)``. float: ``w [N, K]``.
    axis ``k`` (O, down): blocks are reduction groups ``[j0, j1)`` of ``g`` channels. float:
    ``w_t [K, N]`` (a group's channels are contiguous rows).
    int8 / int4 (``quantized``): the blocks the native decode step reads, axis ``n``: ``q [N, K]``
    int8 (bytes in ``i8_layout``) or ``[N, K / 2]`` packed int4 (``wide_cli/quant.py``'s nibble
    order), scales ``s [N, K / 32]`` (fp32 for int8, bf16 for int4); axis ``k``: ``q [G, N, g]``
    (int4 ``[G, N, g / 2]``), ``s [G, N, g / 32]`` (a skipped group reads neither), plus, for the
    PyTorch path here, ``w`` / ``w_t`` in bf16 holding the same dequantized values
    (``runtime/quant.py`` says why).

    Every call adds its multiply-adds to ``counter.macs`` (and its weight spans to
    ``counter.trace`` when tracing). Views of blocks are cached (at most G (G + 1) / 2 per
    projection), so the decode hot path slices nothing.
    """

    def __init__(self, w: torch.Tensor, axis: str, fmt: str, dtype: torch.dtype, device, counter: Counter,
                 g: int | None = None, what: str = "projection"):
        from wide_cli.quant import INT8_BLOCK, dequantize, quantize
        from wide_cli.runtime.quant import QUANTIZED_FORMATS, check_quant_width

        self.axis, self.fmt, self.counter = axis, fmt, counter
        self.quantized = fmt in QUANTIZED_FORMATS
        self.N, self.K = w.shape
        self.g = g
        self.dtype = dtype
        self._v: dict = {}
        self._packed = None  # the tile-packed copy (cpu_gather), made on first use; False: none
        if self.quantized:
            check_quant_width(self.K if axis == "n" else g, what, fmt)
            q, s = quantize(w, fmt)  # int8 [N, K] or int4 packed uint8 [N, K / 2]; [N, K / 32]
            w = dequantize(q, s)  # the values the PyTorch path multiplies (bf16 copy below)
            # int4 scales are bf16-representable: the step reads them as bf16 (as Q4_0 its fp16)
            s = s.to(torch.bfloat16) if fmt == "int4" else s
            lay = i8_layout if fmt == "int8" else (lambda t: t.contiguous())
            if axis == "n":
                self.q, self.s = lay(q).to(device), s.to(device).contiguous()
            else:
                G = self.K // g
                per = q.shape[1] // G  # a group's bytes per row
                self.q = lay(q.view(self.N, G, per).permute(1, 0, 2)).to(device)  # [G, N, per]
                self.s = s.view(self.N, G, g // INT8_BLOCK).permute(1, 0, 2).to(device).contiguous()
            self.s = _with_slack(self.s)  # the AVX2 kernels read a row's scales 8 at a time
        if axis == "n":
            self.w = w.to(device=device, dtype=dtype).contiguous()
        else:
            self.w_t = w.to(device=device, dtype=dtype).t().contiguous()

    @property
    def acc_dtype(self) -> torch.dtype:
        """Accumulator of ``acc`` (the compute dtype)."""
        return self.dtype

    def nbytes(self) -> int:
        """Bytes of the weights a decode step reads in this format (the quantized blocks and their
        scales for int8 / int4, not the PyTorch path's bf16 copy)."""
        ts = (self.q, self.s) if self.quantized else (self.w if self.axis == "n" else self.w_t,)
        return sum(t.numel() * t.element_size() for t in ts)

    def packed(self) -> torch.Tensor | None:
        """The weights packed for the gather prefill kernels in the compute dtype
        (``cpu_gather.pack_rows`` for axis ``n``, ``cpu_gather.pack_groups`` for axis ``k``),
        packed on the first call of a process that can run them (a copy beside the projection's
        weights: the PyTorch path and the decode step keep reading those); None where they do not
        run (``cpu_gather.runs``), or for a width off the tile multiples (16 rows, 32 reduction
        channels)."""
        if self._packed is None:
            self._packed = False
            if cpu_gather.runs(self.dtype):
                try:
                    self._packed = (cpu_gather.pack_rows(self.w, self.dtype) if self.axis == "n"
                                    else cpu_gather.pack_groups(self.w_t, self.g, self.dtype))  # fmt: skip
                except ValueError:
                    pass
        return self._packed if self._packed is not False else None

    def count_routed(self, mask: torch.Tensor, group_elems: int) -> None:
        """Count a routed call of the AMX kernels: the multiply-adds of the executed pairs of
        ``mask [M, G]`` (``group_elems`` weights per group) and the bytes of the groups some token
        executes (in the compute dtype, as the PyTorch path counts its slices)."""
        counts = group_counts(mask)
        self.counter.macs += sum(counts) * group_elems
        self.counter.weight_bytes += sum(1 for n in counts if n) * group_elems * self.dtype.itemsize

    def rows(self, x: torch.Tensor, r0: int, r1: int, idx: torch.Tensor | None = None) -> torch.Tensor:
        """``x [M, K] -> [M, r1 - r0]``: output rows ``[r0, r1)`` (axis ``n``); with ``idx``
        (int64 ``[n]``) of the tokens ``x[idx]`` only, ``-> [n, r1 - r0]``."""
        v = self._v.get((r0, r1))
        if v is None:
            v = self._v[(r0, r1)] = (self.w[r0:r1],)
        M = x.shape[0] if idx is None else idx.numel()
        self.counter.macs += M * (r1 - r0) * self.K
        self.counter.weight_bytes += v[0].numel() * v[0].element_size()
        if self.counter.trace is not None:
            self.counter.trace.extend(_span(t) for t in v)
        if self.dtype in _native_dtypes():
            out = torch.empty(M, r1 - r0, dtype=x.dtype)
            if cpu_native.gemm(x, v[0], "rows", out, arows=idx):
                return out
        return F.linear(x if idx is None else x.index_select(0, idx), v[0])

    def acc(self, out: torch.Tensor, a: torch.Tensor, j0: int, j1: int, idx: torch.Tensor | None = None) -> None:
        """``out [M, N] += a [M, (j1 - j0) g] @ W[:, j0 g : j1 g]^T`` (axis ``k``); ``a`` holds
        the activations of groups ``[j0, j1)`` only; ``out`` has ``acc_dtype``. With ``idx``
        (int64 ``[n]``, distinct): ``a`` is ``[n, (j1 - j0) g]`` and its rows add to ``out[idx]``."""
        g = self.g
        M = a.shape[0]
        self.counter.macs += M * (j1 - j0) * g * self.N
        tr = self.counter.trace
        w = self._v.get((j0, j1))
        if w is None:
            w = self._v[(j0, j1)] = self.w_t[j0 * g : j1 * g]
        self.counter.weight_bytes += w.numel() * w.element_size()
        if tr is not None:
            tr.append(_span(w))
        if self.dtype in _native_dtypes() and cpu_native.gemm(a, w, "w_t", out, orows=idx, accumulate=True):
            return
        if idx is None:
            out.addmm_(a, w)
        else:
            out.index_add_(0, idx, a @ w)


def zero_skipped(t: torch.Tensor, mask: torch.Tensor, g: int) -> torch.Tensor:
    """Zero, in place, the skipped (token, group) blocks of ``t [M, G * g]`` (``mask [M, G]`` bool;
    ``t`` may be a column slice of a wider tensor;
    a skipped block times 0, as the reference's mask product); returns ``t``. The bool mask
    broadcasts over each group's ``g`` columns: expanding it to ``[M, G * g]`` in ``t``'s dtype
    first took 1.9 ms against 0.26 ms for bf16 ``[1024, 1536]`` (1 thread)."""
    t.unflatten(1, (-1, g)).mul_(mask[:, :, None])
    return t


def _gather_routed(p: Proj, a: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether a routed prefill call on ``p`` runs on the AMX kernels (``cpu_gather``): bf16
    activations, no byte tracing (the kernels do not report spans), a packed copy of ``p``, and a
    mask sparse enough to gain from gathering (``cpu_plan.gather_pays``)."""
    return (a.dtype == p.dtype and p.counter.trace is None and p.packed() is not None
            and gather_pays(mask, a.dtype == torch.bfloat16 and cpu_gather.isa() == cpu_gather.ISA_AMX))  # fmt: skip


def _vdp_dense(p: Proj, a: torch.Tensor) -> bool:
    """Whether a dense FFN call on ``p`` runs on the gather kernels: on AVX512-BF16 without AMX,
    where the fused FFN kernel ran 1.08-1.26x PyTorch's dense bf16 GEMMs and 1.21-1.37x its fp32
    ones (``cpu_plan``'s and ``cpu_gather.f32_ready``'s measurements; on AMX, oneDNN stays)."""
    return (a.dtype == p.dtype and p.counter.trace is None and cpu_gather.isa() == cpu_gather.ISA_VDP
            and p.packed() is not None)  # fmt: skip


def gather_rows(p: Proj, a: torch.Tensor, mask: torch.Tensor, g: int) -> bool:
    """Whether ``gemm_mn_proj(a [M, K], p, mask [M, G], g)`` runs on the AMX kernels."""
    return a.shape[0] > SMALL_M and g % cpu_gather.TILE_N == 0 and _gather_routed(p, a, mask)


def gemm_mn_proj(a: torch.Tensor, p: Proj, mask, group_size: int, bias=None, plan=None) -> torch.Tensor:
    """``ops.gemm_mn`` on the first ``G * group_size`` rows of an axis-``n`` projection."""
    state, runs, uniform = plan or skip_plan(mask)
    M = a.shape[0]
    g = group_size
    N = (mask.shape[1] if mask is not None else p.N // g) * g
    if state == "dense":
        out = p.rows(a, 0, N)
        return out if bias is None else out.add_(bias)
    out = torch.zeros(M, N, dtype=a.dtype, device=a.device)
    if state == "none":
        return out
    amx = gather_rows(p, a, mask, g)
    if amx and cpu_gather.rows(p.packed()[: N // cpu_gather.TILE_N], a, out, mask, g, bias):
        p.count_routed(mask, g * p.K)
        return out
    if runs == [(0, N // g)]:  # union is everything, or a dense enough prefill: dense GEMM, then mask
        out = p.rows(a, 0, N)
        if bias is not None:
            out.add_(bias)
        return zero_skipped(out, mask, g)
    if M <= SMALL_M:
        for s, e in runs:
            y = p.rows(a, s * g, e * g)
            out[:, s * g : e * g] = y if bias is None else y.add_(bias[s * g : e * g])
        if not uniform:
            zero_skipped(out, mask, g)
        return out
    order, counts = ops.group_token_lists(mask)
    for j, n in enumerate(counts.tolist()):
        if n == 0:
            continue
        bj = None if bias is None else bias[j * g : (j + 1) * g]
        if n == M:
            y = p.rows(a, j * g, (j + 1) * g)
            out[:, j * g : (j + 1) * g] = y if bj is None else y.add_(bj)
        else:
            idx = order[j, :n]
            y = p.rows(a, j * g, (j + 1) * g, idx)
            out[:, j * g : (j + 1) * g].index_copy_(0, idx, y if bj is None else y.add_(bj))
    return out


def gemm_k_proj(a: torch.Tensor, p: Proj, mask, bias=None, plan=None) -> torch.Tensor:
    """``ops.gemm_k`` on an axis-``k`` projection (groups of ``p.g`` reduction channels)."""
    state, runs, uniform = plan or skip_plan(mask)
    M, g, G = a.shape[0], p.g, p.K // p.g
    out = torch.zeros(M, p.N, dtype=p.acc_dtype, device=a.device)
    if bias is not None:
        out.add_(bias)
    if state == "none":
        return out.to(a.dtype)
    if state == "sparse" and M > SMALL_M and _gather_routed(p, a, mask):
        out = out if out.dtype == torch.float32 else out.float()
        if cpu_gather.acc(p.packed(), a, out, mask):
            p.count_routed(mask, g * p.N)
            return out.to(a.dtype)
    if state == "dense":
        p.acc(out, a, 0, G)
    elif M <= SMALL_M or runs == [(0, G)]:
        if not uniform:
            a = (a.reshape(M, -1, g) * mask[:, :, None]).view(M, -1)
        if runs == [(0, G)]:  # union is everything (or a dense enough prefill): masked activations, then dense GEMM
            p.acc(out, a, 0, G)
        else:
            for s, e in runs:
                p.acc(out, a[:, s * g : e * g], s, e)
    else:
        order, counts = ops.group_token_lists(mask)
        for j, n in enumerate(counts.tolist()):
            if n == 0:
                continue
            aj = a[:, j * g : (j + 1) * g]
            if n == M:
                p.acc(out, aj, j, j + 1)
            else:
                idx = order[j, :n]
                p.acc(out, aj.index_select(0, idx), j, j + 1, idx)
    return out.to(a.dtype)


def _swiglu(gu: torch.Tensor, g: int, act: str = "silu") -> torch.Tensor:
    """``gu [..., 2g]`` (gate | up) -> ``act(gate) * up [..., g]`` (``ops.gate_act``)."""
    if act == "silu":
        return F.silu(gu[..., :g]) * gu[..., g:]
    return ops.gate_act(gu[..., :g], act) * gu[..., g:]


def ffn_proj(x: torch.Tensor, gu: Proj, down: Proj, mask, plan=None, act: str = "silu") -> torch.Tensor:
    """Routed gated FFN on the grouped layout (SwiGLU, or ``act`` gating: ``ops.gate_act``).

    Args:
        x: ``[M, D]``. gu: axis-``n`` projection ``[G * 2g, D]`` (per group its gate rows then its
            up rows). down: axis-``k`` projection ``[D, G * g]``. mask: ``[M, G]`` bool or None.
    Returns:
        ``[M, D]`` = ``gemm_k(gemm_mn_swiglu(x, ..., act), down, mask)``.
    """
    g = down.g
    G = down.K // g
    M = x.shape[0]
    state, runs, uniform = plan or skip_plan(mask)
    if state == "dense" and M > SMALL_M and _vdp_dense(gu, x) and _vdp_dense(down, x):
        y = torch.empty(M, down.N, dtype=torch.float32)
        macs = cpu_gather.ffn(gu.packed(), down.packed(), x, y, None, act)
        if macs is not None:
            gu.counter.macs += macs
            gu.counter.weight_bytes += G * 3 * g * down.N * x.dtype.itemsize
            return y.to(x.dtype)
    if state == "sparse" and M > SMALL_M and _gather_routed(gu, x, mask) and _gather_routed(down, x, mask):
        y = torch.empty(M, down.N, dtype=torch.float32)
        macs = cpu_gather.ffn(gu.packed(), down.packed(), x, y, mask, act)
        if macs is not None:
            live = sum(1 for n in group_counts(mask) if n)
            gu.counter.macs += macs
            gu.counter.weight_bytes += live * 3 * g * down.N * x.dtype.itemsize
            return y.to(x.dtype)
    out = torch.zeros(M, down.N, dtype=down.acc_dtype, device=x.device)
    if state == "none":
        return out.to(x.dtype)
    if state == "dense" or runs == [(0, G)]:
        # Dense, or the union of the tokens' groups is everything (typical for a decode batch), or
        # a prefill executing most pairs (skip_plan): the dense GEMMs, with the skipped (token,
        # group) activations zeroed in between.
        h = _swiglu(gu.rows(x, 0, G * 2 * g).view(M, G, 2 * g), g, act)
        if state != "dense":
            h.mul_(mask[:, :, None])
        down.acc(out, h.reshape(M, G * g), 0, G)
        return out.to(x.dtype)
    if M <= SMALL_M:
        # Union runs: per run one gate/up GEMM, one SwiGLU over all of them, per run one down GEMM.
        parts = [gu.rows(x, s * 2 * g, e * 2 * g) for s, e in runs]
        nact = sum(e - s for s, e in runs)
        h = _swiglu((parts[0] if len(parts) == 1 else torch.cat(parts, 1)).view(M, nact, 2 * g), g, act)
        if not uniform:
            idx = torch.tensor([j for s, e in runs for j in range(s, e)], device=x.device)
            h = h * mask.index_select(1, idx)[:, :, None].to(h.dtype)
        h = h.view(M, nact * g)
        off = 0
        for s, e in runs:
            down.acc(out, h[:, off : off + (e - s) * g], s, e)
            off += (e - s) * g
        return out.to(x.dtype)
    order, counts = ops.group_token_lists(mask)
    for j, n in enumerate(counts.tolist()):
        if n == 0:
            continue
        if n == M:
            down.acc(out, _swiglu(gu.rows(x, j * 2 * g, (j + 1) * 2 * g), g, act), j, j + 1)
        else:
            idx = order[j, :n]
            h = _swiglu(gu.rows(x, j * 2 * g, (j + 1) * 2 * g, idx), g, act)  # [n, g], compact
            down.acc(out, h, j, j + 1, idx)
    return out.to(x.dtype)


def grouped_gate_up(w_gate: torch.Tensor, w_up: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[F, D]`` gate and up -> ``[2F, D]`` group-major: per group its gate rows, then its up rows
    (a run of adjacent groups is one contiguous block; one GEMM yields both halves)."""
    F_, D = w_gate.shape
    G = F_ // group_size
    return torch.stack([w_gate.reshape(G, group_size, D), w_up.reshape(G, group_size, D)], dim=1).reshape(2 * F_, D)


# ----------------------------------------------------------------------------------------------
# the operator contract (ops.py signatures, HF weight layout); used by tests and by callers that
# hold HF-layout weights. These entry points lay the weights out on every call (a copy); the
# backend does that once at load.


def float_proj(w: torch.Tensor, axis: str, g: int | None = None) -> Proj:
    """A float ``Proj`` of the HF-layout ``w [N, K]`` (copied into its layout) in ``w``'s dtype
    and device, counting into a fresh ``Counter``."""
    return Proj(w, axis, "float", w.dtype, w.device, Counter(), g)


def gemm_mn(a, w, mask, group_size, bias=None):
    """Work-skipping ``ops.gemm_mn`` (same signature and result)."""
    return gemm_mn_proj(a, float_proj(w, "n"), mask, group_size, bias)


def gemm_k(a, w, mask, group_size, bias=None):
    """Work-skipping ``ops.gemm_k``."""
    return gemm_k_proj(a, float_proj(w, "k", group_size), mask, bias)


def gemm_mn_swiglu(a, w_gate, w_up, mask, group_size, act="silu"):
    """Work-skipping ``ops.gemm_mn_swiglu``."""
    N = w_gate.shape[0]
    G, g = N // group_size, group_size
    p = float_proj(grouped_gate_up(w_gate, w_up, g), "n")
    state = mask_state(mask)
    M = a.shape[0]
    if state == "dense":
        return _swiglu(p.rows(a, 0, 2 * N).view(M, G, 2 * g), g, act).reshape(M, N)
    out = torch.zeros(M, N, dtype=a.dtype, device=a.device)
    if state == "none":
        return out
    order, counts = ops.group_token_lists(mask)
    for j, n in enumerate(counts.tolist()):
        if n:
            idx = order[j, :n]
            out[:, j * g : (j + 1) * g].index_copy_(0, idx, _swiglu(p.rows(a.index_select(0, idx), 2 * j * g, 2 * (j + 1) * g), g, act))
    return out
