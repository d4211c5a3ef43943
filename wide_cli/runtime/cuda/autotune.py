"""Optional autotuning (``WIDE_CUPY_AUTOTUNE=1``): the measured best GEMM tile per shape.

Keyed by device, op, dtype, N, K, group size and next-pow2(M); stored in
``$WIDE_CACHE/cupy_autotune.json`` (default ``~/.cache/wide``), written atomically, so the
measurement happens once per shape and machine.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from wide_cli.atomic import atomic_write_bytes
from wide_cli.runtime.cuda.builds import GemmTile
from wide_cli.runtime.cuda.registry import REGISTRY

log = logging.getLogger("wide.cupy")


def tune_path() -> Path:
    """Where the autotune table is stored."""
    root = os.environ.get("WIDE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "wide")
    return Path(root) / "cupy_autotune.json"


def _table() -> dict[str, str]:
    if REGISTRY.tune_table is None:
        try:
            REGISTRY.tune_table = json.loads(tune_path().read_text())
        except (OSError, ValueError):
            REGISTRY.tune_table = {}
    return REGISTRY.tune_table


def _save() -> None:
    atomic_write_bytes(tune_path(), json.dumps(_table(), indent=1, sort_keys=True).encode())


def time_ms(fn: Callable[[], Any], reps: int = 5) -> float:
    """Mean CUDA-event time of ``fn`` in milliseconds over ``reps`` calls, after one warm-up."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def pick_tile(key: str, cands: list[GemmTile], default: GemmTile, run: Callable[[GemmTile], Any]) -> GemmTile:
    """The heuristic's tile, or with autotuning on the measured best (stored on disk)."""
    if not REGISTRY.autotune_enabled() or len(cands) < 2:
        return default
    table = _table()
    byname = {t.name: t for t in cands}
    if table.get(key) in byname:
        return byname[table[key]]
    times = {t.name: time_ms(lambda t=t: run(t)) for t in cands}
    best = min(times, key=times.get)
    table[key] = best
    _save()
    log.info("cupy autotune %s: %s (%s)", key, best, ", ".join(f"{k} {v:.3f} ms" for k, v in times.items()))
    return byname[best]
