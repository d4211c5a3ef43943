"""Section 1, ``compile``: every kernel build the dispatcher may pick, compiled in parallel worker
processes: offline with NVRTC (``--dry-run``, no device) or through CuPy on the device (fills its
disk cache), with registers / local memory per kernel."""

from __future__ import annotations

import time
from concurrent.futures import ProcessPoolExecutor, as_completed

from wide_cli.gpu_check.report import Report


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
