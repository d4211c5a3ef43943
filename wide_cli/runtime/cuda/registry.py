"""The process-wide state of the CUDA kernels, in one object: ``REGISTRY``.

It holds what used to be a dozen module globals: compiled kernels, per-device arch and streams,
which builds were verified or disabled, fallback and dispatch counters, the autotune table, and
the settings that steer them. Settings come from the environment at call time unless a caller
overrides them for a while (``gpu-check`` does, instead of editing ``os.environ``):

- ``WIDE_CUPY_VERIFY`` (default ``1``): check the first call of every build against the reference;
- ``WIDE_CUPY_DENSE_ABOVE`` (default ``0.1``): live fraction above which large-M calls run cuBLAS
  (``1.0``: every masked call runs the kernels, whatever its size);
- ``WIDE_CUPY_GEMV_MAX_M`` (default ``2``): calls of at most this many tokens run the GEMV kernels;
  calls between it and the large-M sync run cuBLAS on the masked input;
- ``WIDE_CUPY_AUTOTUNE`` (default ``0``): measure the tile per shape instead of the heuristic;
- ``WIDE_CUPY_ARGS`` (``ptr`` or ``dlpack``, read once): how tensors are passed to kernels.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

_UNSET = object()


@dataclass
class KernelRegistry:
    """Compiled kernels and their bookkeeping for this process (see the module docstring)."""

    args_mode: str = field(default_factory=lambda: os.environ.get("WIDE_CUPY_ARGS", "ptr"))
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    kernels: dict[tuple, Any] = field(default_factory=dict, repr=False)  # build key -> cupy.RawKernel
    arch: dict[int | None, str] = field(default_factory=dict)  # device index -> "sm_XY"
    smem_set: dict[int, int] = field(default_factory=dict)  # id(kernel) -> dynamic smem limit set
    streams: dict[tuple[int, int], Any] = field(default_factory=dict, repr=False)
    broken: set[tuple] = field(default_factory=set)  # builds that disagreed with the reference
    verified: set[tuple] = field(default_factory=set)
    fallbacks: Counter = field(default_factory=Counter)  # (op, reason) -> calls
    dispatch: Counter = field(default_factory=Counter)  # (op, path) -> calls
    warned: set[tuple[str, str]] = field(default_factory=set)
    tune_table: dict[str, str] | None = None  # loaded on first use (autotune)
    _overrides: dict[str, Any] = field(default_factory=dict, repr=False)

    # ---- settings

    def verify_enabled(self) -> bool:
        """Whether the first call of each build is checked against the reference."""
        if "verify" in self._overrides:
            return self._overrides["verify"]
        return os.environ.get("WIDE_CUPY_VERIFY", "1") != "0"

    def dense_above(self) -> float:
        """Live fraction above which a large-M call runs cuBLAS on the masked input (1.0: never).

        The default comes from ``make gpu-check`` on an H200: the mask-reordered ``mma.sync``
        GEMMs beat cuBLAS only when a few percent of the work is live (``gate_up`` at M=1024 and a
        quarter live: 0.92x; ``q``/``o``/``down`` lose at every live fraction above zero).
        """
        if "dense_above" in self._overrides:
            return self._overrides["dense_above"]
        return float(os.environ.get("WIDE_CUPY_DENSE_ABOVE", "0.1"))

    def gemv_max_m(self) -> int:
        """Masked calls of at most this many tokens run the GEMV kernels (decode).

        The default comes from ``make gpu-check`` on an H200 (half the groups skipped, random masks):
        at one token the GEMV kernels took 0.5-1.1x cuBLAS's time; at two, SmolLM2-135M's
        projections 0.5-1.0x and Llama-3.1-8B's 0.7-1.6x, against 1.1-1.9x for cuBLAS plus the
        mask; from four tokens cuBLAS plus the mask was as fast or faster on the 8B shapes.
        """
        if "gemv_max_m" in self._overrides:
            return self._overrides["gemv_max_m"]
        return int(os.environ.get("WIDE_CUPY_GEMV_MAX_M", "2"))

    def autotune_enabled(self) -> bool:
        """Whether GEMM tiles are picked by measurement (stored on disk) instead of the heuristic."""
        if "autotune" in self._overrides:
            return self._overrides["autotune"]
        return os.environ.get("WIDE_CUPY_AUTOTUNE", "0") == "1"

    @contextlib.contextmanager
    def overrides(self, *, verify=_UNSET, dense_above=_UNSET, autotune=_UNSET, gemv_max_m=_UNSET):
        """Within the block, use these settings instead of the environment's; restored after.

        Args:
            verify: bool; dense_above: float in [0, 1] (1.0 always runs the kernels);
            autotune: bool; gemv_max_m: int. Arguments left out keep their current source.
        """
        pairs = (("verify", verify), ("dense_above", dense_above), ("autotune", autotune), ("gemv_max_m", gemv_max_m))
        new = {k: v for k, v in pairs if v is not _UNSET}
        saved = dict(self._overrides)
        self._overrides.update(new)
        try:
            yield self
        finally:
            self._overrides = saved

    # ---- what happened so far

    def fallback_counts(self) -> dict[str, int]:
        """``"op: reason" -> calls`` routed to the reference so far in this process."""
        return {f"{op}: {why}": n for (op, why), n in self.fallbacks.items()}

    def dispatch_counts(self) -> dict[str, int]:
        """``"op: path" -> calls`` for the kernel-vs-cuBLAS choice of masked GEMMs made so far."""
        return {f"{op}: {path}": n for (op, path), n in self.dispatch.items()}

    def broken_builds(self) -> list[str]:
        """Kernel builds disabled because their first result disagreed with the reference."""
        return sorted(str(k) for k in self.broken)


REGISTRY = KernelRegistry()
