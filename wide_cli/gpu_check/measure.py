"""Sections 2 and 3, ``check`` and ``bench``: run each case against its reference or time it
(CUDA events, eager and CUDA-graph replays), within a time budget."""

from __future__ import annotations

import statistics
import time
import traceback
from dataclasses import asdict

from wide_cli.gpu_check.cases import TOL, Case
from wide_cli.gpu_check.report import Report
from wide_cli.gpu_check.workload import Workload


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


def _sticky(err: BaseException) -> bool:
    msg = str(err).lower()
    return any(s in msg for s in ("illegal memory access", "illegal address", "unspecified launch failure",
                                  "misaligned address", "an illegal instruction", "device-side assert"))  # fmt: skip


def fallbacks_since(before: dict) -> dict:
    from wide_cli.runtime.cuda.registry import REGISTRY

    counts = REGISTRY.fallback_counts()
    return {k: v - before.get(k, 0) for k, v in counts.items() if v != before.get(k, 0)}


def run_case(case: Case, weights: dict, mode: str, auto_threshold: float = 0.6) -> dict:
    """One record: ``mode`` "check" compares the kernel with the fp32 reference, "bench" times it.

    Args:
        weights: cache of weights shared by cases of the same model and op (filled here).
        auto_threshold: the live fraction above which a user's run would dispatch large-M calls
            to cuBLAS; recorded as ``default_dispatch`` next to bench timings.
    """
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
        with REGISTRY.overrides(dense_above=auto_threshold):  # what a user's call runs (dispatch included)
            rec["default_ms"] = time_eager(wl.kernel)
            rec["default_graph_ms"] = time_graph(wl.kernel)
        rec["naive_ms"] = time_eager(wl.naive, warmup=1, max_reps=5)
        k = rec["kernel_graph_ms"] or rec["kernel_ms"]
        dn = rec["dense_graph_ms"] or rec["dense_ms"]
        rec["speedup_vs_dense"] = dn / k if k else None
        dflt = rec["default_graph_ms"] or rec["default_ms"]
        rec["default_speedup_vs_dense"] = dn / dflt if dflt else None
        rec["speedup_vs_dense_eager"] = rec["dense_ms"] / rec["kernel_ms"] if rec["kernel_ms"] else None
        rec["speedup_vs_naive"] = rec["naive_ms"] / k if k else None
        rec["kernel_tflops"] = wl.flops / (k * 1e9) if k else None
        if wl.live is not None:
            from wide_cli.runtime.cuda.registry import REGISTRY
            from wide_cli.runtime.cupy_ops import dispatch_path

            live = rec["live_fraction"] = wl.live
            rec["default_dispatch"] = dispatch_path(
                case.m, lambda: live, dense_above=auto_threshold, gemv_max_m=REGISTRY.gemv_max_m()
            )
        rec["kernel_gbps"] = wl.bytes / (k * 1e6) if k else None
    rec["fallbacks"] = fallbacks_since(before)
    rec["seconds"] = round(time.time() - t0, 3)
    del wl
    return rec


def section_cases(
    report: Report, name: str, cases: list[Case], budget: float, state: dict, auto_threshold: float = 0.6
) -> None:
    """Run ``cases`` as section ``name`` ("check" or "bench") until ``budget`` seconds are spent.

    A failing case is recorded and the next one runs; a sticky CUDA error is stored in
    ``state["sticky"]`` and the remaining cases are recorded as skipped.
    """
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
            records.append(run_case(case, weights, name, auto_threshold))
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
