"""Progress inside long evaluation loops, with an ETA, on stderr (never stdout: ``--json`` stays
one object).

The loops (``token_perplexity``, ``loglikelihoods``) call ``tracker(total)`` and advance it by the
tokens they processed; nothing is shown unless a command turned progress on with ``enabled()``
(the library and the tests stay silent). ``label(text)`` names the current model and task. On a
terminal this is a Rich progress bar; otherwise (logs, CI) one plain line per task at most every
``LOG_EVERY_S`` seconds, plus a final one, so a log shows where a 25-minute evaluation is.
"""

from __future__ import annotations

import contextlib
import time

LOG_EVERY_S = 30.0

_state = {"on": False, "label": "", "console": None, "progress": None}


@contextlib.contextmanager
def enabled(console=None):
    """Show progress of every tracked loop inside the block (``console``: a stderr Rich Console)."""
    from rich.console import Console

    console = console or Console(stderr=True)
    prev = dict(_state)
    _state.update(on=True, console=console, progress=None)
    try:
        yield
    finally:
        if _state["progress"] is not None:
            _state["progress"].stop()
        _state.clear()
        _state.update(prev)


@contextlib.contextmanager
def label(text: str):
    """Name the work of the loops inside the block (e.g. ``"runs/x/export: piqa"``)."""
    prev = _state["label"]
    _state["label"] = text
    try:
        yield
    finally:
        _state["label"] = prev


def _fmt_s(s: float) -> str:
    s = round(s)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class _Tracker:
    def __init__(self, total: int, unit: str):
        self.total, self.unit, self.done = max(int(total), 1), unit, 0
        self.t0 = self.last_log = time.perf_counter()
        self.desc = _state["label"] or "evaluating"
        self.console = _state["console"]
        self.task = None
        if self.console is not None and self.console.is_terminal:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            if _state["progress"] is None:
                _state["progress"] = Progress(
                    TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn(unit), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                    console=self.console, transient=False,
                )
                _state["progress"].start()
            self.task = _state["progress"].add_task(self.desc, total=self.total)

    def eta(self) -> float:
        el = time.perf_counter() - self.t0
        return el / self.done * (self.total - self.done) if self.done else float("nan")

    def line(self) -> str:
        el = time.perf_counter() - self.t0
        pct = 100.0 * self.done / self.total
        eta = "?" if not self.done else _fmt_s(self.eta())
        return f"{self.desc}: {self.done}/{self.total} {self.unit} ({pct:.0f} %), {_fmt_s(el)} elapsed, ETA {eta}"

    def advance(self, n: int) -> None:
        self.done = min(self.done + int(n), self.total)
        if self.task is not None:
            _state["progress"].update(self.task, completed=self.done)
        elif self.console is not None and time.perf_counter() - self.last_log >= LOG_EVERY_S:
            self.last_log = time.perf_counter()
            self.console.print(self.line(), highlight=False, soft_wrap=True)

    def close(self) -> None:
        if self.task is None and self.console is not None and time.perf_counter() - self.t0 >= LOG_EVERY_S:
            self.console.print(self.line(), highlight=False, soft_wrap=True)


class _Null:
    def advance(self, n: int) -> None:
        pass


@contextlib.contextmanager
def tracker(total: int, unit: str = "tokens"):
    """A progress counter of ``total`` units for one loop; yields an object with ``advance(n)``.
    A no-op unless inside ``enabled()``."""
    if not _state["on"]:
        yield _Null()
        return
    t = _Tracker(total, unit)
    try:
        yield t
    finally:
        t.close()
