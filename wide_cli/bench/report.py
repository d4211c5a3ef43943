"""What ``wide bench`` reports: one ``BenchEntry`` per (system, threads, shape), the speedups
between rows, and the ``BenchReport`` (its ``to_dict`` is the ``--json`` document)."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

from wide_cli.bench.config import BenchConfig


@dataclass
class BenchEntry:
    """One (system, threads, shape) measurement.

    ``system`` is the row label (``cpu int8``, ``dense bf16``, ``hf fp32``, ``llama.cpp Q8_0``);
    ``kind`` the system (``cpu``, ``dense``, ``reference``, ``hf``, ``llama.cpp``), ``weights``
    its weight format.
    """

    system: str
    kind: str
    weights: str
    threads: int
    phase: str  # prefill | decode
    batch: int
    prompt_len: int
    new_tokens: int
    seconds: list[float]
    tokens: int  # tokens processed per timed run
    measured_sparsity: dict | None = None
    skips_work: bool = False
    executed_mac_fraction: float | None = None
    ideal_speedup: float | None = None
    speedup_vs_hf: float | None = None
    speedup_vs_dense: float | None = None
    weight_bytes_per_step: float | None = None
    path: str | None = None  # runtime rows: native (C decode step) or torch; None for HF, llama.cpp

    @property
    def shape(self) -> str:
        return f"prefill {self.prompt_len}" if self.phase == "prefill" else f"decode b{self.batch}"

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.median_s

    @property
    def ms_per_step(self) -> float:
        """Decode: ms per step (one token per row); prefill: ms for the whole prompt."""
        steps = self.new_tokens if self.phase == "decode" else 1
        return 1e3 * self.median_s / steps

    @property
    def gb_per_s(self) -> float | None:
        """Weight bytes read per second (decode only: the bandwidth the step achieves)."""
        if self.phase != "decode" or self.weight_bytes_per_step is None:
            return None
        return self.weight_bytes_per_step * self.new_tokens / self.median_s / 1e9

    def to_dict(self) -> dict:
        return {
            "system": self.system,
            "kind": self.kind,
            "weights": self.weights,
            "threads": self.threads,
            "shape": self.shape,
            "phase": self.phase,
            "batch": self.batch,
            "prompt_len": self.prompt_len,
            "new_tokens": self.new_tokens if self.phase == "decode" else 0,
            "tokens_per_s": self.tokens_per_s,
            "ms_per_step": self.ms_per_step,
            "median_s": self.median_s,
            "seconds": self.seconds,
            "path": self.path,
            "skips_work": self.skips_work,
            "executed_mac_fraction": self.executed_mac_fraction,
            "speedup_vs_hf": self.speedup_vs_hf,
            "speedup_vs_dense": self.speedup_vs_dense,
            f"{self.phase}_speedup_vs_hf": self.speedup_vs_hf,
            "ideal_speedup": self.ideal_speedup,
            "measured_sparsity": self.measured_sparsity,
            "weight_bytes_per_step": self.weight_bytes_per_step,
            "weight_gb_per_s": self.gb_per_s,
        }


@dataclass
class BenchReport:
    """Everything ``run_bench`` measured (``to_dict`` is the ``--json`` document)."""

    export: str
    config: BenchConfig
    entries: list[BenchEntry]
    environment: dict = field(default_factory=dict)
    weight_bytes: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    quality: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "export": self.export,
            "config": asdict(self.config),
            "environment": self.environment,
            "weight_bytes": self.weight_bytes,
            "notes": self.notes,
            "quality": self.quality,
            "results": [e.to_dict() for e in self.entries],
        }


def fill_speedups(entries: list[BenchEntry]) -> None:
    """``speedup_vs_hf``: against HF in the same format (fp32 HF for int8 and llama.cpp rows);
    ``speedup_vs_dense``: against the runtime's dense mode in the same format (fp32 for HF rows,
    int8 for llama.cpp rows; ``*-torch`` rows against ``dense-torch``). Same threads and shape."""
    by_shape: dict[tuple, dict[tuple[str, str], BenchEntry]] = {}
    for e in entries:
        by_shape.setdefault((e.threads, e.phase, e.batch, e.prompt_len), {})[(e.kind, e.weights)] = e
    for group in by_shape.values():
        for e in group.values():
            hf = group.get(("hf", e.weights)) or group.get(("hf", "fp32"))
            dense_fmt = "int8" if e.kind == "llama.cpp" else e.weights  # llama.cpp rows: against dense int8
            # the PyTorch-step rows are compared with the PyTorch dense step
            dense = group.get(("dense-torch" if e.kind.endswith("-torch") else "dense", dense_fmt))
            if hf is not None:
                e.speedup_vs_hf = e.tokens_per_s / hf.tokens_per_s
            if dense is not None:
                e.speedup_vs_dense = e.tokens_per_s / dense.tokens_per_s
