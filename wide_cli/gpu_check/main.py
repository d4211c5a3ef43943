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
import os
import sys
import threading
import time
import traceback
from pathlib import Path

from wide_cli.atomic import atomic_write_bytes
from wide_cli.gpu_check.cases import TARGETS, build_cases
from wide_cli.gpu_check.compile import section_compile
from wide_cli.gpu_check.e2e import section_e2e
from wide_cli.gpu_check.measure import section_cases
from wide_cli.gpu_check.report import (
    Report,
    print_summary,
    render_markdown,
    targets_summary,
    versions,
    watchdog,
)

BUDGET_SPLIT = {"compile": 0.22, "check": 0.33, "bench": 0.33, "e2e": 0.12}


def main(argv: list[str] | None = None) -> int:
    """Run the sections ``argv`` asks for; 0 when every check passed, 1 on failures, 2 without a GPU.

    The kernels themselves are checked and timed: first-use verification (unless ``--verify``)
    and the large-M cuBLAS dispatch are off while it runs (``REGISTRY.overrides``; the environment
    is left alone). Each bench record says what the default dispatch would have run instead.
    """
    from wide_cli.runtime.cuda.registry import REGISTRY

    args = _parser().parse_args(argv)
    if args.render_only:
        return _render(Path(args.out))
    done = threading.Event()
    settings = {"dense_above": 1.0} if args.verify else {"dense_above": 1.0, "verify": False}
    auto_threshold = REGISTRY.dense_above()  # what a user's run would apply
    try:
        with REGISTRY.overrides(**settings):
            return _run(args, done, auto_threshold)
    finally:
        done.set()  # stops the watchdog


def _render(out: Path) -> int:
    """Write ``gpu_check.md`` beside ``gpu_check.json`` (atomically); 2 when there is no JSON."""
    src = out / "gpu_check.json"
    if not src.is_file():
        print(f"error: {src} does not exist; run `make gpu-check` on a GPU machine first", file=sys.stderr)
        return 2
    data = json.loads(src.read_text())
    command = "python -m wide_cli.gpu_check " + " ".join(data.get("argv", []))
    atomic_write_bytes(out / "gpu_check.md", render_markdown(data, command).encode())
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m wide_cli.gpu_check", description=__doc__.split("\n")[0])
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
    p.add_argument(
        "--render-only", action="store_true", help="rewrite gpu_check.md from the gpu_check.json in --out; run nothing"
    )
    return p


def _run(args: argparse.Namespace, done: threading.Event, auto_threshold: float) -> int:
    t_start = time.time()
    report = Report(Path(args.out))
    cases = build_cases()
    wanted = set(args.sections.split(","))
    report.data.update({
        "argv": sys.argv[1:], "dry_run": args.dry_run, "budget_s": args.budget_s, "versions": versions(),
        "case_counts": {k: len(v) for k, v in cases.items()}, "targets_wanted": {k: v[1] for k, v in TARGETS.items()},
    })  # fmt: skip
    report.data["auto_dense_threshold"] = auto_threshold
    from wide_cli.runtime.cuda.registry import REGISTRY

    report.data["auto_gemv_max_m"] = REGISTRY.gemv_max_m()
    threading.Thread(target=watchdog, args=(report, t_start + args.budget_s + 45, done), daemon=True).start()
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
            section_cases(report, name, cases[name], budget[name], state, auto_threshold)
            report.write()
    report.data["targets"] = targets_summary(report)
    if args.export and "e2e" in wanted and not state.get("sticky"):
        try:
            # what a user's run gets: the default dispatch and first-use verification
            with REGISTRY.overrides(dense_above=auto_threshold, verify=True):
                before = dict(REGISTRY.dispatch)
                section_e2e(report, args.export, budget["e2e"])
                ran = {k: n - before.get(k, 0) for k, n in REGISTRY.dispatch.items()}
                report.data["sections"]["e2e"]["dispatch"] = {f"{op}: {p}": n for (op, p), n in ran.items() if n}
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
    _render(Path(args.out))
    print_summary(report)
    chk = report.data["sections"].get("check", {})
    return 1 if chk.get("failed") or state.get("sticky") else 0
