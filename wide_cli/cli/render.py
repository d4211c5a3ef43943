"""All Rich rendering of the CLI in one place; logs and tables go to stderr, ``--json`` to stdout."""

from __future__ import annotations

import json
import os
import sys

from rich.console import Console
from rich.table import Table

# Not a terminal (CI logs, files): Rich would wrap wide tables at 80 columns, one character per
# line; render them at a fixed wide width instead (COLUMNS still wins when set).
err = Console(stderr=True, width=None if sys.stderr.isatty() or "COLUMNS" in os.environ else 250)


def log(msg: str) -> None:
    err.print(msg, highlight=False, soft_wrap=True)  # never wrapped: log lines stay greppable


def emit_json(obj) -> None:
    """Exactly one JSON object on stdout."""
    sys.stdout.write(json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()


def _fmt(v, digits=3):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def prune_summary(res: dict) -> Table:
    """The one summary table of `wide prune`."""
    t = Table(title="wide prune: summary", show_lines=False)
    t.add_column("")
    t.add_column("dense")
    t.add_column("pruned")
    ev = res["eval"]
    d, p = ev.get("dense") or {}, ev.get("pruned") or {}
    t.add_row("perplexity", _fmt(d.get("perplexity"), 2), _fmt(p.get("perplexity"), 2))
    sp = res.get("sparsity") or {}
    t.add_row("sparsity attention (measured)", "0", _fmt(sp.get("attention")))
    t.add_row("sparsity ffn (measured)", "0", _fmt(sp.get("ffn")))
    t.add_row("sparsity total (measured)", "0", _fmt(sp.get("total")))
    tr = res.get("train") or {}
    t.caption = (
        f"{ev.get('unit')} on {ev.get('data')} ({ev.get('protocol')}); "
        f"train {tr.get('steps')} steps, {tr.get('tokens')} tokens, {_fmt(tr.get('seconds'), 0)} s; "
        f"export {res['export_dir']}"
    )
    return t
