"""``make gpu-check``: check and time every CuPy kernel on one GPU, write one JSON.

    python -m wide_cli.gpu_check --out docs/results/gpu [--export DIR] [--budget-s 420]
    python -m wide_cli.gpu_check --out /tmp/x --dry-run      # no GPU: cases + NVRTC only

Sections, each with its own time budget (cases past it are recorded as skipped, never run):
1. ``compile``: every kernel build the dispatcher may pick, compiled in parallel worker processes
   (fills CuPy's disk cache), with registers / local memory per kernel.
2. ``check``: every operator against its PyTorch reference (computed in fp32 on the same inputs)
   on SmolLM2-135M (D=576, H=9, H_kv=3, d=64, F=1536) and Llama-3.1-8B (D=4096, H=32, H_kv=8,
   d=128, F=14336) shapes, M in 1, 8, 128, 1024, 4096, sparsity 0 .. 1, random and structured
   masks; skipped outputs must be exact zeros. First-use verification and the large-M cuBLAS
   dispatch are off (``WIDE_CUPY_VERIFY=0``, ``WIDE_CUPY_DENSE_ABOVE=1.0``), so the kernels
   themselves are checked and timed; bench records carry the mask's live fraction and what the
   default dispatch would run.
3. ``bench``: CUDA-event times after warm-up of each kernel, of the dense op (cuBLAS ``F.linear``
   / ``scaled_dot_product_attention``) and of a naive gather-compute-scatter baseline; kernel and
   dense ops also as CUDA-graph replays (pure GPU time, no launch gaps). Speedups sit next to
   the ideal 1/(1-s).
4. ``e2e`` (with ``--export``): prefill and decode tokens/s of the exported model on the ``cupy``
   backend, routed vs dense, and its logits against the ``reference`` backend.

Failures are caught and recorded per case; a sticky CUDA error stops the GPU sections; a
watchdog thread writes what exists and exits if the whole run overstays its budget by 45 s.
The JSON (``gpu_check.json``, written atomically after every section) holds the device, versions,
every number and a ``targets`` summary.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import threading
import time
import traceback
import zlib
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path

MODELS = {
    "smollm2-135m": {"D": 576, "H": 9, "Hkv": 3, "d": 64, "F": 1536, "attn_group": 3, "ffn_group": 128},
    "llama-3.1-8b": {"D": 4096, "H": 32, "Hkv": 8, "d": 128, "F": 14336, "attn_group": 4, "ffn_group": 128},
}
MS = (1, 8, 128, 1024, 4096)
SPARSITIES = (0.0, 0.25, 0.5, 0.75, 1.0)
MASKS = ("random", "structured")  # structured: the same groups skip for every token / row
GEMM_OPS = ("q", "gate", "gate_up", "o", "down")  # gemm_mn, gemm_mn, gemm_mn_swiglu, gemm_k, gemm_k
BUDGET_SPLIT = {"compile": 0.22, "check": 0.33, "bench": 0.33, "e2e": 0.12}
TOL = {"bf16": 1e-2, "fp16": 2e-3}  # relative Frobenius error vs the fp32 reference
TARGETS = {  # (op, model, M or B, sparsity) -> wanted speedup over dense (benchmarks, not tests)
    "gemm_mn M=4096 (gate, g=128)": (("gate", "llama-3.1-8b", 4096, 0.5), 1.7),
    "gemm_k M=4096 (down, g=128)": (("down", "llama-3.1-8b", 4096, 0.5), 1.7),
    "GEMV decode gemm_mn M=1 (gate)": (("gate", "llama-3.1-8b", 1, 0.5), 1.8),
    "GEMV decode gemm_k M=1 (down)": (("down", "llama-3.1-8b", 1, 0.5), 1.8),
    "decode attention B=1 S=32k": (("attn_decode", "llama-3.1-8b", 1, 0.5), 1.6),
}


@dataclass(frozen=True)
class Case:
    """One operator run: ``m`` is tokens (GEMMs), prefill tokens (B=1), or batch rows (decode)."""

    op: str
    model: str
    m: int
    sparsity: float
    mask: str
    dtype: str = "bf16"
    slots: int = 0  # decode context length

    @property
    def name(self) -> str:
        s = f"{self.op}/{self.model}/M{self.m}/s{self.sparsity}/{self.mask}/{self.dtype}"
        return s + (f"/S{self.slots}" if self.slots else "")


def build_cases() -> dict[str, list[Case]]:
    """The check and bench case lists (pure Python)."""
    check: list[Case] = []
    for model in MODELS:
        for s in SPARSITIES:
            for mk in MASKS:
                for m in MS:
                    check += [Case(op, model, m, s, mk) for op in GEMM_OPS]
                    check.append(Case("attn_prefill", model, m, s, mk))
                for b, S in ((1, 4096), (8, 4096), (128, 1024)):
                    check.append(Case("attn_decode", model, b, s, mk, slots=S))
        for m in (1, 8, 128):  # fp16 subset
            check += [Case(op, model, m, 0.5, "random", "fp16") for op in (*GEMM_OPS, "attn_prefill")]
        check.append(Case("attn_decode", model, 8, 0.5, "random", "fp16", slots=1024))
    bench: list[Case] = []
    # the targets first, so a tight budget still measures them
    bench += [
        Case(op, model, m, s, "random", slots=32768 if op == "attn_decode" else 0)
        for (op, model, m, s), _ in TARGETS.values()
    ]
    for model in MODELS:
        for m in MS:
            for s in SPARSITIES:
                bench += [Case(op, model, m, s, "random") for op in GEMM_OPS]
            bench += [Case(op, model, m, 0.5, "structured") for op in GEMM_OPS]
            bench += [Case("attn_prefill", model, m, s, "random") for s in (0.0, 0.5) if m >= 8]
        for S in (4096, 32768):
            bench += [Case("attn_decode", model, b, s, "random", slots=S) for b in (1, 8) for s in SPARSITIES]
    seen, unique = set(), []
    for c in bench:
        if c not in seen:
            seen.add(c)
            unique.append(c)
    return {"check": check, "bench": unique}


# ----------------------------------------------------------------------------------------------
# run bookkeeping


class Report:
    """The JSON being built; written atomically after each section and by the watchdog."""

    def __init__(self, out_dir: Path):
        self.path = out_dir / "gpu_check.json"
        self.data: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "sections": {}}
        self.lock = threading.Lock()

    def write(self) -> None:
        with self.lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(self.data, indent=1, default=str))
            os.replace(tmp, self.path)


def _watchdog(report: Report, deadline: float, done: threading.Event) -> None:
    """Write what exists and exit hard if ``main`` has not finished by ``deadline``."""
    if done.wait(max(0.0, deadline - time.time())):
        return  # main finished (or returned early): nothing to do
    report.data["aborted"] = "watchdog: run exceeded its time budget by 45 s (a hung kernel?)"
    report.write()
    print(f"gpu_check: watchdog fired, partial results in {report.path}", file=sys.stderr, flush=True)
    os._exit(3)


def _versions() -> dict:
    out = {"python": sys.version.split()[0], "platform": platform.platform()}
    try:
        import torch

        out["torch"], out["torch_cuda"] = torch.__version__, torch.version.cuda
    except ImportError:
        pass
    try:
        import cupy

        out["cupy"] = cupy.__version__
        from cupy_backends.cuda.libs import nvrtc

        out["nvrtc"] = ".".join(map(str, nvrtc.getVersion()))
        out["cuda_driver"] = cupy.cuda.runtime.driverGetVersion()
    except Exception as e:  # noqa: BLE001 - versions are informational; record why one is missing
        out["cupy_error"] = f"{type(e).__name__}: {e}"
    return out


# ----------------------------------------------------------------------------------------------
# section 1: compile


def _compile_offline(label: str, source: str, defines: dict, dtype: str, arch: str) -> dict:
    from wide_cli.runtime.cuda import nvrtc, sources

    t0 = time.time()
    opts = sources.compile_options(dtype, arch, defines) + ("--ptxas-options=-v",)
    res = nvrtc.nvrtc_compile(sources.load_source(source), opts, source)
    info = {"build": label, "dtype": dtype, "arch": arch, "ok": res.ok, "seconds": round(time.time() - t0, 2)}
    info["problems"] = nvrtc.log_problems(res.log)[:10]
    regs = [int(x) for x in _findall(r"Used (\d+) registers", res.log)]
    spills = [int(x) for x in _findall(r"(\d+) bytes spill stores", res.log)]
    info["registers"], info["spill_store_bytes"] = regs, spills
    return info


def _findall(pattern: str, text: str) -> list[str]:
    import re

    return re.findall(pattern, text)


def _compile_on_device(source: str, funcs: tuple, defines: dict, dtype: str) -> dict:
    """Worker process: build through CuPy (fills its disk cache) and read the kernel attributes."""
    import torch

    from wide_cli.runtime.cuda.launch import get_kernel

    dev = torch.device("cuda", 0)
    t0 = time.time()
    out = {"source": source, "defines": defines, "dtype": dtype, "kernels": {}}
    for f in funcs:
        k = get_kernel(source, f, dtype, defines, dev)
        out["kernels"][f] = {"registers": k.num_regs, "local_bytes": k.local_size_bytes}
    out["seconds"] = round(time.time() - t0, 2)
    return out


def section_compile(report: Report, budget: float, dry_run: bool, arch: str, workers: int) -> None:
    from wide_cli.runtime.cuda import sources
    from wide_cli.runtime.cuda.builds import kernel_builds

    t_end = time.time() + budget
    jobs = [(b, dt) for dt in ("bf16", "fp16") for b in kernel_builds()]
    results, errors = [], []
    ctx = None
    if not dry_run:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")  # fresh CUDA contexts in the workers
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=ctx)
    futs = {}
    for b, dt in jobs:
        if dry_run:
            fut = pool.submit(_compile_offline, b.label, b.source, dict(b.defines), dt, arch)
        else:
            fut = pool.submit(_compile_on_device, b.source, sources.SOURCES[b.source], dict(b.defines), dt)
        futs[fut] = (b, dt)
    try:
        for fut in as_completed(futs, timeout=max(1.0, t_end - time.time())):
            b, dt = futs[fut]
            try:
                results.append(fut.result())
            except Exception as e:  # noqa: BLE001 - one failed build must not stop the others
                errors.append({"build": b.label, "dtype": dt, "error": f"{type(e).__name__}: {e}"})
    except TimeoutError:
        errors.append({"error": "compile budget exhausted; the remaining builds compile on first use"})
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    failed = [r for r in results if r.get("ok") is False or r.get("problems")]
    report.data["sections"]["compile"] = {
        "mode": "offline NVRTC (no device)" if dry_run else "CuPy RawModule on the device",
        "arch": arch,
        "builds": len(jobs),
        "done": len(results),
        "failed": failed,
        "errors": errors,
        "results": results,
    }


# ----------------------------------------------------------------------------------------------
# inputs, references and baselines (GPU sections)


def _shape(case: Case) -> dict:
    cfg = MODELS[case.model]
    D, H, d, F = cfg["D"], cfg["H"], cfg["d"], cfg["F"]
    ag, fg = cfg["attn_group"] * d, cfg["ffn_group"]
    return {
        "q": {"K": D, "N": H * d, "g": ag},
        "gate": {"K": D, "N": F, "g": fg},
        "gate_up": {"K": D, "N": F, "g": fg},
        "o": {"K": H * d, "N": D, "g": ag},
        "down": {"K": F, "N": D, "g": fg},
    }.get(case.op, {})


def _group_mask(rows: int, groups: int, s: float, kind: str, gen, device):
    import torch

    if kind == "structured":  # the same groups skip for every row: exactly round(s*G) of them
        n_skip = round(s * groups)
        keep = torch.ones(groups, dtype=torch.bool, device=device)
        keep[torch.randperm(groups, generator=gen, device=device)[:n_skip]] = False
        return keep.expand(rows, groups).contiguous()
    return torch.rand(rows, groups, generator=gen, device=device) >= s


class Workload:
    """Inputs of one case plus its kernel, reference, dense and naive callables."""

    def __init__(self, case: Case, weights: dict):
        import torch
        import torch.nn.functional as Fn

        from wide_cli.runtime import cupy_ops, ops

        self.case = case
        dev = torch.device("cuda")
        dt = torch.bfloat16 if case.dtype == "bf16" else torch.float16
        gen = torch.Generator(device=dev).manual_seed(zlib.crc32(case.name.encode()))
        cfg = MODELS[case.model]
        self.flops = self.bytes = 0.0
        if case.op in GEMM_OPS:
            sh = _shape(case)
            K, N, g, M = sh["K"], sh["N"], sh["g"], case.m
            key = (case.model, case.op, case.dtype)
            if key not in weights:
                ws = [(0.02 * torch.randn(N, K, device=dev, generator=gen)).to(dt) for _ in range(2)]
                weights[key] = ws
            w, w2 = weights[key]
            a = torch.randn(M, K, device=dev, generator=gen).to(dt)
            G = (N if case.op in ("q", "gate", "gate_up") else K) // g
            mask = _group_mask(M, G, case.sparsity, case.mask, gen, dev)
            self.mask, self.g = mask, g
            live = float(mask.float().mean())
            if case.op in ("o", "down"):  # gemm_k: the live 16-row fragments decide its work
                Mp = -(-M // 16) * 16
                pad = torch.zeros(Mp, G, dtype=torch.bool, device=dev)
                pad[:M] = mask
                self.live = float(pad.view(-1, 16, G).any(1).float().mean())
            else:
                self.live = live
            mult = 2 if case.op == "gate_up" else 1
            self.flops = 2.0 * M * K * N * mult * live
            self.bytes = 2.0 * (
                N * K * mult * (mask.any(0).float().mean().item() if M <= 8 else 1.0) + M * K + M * N
            )
            if case.op == "gate_up":
                w_gu = torch.cat([w, w2])
                self.kernel = lambda: cupy_ops.gemm_mn_swiglu(a, w, w2, mask, g)
                self.reference = lambda: ops.gemm_mn_swiglu(a.float(), w.float(), w2.float(), mask, g)
                self.dense = lambda: _dense_swiglu(a, w_gu, N)
                self.naive = lambda: _naive_mn(a, w, w2, mask, g)
                self.zero_mask = ops.expand_mask(mask, g)
            elif case.op in ("q", "gate"):
                self.kernel = lambda: cupy_ops.gemm_mn(a, w, mask, g)
                self.reference = lambda: ops.gemm_mn(a.float(), w.float(), mask, g)
                self.dense = lambda: Fn.linear(a, w)
                self.naive = lambda: _naive_mn(a, w, None, mask, g)
                self.zero_mask = ops.expand_mask(mask, g)
            else:
                self.kernel = lambda: cupy_ops.gemm_k(a, w, mask, g)
                self.reference = lambda: ops.gemm_k(a.float(), w.float(), mask, g)
                self.dense = lambda: Fn.linear(a, w)
                self.naive = lambda: _naive_k(a, w, mask, g)
                self.zero_mask = None
        elif case.op == "attn_prefill":
            H, Hkv, d, hg = cfg["H"], cfg["Hkv"], cfg["d"], cfg["attn_group"]
            T = case.m
            q = torch.randn(1, T, H, d, device=dev, generator=gen).to(dt)
            k = torch.randn(1, T, Hkv, d, device=dev, generator=gen).to(dt)
            v = torch.randn(1, T, Hkv, d, device=dev, generator=gen).to(dt)
            hm = _group_mask(T, H // hg, case.sparsity, case.mask, gen, dev).repeat_interleave(hg, dim=-1)[
                None
            ]
            scale = d**-0.5
            qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
            self.kernel = lambda: cupy_ops.attention_prefill(q, k, v, hm, scale=scale)
            self.reference = lambda: ops.attention_prefill(q.float(), k.float(), v.float(), hm, scale=scale)
            self.dense = lambda: _sdpa(qt, kt, vt, causal=True)
            self.naive = lambda: _naive_prefill(q, k, v, hm, hg, scale)
            self.zero_mask = hm[..., None].expand(1, T, H, d)  # executing entries
            live = float(hm.float().mean())
            self.flops = 4.0 * T * T / 2 * d * H * live
            self.bytes = 2.0 * (2 * T * H * d + 2 * T * Hkv * d)
        else:  # attn_decode
            H, Hkv, d = cfg["H"], cfg["Hkv"], cfg["d"]
            B, S = case.m, case.slots
            hq = H // Hkv
            q = torch.randn(B, H, d, device=dev, generator=gen).to(dt)
            kc = torch.randn(B, Hkv, S, d, device=dev, generator=gen).to(dt)
            vc = torch.randn(B, Hkv, S, d, device=dev, generator=gen).to(dt)
            hm = _group_mask(B, Hkv, case.sparsity, case.mask, gen, dev).repeat_interleave(hq, dim=-1)
            kv = torch.ones(B, S, dtype=torch.bool, device=dev)
            scale = d**-0.5
            self.kernel = lambda: cupy_ops.attention_decode(q, kc, vc, hm, kv, scale=scale)
            self.reference = lambda: ops.attention_decode(
                q.float(), kc.float(), vc.float(), hm, kv, scale=scale
            )
            self.dense = lambda: _sdpa(q[:, :, None], kc, vc, causal=False)
            self.naive = lambda: _naive_decode(q, kc, vc, hm, hq, scale)
            self.zero_mask = hm[..., None].expand(B, H, d)
            live = float(hm.float().mean())
            self.flops = 4.0 * B * H * S * d * live
            self.bytes = 2.0 * 2 * B * Hkv * S * d * live
        self.ideal = math.inf if case.sparsity >= 1.0 else 1.0 / (1.0 - case.sparsity)
        self.live = getattr(self, "live", None)


def _sdpa(q, k, v, causal: bool):
    import torch.nn.functional as Fn

    if q.shape[1] != k.shape[1]:
        try:
            return Fn.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        except (TypeError, RuntimeError):
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return Fn.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _dense_swiglu(a, w_gu, n: int):
    """The dense FFN up-projection: one GEMM over [gate; up], then silu(gate) * up."""
    import torch.nn.functional as Fn

    gu = Fn.linear(a, w_gu)
    return Fn.silu(gu[:, :n]) * gu[:, n:]


def _naive_mn(a, w, w2, mask, g):
    """Gather the executing tokens of each group, one GEMM per group, scatter back."""
    import torch
    import torch.nn.functional as Fn

    out = torch.zeros(a.shape[0], w.shape[0], dtype=a.dtype, device=a.device)
    for j in range(mask.shape[1]):
        idx = mask[:, j].nonzero().squeeze(1)
        if idx.numel():
            x = a.index_select(0, idx)
            y = Fn.linear(x, w[j * g : (j + 1) * g])
            if w2 is not None:
                y = Fn.silu(y) * Fn.linear(x, w2[j * g : (j + 1) * g])
            out[idx, j * g : (j + 1) * g] = y
    return out


def _naive_k(a, w, mask, g):
    import torch
    import torch.nn.functional as Fn

    out = torch.zeros(a.shape[0], w.shape[0], dtype=torch.float32, device=a.device)
    for j in range(mask.shape[1]):
        idx = mask[:, j].nonzero().squeeze(1)
        if idx.numel():
            out.index_add_(0, idx, Fn.linear(a[idx, j * g : (j + 1) * g], w[:, j * g : (j + 1) * g]).float())
    return out.to(a.dtype)


def _naive_prefill(q, k, v, hm, hg, scale):
    """Per head group: gather its executing queries, SDPA with their causal rows, scatter."""
    import torch
    import torch.nn.functional as Fn

    _, T, H, d = q.shape
    Hkv = k.shape[2]
    out = torch.zeros_like(q)
    slots = torch.arange(T, device=q.device)
    for j in range(H // hg):
        idx = hm[0, :, j * hg].nonzero().squeeze(1)
        if not idx.numel():
            continue
        heads = slice(j * hg, (j + 1) * hg)
        kvh = (j * hg) // (H // Hkv)
        qs = q[0, idx, heads].transpose(0, 1)[None]  # [1, hg, n, d]
        ks = k[0, :, kvh][None, None].expand(1, hg, T, d)
        vs = v[0, :, kvh][None, None].expand(1, hg, T, d)
        vis = slots[None, :] <= idx[:, None]
        o = Fn.scaled_dot_product_attention(qs, ks, vs, attn_mask=vis, scale=scale)
        out[0, idx, heads] = o[0].transpose(0, 1)
    return out


def _naive_decode(q, kc, vc, hm, hq, scale):
    import torch
    import torch.nn.functional as Fn

    out = torch.zeros_like(q)
    for j in range(kc.shape[1]):
        rows = hm[:, j * hq].nonzero().squeeze(1)
        if rows.numel():
            qs = q[rows, j * hq : (j + 1) * hq, None]  # [n, hq, 1, d]
            ks = kc[rows, j][:, None].expand(-1, hq, -1, -1)
            vs = vc[rows, j][:, None].expand(-1, hq, -1, -1)
            out[rows, j * hq : (j + 1) * hq] = Fn.scaled_dot_product_attention(qs, ks, vs, scale=scale)[
                :, :, 0
            ]
    return out


# ----------------------------------------------------------------------------------------------
# timing


def time_eager(fn, warmup: int = 3, max_reps: int = 20, max_ms: float = 150.0) -> float:
    """Median ms per call, CUDA events around each call after warm-up (launch overhead included)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    t_stop = time.time() + max_ms / 1e3
    while len(times) < max_reps and (len(times) < 3 or time.time() < t_stop):
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1))
    return statistics.median(times)


