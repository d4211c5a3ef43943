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


def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


def render_markdown(data: dict, command: str) -> str:
    """The results page of one ``gpu_check.json``: checks, targets, and every bench speed-up over
    the dense op (cuBLAS ``F.linear`` / ``scaled_dot_product_attention``, CUDA-graph replays)."""
    dev, ver = data.get("device", {}), data.get("versions", {})
    chk = data["sections"].get("check", {})
    recs = [r for r in data["sections"].get("bench", {}).get("records", []) if r.get("speedup_vs_dense")]
    lines = [
        "# CUDA kernels on one GPU: checks against the reference and speed against cuBLAS",
        "",
        f"Command: `{command}` (written by `python -m wide_cli.gpu_check`; raw numbers in `gpu_check.json`).",
        "",
        (f"Device: {dev.get('name')} ({dev.get('sms')} SMs, {dev.get('memory_gb')} GiB, {dev.get('l2_mb')} MB L2), "
        f"torch {ver.get('torch')}, CuPy {ver.get('cupy')}, NVRTC {ver.get('nvrtc')}; {data.get('seconds')} s in all."),
        "",
        "## Checks",
        "",
        (f"{chk.get('passed', 0)} of {chk.get('cases', 0)} operator cases match their PyTorch reference (fp32 on the "
        f"same inputs; relative Frobenius error within 1e-2 for bf16, 2e-3 for fp16; skipped outputs exact zeros); "
        f"{len(chk.get('failed', []))} failed, {chk.get('skipped_budget', 0)} skipped for time."),
        "",
        "## Targets (kernel over the dense op, random masks)",
        "",
        "| target | wanted | measured | met |",
        "|---|---|---|---|",
    ]  # fmt: skip
    for label, t in data.get("targets", {}).items():
        lines.append(f"| {label} | {t['target']:.2f}x | {_x(t['measured'])} | {'yes' if t['met'] else 'no'} |")
    sp = sorted({r["sparsity"] for r in recs if r["op"] != "attn_prefill"})
    lines += [
        "",
        "## Routed GEMMs: kernel over cuBLAS, by tokens M and share of groups skipped s",
        "",
        (f"Random masks; each cell is the kernel's CUDA-graph time over the dense `F.linear`'s. The last column is "
        f"what the default dispatch runs at s = 0.5 (`WIDE_CUPY_GEMV_MAX_M` = {data.get('auto_gemv_max_m')}, "
        f"`WIDE_CUPY_DENSE_ABOVE` = {data.get('auto_dense_threshold')}); `cuBLAS on the masked input` computes "
        f"the same function at the dense op's speed; in brackets, the default call's time over the dense op's."),
        "",
        "| model | op | M | " + " | ".join(f"s={s:g}" for s in sp) + " | default at s=0.5 |",
        "|---|---|---|" + "---|" * len(sp) + "---|",
    ]  # fmt: skip
    gemm = {}
    for r in recs:
        if r["op"] not in ("attn_decode", "attn_prefill") and r["mask"] == "random":
            gemm[(r["model"], r["op"], r["m"], r["sparsity"])] = r
    for model, op, m in sorted({k[:3] for k in gemm}, key=lambda k: (k[0], k[1], k[2])):
        cells = [_x(gemm[(model, op, m, s)]["speedup_vs_dense"]) if (model, op, m, s) in gemm else "-" for s in sp]
        half = gemm.get((model, op, m, 0.5), {})
        dflt = half.get("default_speedup_vs_dense")
        lines.append(f"| {model} | {op} | {m} | " + " | ".join(cells) + f" | {half.get('default_dispatch', '-')}"
                     + (f" ({_x(dflt)})" if dflt else "") + " |")  # fmt: skip
    lines += [
        "",
        "## Attention: kernel over `scaled_dot_product_attention`",
        "",
        "| model | op | rows (decode) or tokens (prefill) | context | s | kernel ms | dense ms | speed-up | default dispatch |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in recs:
        if r["op"] in ("attn_decode", "attn_prefill") and r["mask"] == "random":
            k, d = r["kernel_graph_ms"] or r["kernel_ms"], r["dense_graph_ms"] or r["dense_ms"]
            lines.append(f"| {r['model']} | {r['op']} | {r['m']} | {r.get('slots') or r['m']} | {r['sparsity']:g} | "
                         f"{k:.4f} | {d:.4f} | {_x(r['speedup_vs_dense'])} | {_x(r.get('default_speedup_vs_dense'))} |")  # fmt: skip
    e2e = data["sections"].get("e2e")
    if e2e and "runs" in e2e:
        lines += ["", f"## End to end: `{e2e['export']}` on the cupy backend, routed over dense (same backend)", ""]
        lines += ["| run | prefill speed-up (1 x 1024 tokens) | decode speed-up (8 rows x 32 steps) |", "|---|---|---|"]
        for label in ("routed", "forced_s0.5"):
            lines.append(f"| {label} | {_x(e2e.get(f'{label}_prefill_speedup'))} | "
                         f"{_x(e2e.get(f'{label}_decode_speedup'))} |")  # fmt: skip
        if "logits_rel_err_vs_reference" in e2e:
            lines += ["", (f"Logits against the reference backend (bf16, 2 x 64 tokens): relative error "
                      f"{e2e['logits_rel_err_vs_reference']:.4f}, argmax agreement {e2e['argmax_agreement']:.3f}. "
                      f"Dispatch: {', '.join(f'{k} {n}' for k, n in e2e.get('dispatch', {}).items() if n) or '-'}.")]  # fmt: skip
    return "\n".join(lines) + "\n"
