"""The JSON ``gpu-check`` builds (written atomically after each section and by the watchdog),
the versions it records, the targets summary and the printed summary."""

from __future__ import annotations

import json
import os
import platform
import sys
import threading
import time
from pathlib import Path

from wide_cli.atomic import atomic_write_bytes
from wide_cli.gpu_check.cases import TARGETS


class Report:
    """The JSON being built; written atomically after each section and by the watchdog."""

    def __init__(self, out_dir: Path):
        self.path = out_dir / "gpu_check.json"
        self.data: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "sections": {}}
        self.lock = threading.Lock()

    def write(self) -> None:
        with self.lock:
            atomic_write_bytes(self.path, json.dumps(self.data, indent=1, default=str).encode())


def watchdog(report: Report, deadline: float, done: threading.Event) -> None:
    """Write what exists and exit hard if ``main`` has not finished by ``deadline``."""
    if done.wait(max(0.0, deadline - time.time())):
        return  # main finished (or returned early): nothing to do
    report.data["aborted"] = "watchdog: run exceeded its time budget by 45 s (a hung kernel?)"
    report.write()
    print(f"gpu_check: watchdog fired, partial results in {report.path}", file=sys.stderr, flush=True)
    os._exit(3)


def versions() -> dict:
    """Python, platform, torch, CuPy, NVRTC and driver versions (a missing one says why)."""
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


def targets_summary(report: Report) -> dict:
    """Each ``TARGETS`` entry with the measured speed-up over dense (None if not measured) and whether it is met."""
    recs = report.data["sections"].get("bench", {}).get("records", [])
    out = {}
    for label, ((op, model, m, s), want) in TARGETS.items():
        hit = [r for r in recs if r.get("op") == op and r.get("model") == model and r.get("m") == m
               and r.get("sparsity") == s and r.get("mask") == "random" and "speedup_vs_dense" in r
               and (op != "attn_decode" or r.get("slots") == 32768)]  # fmt: skip
        got = hit[0]["speedup_vs_dense"] if hit else None
        out[label] = {"target": want, "measured": got, "met": got is not None and got >= want}
    return out


def print_summary(report: Report) -> None:
    """The device, the check totals and a table of the bench speed-ups, on stdout."""
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