def time_graph(fn, per_graph: int = 10, replays: int = 5) -> float | None:
    """ms per call from CUDA-graph replays of ``per_graph`` back-to-back calls (GPU time only)."""
    import torch

    try:
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(per_graph):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(replays):
            e0.record()
            graph.replay()
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1) / per_graph)
        del graph
        return statistics.median(times)
    except Exception:  # noqa: BLE001 - capture is best effort; eager timing stands without it
        torch.cuda.synchronize()
        return None


_AUTO_THRESHOLD = [0.6]


def state_threshold() -> float:
    """The large-M dispatch threshold the user's environment would apply (recorded per record)."""
    return _AUTO_THRESHOLD[0]


def _sticky(err: BaseException) -> bool:
    msg = str(err).lower()
    return any(s in msg for s in ("illegal memory access", "illegal address", "unspecified launch failure",
                                  "misaligned address", "an illegal instruction", "device-side assert"))  # fmt: skip


def _fallbacks_since(before: dict) -> dict:
    from wide_cli.runtime.cuda.registry import REGISTRY

    counts = REGISTRY.fallback_counts()
    return {k: v - before.get(k, 0) for k, v in counts.items() if v != before.get(k, 0)}


def run_case(case: Case, weights: dict, mode: str) -> dict:
    import torch

    from wide_cli.runtime.cuda.registry import REGISTRY

    rec = asdict(case)
    before = REGISTRY.fallback_counts()
    t0 = time.time()
    wl = Workload(case, weights)
    rec["ideal_speedup"] = wl.ideal
    if mode == "check":
        out = wl.kernel()
        ref = wl.reference()
        o, r = out.float(), ref.float()
        rec["finite"] = bool(torch.isfinite(o).all())
        rec["rel_err"] = (
            float((o - r).norm() / r.norm().clamp_min(1e-12)) if r.abs().max() > 0 else float(o.abs().max())
        )
        if wl.zero_mask is not None:
            rec["skipped_exact_zero"] = bool((out[~wl.zero_mask] == 0).all())
        rec["pass"] = (
            rec["finite"] and rec["rel_err"] <= TOL[case.dtype] and rec.get("skipped_exact_zero", True)
        )
    else:
        rec["kernel_ms"] = time_eager(wl.kernel)
        rec["kernel_graph_ms"] = time_graph(wl.kernel)
        rec["dense_ms"] = time_eager(wl.dense)
        rec["dense_graph_ms"] = time_graph(wl.dense)
        rec["naive_ms"] = time_eager(wl.naive, warmup=1, max_reps=5)
        k = rec["kernel_graph_ms"] or rec["kernel_ms"]
        dn = rec["dense_graph_ms"] or rec["dense_ms"]
        rec["speedup_vs_dense"] = dn / k if k else None
        rec["speedup_vs_dense_eager"] = rec["dense_ms"] / rec["kernel_ms"] if rec["kernel_ms"] else None
        rec["speedup_vs_naive"] = rec["naive_ms"] / k if k else None
        rec["kernel_tflops"] = wl.flops / (k * 1e9) if k else None
        if wl.live is not None:
            from wide_cli.runtime.cupy_ops import AUTO_MIN_M

            rec["live_fraction"] = wl.live
            dense = case.m >= AUTO_MIN_M and wl.live > float(state_threshold())
            rec["default_dispatch"] = "cuBLAS on the masked input" if dense else "kernel"
        rec["kernel_gbps"] = wl.bytes / (k * 1e6) if k else None
    rec["fallbacks"] = _fallbacks_since(before)
    rec["seconds"] = round(time.time() - t0, 3)
    del wl
    return rec


