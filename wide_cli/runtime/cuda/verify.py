"""Never a wrong answer: reference fallbacks and first-use verification of each kernel build.

Shapes, dtypes or layouts a kernel does not support go to the PyTorch reference (logged once per
reason, counted in ``REGISTRY.fallback_counts()``). With verification on (``WIDE_CUPY_VERIFY=1``,
the default) the first call of every build is also computed by the reference and compared; a
build that disagrees is disabled and logged as an error (``REGISTRY.broken_builds()``), and the
reference result is returned.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from wide_cli.runtime.cuda.registry import REGISTRY

log = logging.getLogger("wide.cupy")

VERIFY_TOL = {"bf16": 2e-2, "fp16": 5e-3}  # relative Frobenius error vs the reference


def fallback(op: str, why: str, ref: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Run the PyTorch reference instead of a kernel, logging the reason once."""
    REGISTRY.fallbacks[(op, why)] += 1
    if (op, why) not in REGISTRY.warned:
        REGISTRY.warned.add((op, why))
        log.warning("cupy %s: %s; using the PyTorch reference for this shape", op, why)
    return ref()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error ``|out - ref| / |ref|`` in fp32 (inf when only ``out`` is not finite)."""
    o, r = out.float(), ref.float()
    if not torch.isfinite(o).all() and torch.isfinite(r).all():
        return float("inf")
    return float((o - r).norm() / r.norm().clamp_min(1e-12)) if r.numel() else 0.0


def checked(
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
    if key in REGISTRY.broken:
        return ref()
    if key in REGISTRY.verified or not REGISTRY.verify_enabled():
        return run()
    out, expect = run(), ref()
    err = rel_err(out if written is None else written(out), expect)
    if err <= VERIFY_TOL[dtype]:
        REGISTRY.verified.add(key)
        return out
    REGISTRY.broken.add(key)
    log.error("cupy kernel %s disagrees with the reference (relative error %.3g); disabled", key, err)
    return expect
