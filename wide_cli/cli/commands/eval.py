"""`wide eval TARGET...`: perplexity + zero-shot tasks for dense models and exports, side by side."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from wide_cli.cli.options import Device, Dtype, JsonOpt, ThreadsOpt, TrustRemoteCodeOpt
from wide_cli.filenames import MANIFEST

Targets = Annotated[list[str] | None, typer.Argument(
    help="Models to compare, in order: export directories and/or model specs (alias, HF id, local dir, "
         ".gguf). The first dense one is the reference for '% of dense'.")]
TasksOpt = Annotated[str | None, typer.Option(
    "--tasks", help="Comma-separated: wikitext, arc_easy, arc_challenge, piqa, hellaswag, boolq, winogrande, "
                    "openbookqa (default: all; with --eval-data, none: just the file).")]
DataDirOpt = Annotated[Path | None, typer.Option(
    "--data-dir", help="Directory with wikitext-2-raw/ and zeroshot/ (default: ../shared/data if present).")]
LimitOpt = Annotated[int | None, typer.Option(
    "--limit", help="First N items per zero-shot task and first N WikiText pages (default: all).")]
EvalSeqLenOpt = Annotated[int | None, typer.Option(
    "--seq-len", help="Perplexity window in tokens (default: min(2048, model context)).")]
StrideOpt = Annotated[int | None, typer.Option(
    "--stride", help="Perplexity stride < seq-len for sliding windows (default: non-overlapping).")]
EvalBatchOpt = Annotated[int | None, typer.Option("--batch-size", help="Requests/windows per forward (default 4).")]
EvalDataOpt = Annotated[Path | None, typer.Option(
    "--eval-data", help="Any UTF-8 text file: token-level perplexity (alone unless --tasks is given).")]
ReportOutOpt = Annotated[Path | None, typer.Option(
    "--out", help="Write report.json, report.md and sparsity plots here (default: nothing written).")]

DEFAULT_BATCH_SIZE = 4
DEFAULT_DTYPE = "fp32"
DEFAULT_DEVICE = "cpu"


def default_data_dir() -> Path | None:
    """``../shared/data`` relative to the working directory, when it exists."""
    p = Path.cwd().parent / "shared" / "data"
    return p if p.is_dir() else None


def eval_cmd(
    targets: Targets = None,
    run_dir: Annotated[Path | None, typer.Option(
        "--run-dir", help="Evaluate a run's stage (dense vs its export, on the run's eval data) instead of TARGETs.")] = None,
    tasks: TasksOpt = None,
    data_dir: DataDirOpt = None,
    limit: LimitOpt = None,
    seq_len: EvalSeqLenOpt = None,
    stride: StrideOpt = None,
    batch_size: EvalBatchOpt = None,
    dtype: Dtype = None,
    device: Device = None,
    eval_data: EvalDataOpt = None,
    out: ReportOutOpt = None,
    cache_dir: Annotated[Path | None, typer.Option(
        "--cache-dir", help="Reuse each model's results from DIR when model, data, settings and code match; store new ones there.")] = None,
    trust_remote_code: TrustRemoteCodeOpt = False,
    threads: ThreadsOpt = None,
    json_out: JsonOpt = False,
):
    """Evaluate models: WikiText-2 perplexity (token-level and lm-eval word-level), zero-shot
    accuracy (acc and acc_norm), measured sparsity and routed FLOPs, in one table."""
    from wide_cli.cli import render
    from wide_cli.cli.logging_setup import quiet_libraries
    from wide_cli.eval import run
    from wide_cli.eval.report import render_table

    quiet_libraries()
    from wide_cli.cli.threads import apply_threads

    apply_threads(threads)
    if run_dir is not None:
        return _eval_run(run_dir, json_out)
    if not targets:
        from wide_cli.errors import ConfigError

        raise ConfigError("no TARGET given", "pass models/exports to compare, or --run-dir RUN for a run's eval stage")
    from wide_cli.eval import progress

    if tasks is None:
        # with --eval-data the user asks for their file's perplexity, not for the benchmark data
        # (which a clone without ../shared does not have)
        task_list = [] if eval_data is not None else list(run.DEFAULT_TASKS)
    else:
        task_list = [t.strip() for t in tasks.split(",") if t.strip()]
    with progress.enabled(render.err):
        report = _evaluate(run, targets, task_list, data_dir, limit, seq_len, stride, batch_size, dtype, device,
                           eval_data, out, cache_dir, trust_remote_code=trust_remote_code)
    render.err.print(render_table(report))
    if out is not None:
        render.log(f"report written to {out / 'report.json'} and {out / 'report.md'}")
    else:
        render.log("pass --out DIR to write report.json, report.md and the sparsity plots")
    if json_out:
        render.emit_json(report)


def _evaluate(run, targets, task_list, data_dir, limit, seq_len, stride, batch_size, dtype, device, eval_data, out,
              cache_dir, *, trust_remote_code: bool = False) -> dict:
    """``evaluate_targets`` with the command's defaults filled in."""
    return run.evaluate_targets(
        targets,
        tasks=task_list,
        data_dir=data_dir if data_dir is not None else default_data_dir(),
        limit=limit,
        seq_len=seq_len,
        stride=stride,
        batch_size=batch_size if batch_size is not None else DEFAULT_BATCH_SIZE,
        dtype=dtype or DEFAULT_DTYPE,
        device=device or DEFAULT_DEVICE,
        eval_data=eval_data,
        out_dir=out,
        cache_dir=cache_dir,
        trust_remote_code=trust_remote_code,
    )


def _eval_run(run_dir: Path, json_out: bool) -> None:
    """Stage 4/4 of a run: dense vs pruned token-level perplexity and measured sparsity."""
    from wide_cli.cli import render
    from wide_cli.cli.commands.stages import _settings_for_run
    from wide_cli.pipeline import stages
    from wide_cli.pipeline.rundir import run_lock

    run, settings = _settings_for_run(run_dir, None, {})
    export_dir = run.default_export if (run.default_export / MANIFEST).is_file() else None
    with run_lock(run):
        report = stages.evaluate(settings, run, export_dir)
    render.log(
        f"perplexity dense {report['dense']['perplexity']:.2f} -> pruned {report['pruned']['perplexity']:.2f} "
        f"({report['unit']}, {report['protocol']}); measured sparsity {report['sparsity']['total']:.3f}; "
        f"report in {run.eval / 'report.json'}"
    )
    if json_out:
        render.emit_json(report)
