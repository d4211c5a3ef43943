"""`wide compare DENSE EXPORT...`: quality (WikiText-2 + zero-shot tasks) and measured runtime
speed of a dense model and its exports in one process; a table, report.json and a Pareto plot."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from wide_cli.cli.commands.eval import (
    DEFAULT_BATCH_SIZE,
    DataDirOpt,
    EvalBatchOpt,
    EvalSeqLenOpt,
    LimitOpt,
    TasksOpt,
    default_data_dir,
)
from wide_cli.cli.options import JsonOpt

Targets = Annotated[list[str], typer.Argument(
    help="The dense model first (alias, HF id, local dir, .gguf), then the exports to compare with it.")]


def compare_cmd(
    targets: Targets,
    tasks: TasksOpt = None,
    data_dir: DataDirOpt = None,
    limit: LimitOpt = None,
    seq_len: EvalSeqLenOpt = 256,
    batch_size: EvalBatchOpt = None,
    dtype: Annotated[str | None, typer.Option("--dtype", help="Quality evaluation dtype: fp32 | bf16 (default bf16).")] = None,
    cache_dir: Annotated[Path | None, typer.Option(
        "--cache-dir", help="Reuse each model's quality results from DIR when model, data, settings and code match.")] = None,
    backend: Annotated[str, typer.Option("--backend", help="Runtime backend of the speed runs (default cpu).")] = "cpu",
    speed_dtype: Annotated[str | None, typer.Option("--speed-dtype", help="Runtime dtype: fp32 | bf16 (default fp32).")] = None,
    new_tokens: Annotated[int, typer.Option("--new-tokens", help="Timed decode steps at batch 1.")] = 64,
    prefill_len: Annotated[int, typer.Option("--prefill-len", help="Prompt tokens of the timed prefill.")] = 1024,
    repeats: Annotated[int, typer.Option("--repeats", help="Timed rounds per system (median reported).")] = 3,
    warmup: Annotated[int, typer.Option("--warmup", help="Untimed rounds first.")] = 1,
    threads: Annotated[int, typer.Option("--threads", help="Torch CPU threads (default 1; 0 = torch's default).")] = 1,
    word_perplexity: Annotated[bool, typer.Option(
        "--word-perplexity", help="Also score lm-eval's word-level WikiText perplexity (twice the WikiText time).")] = False,
    out: Annotated[Path | None, typer.Option("--out", help="Write report.json, report.md and pareto.png here.")] = None,
    json_out: JsonOpt = False,
):
    """Compare DENSE with pruned EXPORTs: WikiText-2 perplexity, zero-shot task average, FLOPs and
    the measured decode (batch 1) and prefill speedup on the runtime, in one table and one
    Pareto plot (quality against measured decode speedup)."""
    from wide_cli.cli import render
    from wide_cli.cli.logging_setup import quiet_libraries
    from wide_cli.eval import progress, run
    from wide_cli.eval.compare import SpeedConfig, compare, table_lines

    quiet_libraries()
    speed = SpeedConfig(new_tokens=new_tokens, prefill_len=prefill_len, repeats=repeats, warmup=warmup,
                        threads=threads, dtype=speed_dtype, backend=backend)
    task_list = list(run.DEFAULT_TASKS) if tasks is None else [t.strip() for t in tasks.split(",") if t.strip()]
    with progress.enabled(render.err):
        doc = compare(list(targets), tasks=task_list, data_dir=data_dir if data_dir is not None else default_data_dir(),
                      limit=limit, seq_len=seq_len, batch_size=batch_size or DEFAULT_BATCH_SIZE, dtype=dtype or "bf16",
                      cache_dir=cache_dir, speed=speed, out_dir=out, word_perplexity=word_perplexity, log=render.log)
    from rich.table import Table

    head, cells = table_lines(doc["rows"])
    t = Table(title="wide compare: quality vs measured speed")
    for h in head:
        t.add_column(h, justify="left" if h in ("model", "method / cost point") else "right")
    for c in cells:
        t.add_row(*c)
    render.err.print(t)
    if out is not None:
        render.log(f"wrote {out / 'report.json'}, {out / 'report.md'} and {out / 'pareto.png'}")
    if json_out:
        render.emit_json(doc)