def section_cases(report: Report, name: str, cases: list[Case], budget: float, state: dict) -> None:
    import torch

    t_end = time.time() + budget
    weights: dict = {}
    records, skipped = [], 0
    sec = report.data["sections"][name] = {"cases": len(cases), "records": records}
    for i, case in enumerate(cases):
        if state.get("sticky"):
            records.append({**asdict(case), "error": "skipped: earlier sticky CUDA error"})
            continue
        if time.time() > t_end:
            skipped = len(cases) - i
            break
        try:
            records.append(run_case(case, weights, name))
        except Exception as e:  # noqa: BLE001 - record and go on; a sticky CUDA error stops the GPU work
            records.append(
                {**asdict(case), "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(limit=3)}
            )
            if _sticky(e):
                state["sticky"] = str(e)
            else:
                torch.cuda.empty_cache()
        if i % 25 == 0:
            report.write()
    sec["skipped_budget"] = skipped
    if name == "check":
        sec["passed"] = sum(1 for r in records if r.get("pass"))
        sec["failed"] = [r for r in records if r.get("pass") is False or "error" in r]
    weights.clear()
    torch.cuda.empty_cache()


def targets_summary(report: Report) -> dict:
    recs = report.data["sections"].get("bench", {}).get("records", [])
    out = {}
    for label, ((op, model, m, s), want) in TARGETS.items():
        hit = [r for r in recs if r.get("op") == op and r.get("model") == model and r.get("m") == m
               and r.get("sparsity") == s and r.get("mask") == "random" and "speedup_vs_dense" in r
               and (op != "attn_decode" or r.get("slots") == 32768)]  # fmt: skip
        got = hit[0]["speedup_vs_dense"] if hit else None
        out[label] = {"target": want, "measured": got, "met": got is not None and got >= want}
    return out


# ----------------------------------------------------------------------------------------------
# section 4: end to end


def _sync_time(fn) -> float:
    """Wall seconds of ``fn()`` including the GPU work it queued."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


def _forced_masks(rt, batch: int, slots: int, p_skip: float, seed: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {
        (m.index, module): (torch.rand(batch, slots, G, generator=g) >= p_skip).to(rt.device)
        for m in rt.meta
        for module, G in (("attention", m.attn_groups), ("ffn", m.ffn_groups))
    }


def _e2e_system(rt, routing: bool, forced: float | None, prompt_len: int, batch: int, steps: int) -> dict:
    """Synchronised prefill (batch 1) and decode (``batch`` rows) timings of one runtime setting."""
    import torch

    g = torch.Generator().manual_seed(0)
    vocab = min(rt.vocab_size, 30000)
    rt.routing = routing
    out = {}
    for phase, B, L in (("prefill", 1, prompt_len), ("decode", batch, 64)):
        ids = torch.randint(10, vocab, (B, L), generator=g)
        slots = L + (steps if phase == "decode" else 0)
        rt.forced = _forced_masks(rt, B, slots, forced, 1) if (routing and forced is not None) else {}
        times = []
        for rep in range(3):  # the first is a warm-up (compiles, allocator)
            cache = rt.new_cache(B, slots)
            if phase == "prefill":
                dt = _sync_time(lambda: rt.step(ids, None, cache))  # noqa: B023 - called at once
            else:
                logits = rt.step(ids, None, cache)
                box = [logits]

                def run(box=box, cache=cache):
                    for _ in range(steps):
                        box[0] = rt.step(box[0].argmax(-1, keepdim=True), None, cache)

                dt = _sync_time(run)
            if rep:
                times.append(dt)
        t = statistics.median(times)
        ntok = B * L if phase == "prefill" else B * steps
        out[phase] = {"batch": B, "tokens": ntok, "seconds": t, "tokens_per_s": ntok / t}
    rt.forced = {}
    return out


def section_e2e(report: Report, export: str, budget: float) -> None:
    """Routed vs dense (same cupy backend, routing off) on an export; logits vs the reference."""
    import torch

    from wide_cli.runtime.cuda.registry import REGISTRY
    from wide_cli.runtime.engine import Runtime

    sec = report.data["sections"]["e2e"] = {
        "export": export,
        "timing": "torch.cuda.synchronize around each run",
    }
    before = REGISTRY.fallback_counts()
    t_end = time.time() + budget
    rt = Runtime.from_export(export, backend="cupy", dtype="bf16")
    runs = {}
    for label, routing, forced in (
        ("dense", False, None),
        ("routed", True, None),
        ("forced_s0.5", True, 0.5),
    ):
        if time.time() > t_end:
            runs[label] = {"skipped": "budget"}
            continue
        rt.stats.reset()
        runs[label] = _e2e_system(rt, routing, forced, prompt_len=1024, batch=8, steps=32)
        if routing:
            runs[label]["measured_sparsity"] = rt.stats.summary()
            from wide_cli.cost import decode_speedup_bound

            runs[label]["ideal_decode_speedup"] = decode_speedup_bound(rt.shape(), runs[label]["measured_sparsity"])
    sec["runs"] = runs
    dense = runs.get("dense", {})
    for label in ("routed", "forced_s0.5"):
        r = runs.get(label, {})
        for phase in ("prefill", "decode"):
            if phase in r and phase in dense:
                sec[f"{label}_{phase}_speedup"] = dense[phase]["seconds"] / r[phase]["seconds"]
    if time.time() < t_end:  # logits against the reference backend on the same GPU, same routing
        ids = torch.randint(
            10, min(rt.vocab_size, 30000), (2, 64), generator=torch.Generator().manual_seed(1)
        )
        ref = Runtime.from_export(export, backend=_ref_backend(), dtype="bf16")
        a, b = rt.forward(ids).float(), ref.forward(ids).float()
        sec["logits_rel_err_vs_reference"] = float((a - b).norm() / b.norm())
        sec["argmax_agreement"] = float((a.argmax(-1) == b.argmax(-1)).float().mean())
        del ref
    del rt
    torch.cuda.empty_cache()
    sec["fallbacks"] = _fallbacks_since(before)


def _ref_backend():
    from wide_cli.runtime.reference import ReferenceBackend

    return ReferenceBackend(device="cuda")


# ----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    done = threading.Event()
    saved = {k: os.environ.get(k) for k in ("WIDE_CUPY_VERIFY", "WIDE_CUPY_DENSE_ABOVE")}
    try:
        return _main(argv, done)
    finally:
        done.set()  # stops the watchdog
        for k, v in saved.items():  # leave the caller's environment as it was
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _main(argv: list[str] | None, done: threading.Event) -> int:
    p = argparse.ArgumentParser(
        prog="python -m wide_cli.gpu_check", description=__doc__.split("\n")[0]
    )
    p.add_argument("--out", required=True, help="folder for gpu_check.json")
    p.add_argument("--export", default=None, help="exported checkpoint for the end-to-end bench (optional)")
    p.add_argument("--budget-s", type=float, default=420.0, help="total time budget in seconds (default 420)")
    p.add_argument(
        "--dry-run", action="store_true", help="no GPU: build the case lists and compile with NVRTC only"
    )
    p.add_argument("--arch", default="sm_90", help="target of the --dry-run compile (default sm_90)")
    p.add_argument(
        "--workers", type=int, default=min(16, os.cpu_count() or 1), help="parallel compile processes"
    )
    p.add_argument("--sections", default="compile,check,bench,e2e", help="comma-separated subset to run")
    p.add_argument("--verify", action="store_true", help="keep first-use verification on (default off here)")
    args = p.parse_args(argv)

    t_start = time.time()
    report = Report(Path(args.out))
    cases = build_cases()
    wanted = set(args.sections.split(","))
    report.data.update({
        "argv": sys.argv[1:], "dry_run": args.dry_run, "budget_s": args.budget_s, "versions": _versions(),
        "case_counts": {k: len(v) for k, v in cases.items()}, "targets_wanted": {k: v[1] for k, v in TARGETS.items()},
    })  # fmt: skip
    if not args.verify:
        os.environ["WIDE_CUPY_VERIFY"] = "0"
    # check and time the kernels themselves; each bench record says what the default large-M
    # dispatch (cuBLAS when the live fraction exceeds 0.6) would have run instead
    auto_threshold = float(os.environ.get("WIDE_CUPY_DENSE_ABOVE", "0.6"))
    _AUTO_THRESHOLD[0] = auto_threshold
    os.environ["WIDE_CUPY_DENSE_ABOVE"] = "1.0"
    report.data["auto_dense_threshold"] = auto_threshold
    threading.Thread(target=_watchdog, args=(report, t_start + args.budget_s + 45, done), daemon=True).start()
    budget = {k: v * args.budget_s for k, v in BUDGET_SPLIT.items()}
    if not args.export:
        budget["check"] += budget["e2e"] / 2
        budget["bench"] += budget["e2e"] / 2

    if args.dry_run:
        report.data["cases"] = {k: [c.name for c in v] for k, v in cases.items()}
        if "compile" in wanted:
            section_compile(report, budget["compile"] + budget["check"], True, args.arch, args.workers)
        report.data["seconds"] = round(time.time() - t_start, 1)
        report.write()
        comp = report.data["sections"].get("compile", {})
        print(f"gpu_check --dry-run: {report.data['case_counts']} cases; compiled {comp.get('done', 0)}/"
              f"{comp.get('builds', 0)} builds for {args.arch}, {len(comp.get('failed', []))} failed; {report.path}")  # fmt: skip
        return 1 if comp.get("failed") or comp.get("errors") else 0

    import torch

    from wide_cli.runtime.cuda.launch import cuda_status, device_arch
    from wide_cli.runtime.cuda.registry import REGISTRY

    why = cuda_status()
    if why is not None:
        report.data["error"] = f"cannot run on this machine: {why} (use --dry-run for the CPU-side checks)"
        report.write()
        print(report.data["error"], file=sys.stderr)
        return 2
    dev = torch.device("cuda", 0)
    props = torch.cuda.get_device_properties(dev)
    report.data["device"] = {
        "name": props.name, "capability": f"{props.major}.{props.minor}", "arch": device_arch(dev),
        "sms": props.multi_processor_count, "memory_gb": round(props.total_memory / 2**30, 1),
        "l2_mb": round(getattr(props, "L2_cache_size", 0) / 2**20, 1),
    }  # fmt: skip
    report.write()
    state: dict = {}
    if "compile" in wanted:
        section_compile(report, budget["compile"], False, device_arch(dev), args.workers)
        report.write()
    for name in ("check", "bench"):
        if name in wanted:
            section_cases(report, name, cases[name], budget[name], state)
            report.write()
    report.data["targets"] = targets_summary(report)
    if args.export and "e2e" in wanted and not state.get("sticky"):
        try:
            section_e2e(report, args.export, budget["e2e"])
        except Exception as e:  # noqa: BLE001 - recorded in the JSON
            report.data["sections"]["e2e"] = {
                "error": f"{type(e).__name__}: {e}",
                "trace": traceback.format_exc(limit=5),
            }
    report.data["broken_builds"] = REGISTRY.broken_builds()
    report.data["fallbacks_total"] = REGISTRY.fallback_counts()
    report.data["sticky_cuda_error"] = state.get("sticky")
    report.data["seconds"] = round(time.time() - t_start, 1)
    report.write()
    _print_summary(report)
    chk = report.data["sections"].get("check", {})
    return 1 if chk.get("failed") or state.get("sticky") else 0


def _print_summary(report: Report) -> None:
    d = report.data
    chk = d["sections"].get("check", {})
    print(f"device {d.get('device', {}).get('name')}  total {d.get('seconds')} s  -> {report.path}")
    print(f"check: {chk.get('passed', 0)}/{chk.get('cases', 0)} passed, {len(chk.get('failed', []))} failed, "
          f"{chk.get('skipped_budget', 0)} skipped (budget)")  # fmt: skip
    for f in chk.get("failed", [])[:10]:
        print("  FAIL", f.get("op"), f.get("model"), f.get("m"), f.get("sparsity"), f.get("mask"), f.get("dtype"),
              f.get("rel_err"), f.get("error", ""))  # fmt: skip
    print(f"{'target':34s} {'want':>5s} {'got':>6s}")
    for label, t in d.get("targets", {}).items():
        got = "-" if t["measured"] is None else f"{t['measured']:.2f}"
        print(f"{label:34s} {t['target']:5.2f} {got:>6s} {'ok' if t['met'] else ''}")
    bench = [r for r in d["sections"].get("bench", {}).get("records", []) if r.get("speedup_vs_dense")]
    print(
        f"{'op':12s} {'model':13s} {'M':>5s} {'s':>5s} {'kern ms':>8s} {'dense ms':>8s} {'x dense':>7s} {'bound':>6s}"
    )
    for r in bench[:60]:
        print(f"{r['op']:12s} {r['model']:13s} {r['m']:5d} {r['sparsity']:5.2f} {(r['kernel_graph_ms'] or r['kernel_ms']):8.4f} "
              f"{(r['dense_graph_ms'] or r['dense_ms']):8.4f} {r['speedup_vs_dense']:7.2f} {r['ideal_speedup']:6.2f}")  # fmt: skip

