"""Section 4, ``e2e`` (with ``--export``): prefill and decode tokens/s of an exported model on the
``cupy`` backend, routed vs dense, and its logits against the ``reference`` backend."""

from __future__ import annotations

import statistics
import time

from wide_cli.gpu_check.measure import fallbacks_since
from wide_cli.gpu_check.report import Report


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

            runs[label]["ideal_decode_speedup"] = decode_speedup_bound(
                rt.shape(), runs[label]["measured_sparsity"]
            )
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
    sec["fallbacks"] = fallbacks_since(before)


def _ref_backend():
    from wide_cli.runtime.reference import ReferenceBackend

    return ReferenceBackend(device="cuda")
