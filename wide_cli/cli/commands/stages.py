"""`wide calibrate`, `wide train`, `wide export`: one pipeline stage each on a run directory.

`calibrate` starts a run (MODEL + settings); later stages read the run's recorded settings
(``<run-dir>/run.json``) and accept the same flags to override them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from wide_cli.cli import options
from wide_cli.filenames import ADAPTER_FILE, RUN_JSON


def _settings_for_run(run_dir: Path, recipe: str | None, flags: dict, model: str | None = None):
    from wide_cli.errors import CheckpointError, ConfigError
    from wide_cli.pipeline.rundir import RunDir
    from wide_cli.pipeline.settings import apply_overrides, load_recipe, settings_from_dict
    from wide_cli.version import __version__

    run = RunDir(Path(run_dir))
    recorded = run.read_run()
    if recipe:
        base = load_recipe(recipe)
    elif recorded is not None:
        raw = dict(recorded["settings"])
        try:
            base = settings_from_dict(raw, origin=str(run.root / RUN_JSON))
        except ConfigError as e:
            by = recorded.get("wide_version")
            if not _newer(by):
                raise
            raise ConfigError(e.message, f"the run was written by wide {by}, this is wide {__version__}: upgrade wide, "
                                         "or start a new --run-dir") from None
    else:
        raise CheckpointError(f"{run.root} holds no run (run.json missing)", "start with `wide calibrate MODEL --run-dir ...`")
    over = {options.FLAG_FIELDS[k]: v for k, v in flags.items() if k in options.FLAG_FIELDS}
    if model is not None:
        over[("model", "name")] = model
    from wide_cli.pipeline.common import effective_settings

    return run, effective_settings(apply_overrides(base, over))


def _newer(version: str | None) -> bool:
    """True when ``version`` (a recorded ``wide_version``) is newer than this wide."""
    from packaging.version import InvalidVersion, Version

    from wide_cli.version import __version__

    try:
        return version is not None and Version(version) > Version(__version__)
    except InvalidVersion:
        return False


def calibrate_cmd(
    model: options.ModelArg,
    run_dir: Annotated[Path, typer.Option("--run-dir", help="Run directory to create or reuse.")],
    recipe: options.RecipeOpt = None,
    data: options.Data = None,
    heldout_fraction: options.HeldoutFraction = None,
    max_train_tokens: options.MaxTrainTokens = None,
    self_generated: options.SelfGenerated = None,
    self_generated_text: options.SelfGeneratedText = None,
    method: options.Method = None,
    cost_target: options.CostTarget = None,
    cost_metric: options.CostMetric = None,
    drop_layers: options.DropLayers = None,
    sparsity: options.Sparsity = None,
    attn_group_size: options.AttnGroup = None,
    ffn_group_size: options.FfnGroup = None,
    seq_len: options.SeqLen = None,
    batch_size: options.BatchSize = None,
    dtype: options.Dtype = None,
    device: options.Device = None,
    resume: options.ResumeOpt = False,
    threads: options.ThreadsOpt = None,
    json_out: options.JsonOpt = False,
):
    """Stage 1/4: tokenise + pack the data (cached) and collect per-group activation statistics."""
    from wide_cli.cli import render
    from wide_cli.cli.logging_setup import quiet_libraries
    from wide_cli.cli.threads import apply_threads
    from wide_cli.pipeline import stages
    from wide_cli.pipeline.common import effective_settings
    from wide_cli.pipeline.rundir import RunDir, run_lock

    flags = {k: v for k, v in locals().items() if k in options.FLAG_FIELDS}
    settings = effective_settings(options.resolve_settings(model, recipe, flags))
    apply_threads(threads)
    quiet_libraries()
    run = RunDir(run_dir)
    with run_lock(run):
        res = stages.calibrate(settings, run, resume=resume)
    out = {"run_dir": str(run.root), "train_sequences": res.train_sequences,
           "heldout_sequences": res.heldout_sequences, "tokens": res.tokens,
           "statistics": str(res.statistics) if res.statistics.is_file() else None, "seconds": round(res.seconds, 1)}
    render.log(f"calibrated: {res.train_sequences} train / {res.heldout_sequences} held-out sequences, "
               + (f"statistics in {res.statistics}" if out["statistics"] else
                  "no group statistics (static-depth ranks layers by Block Influence in `wide train`)"))
    if json_out:
        render.emit_json(out)


def train_cmd(
    run_dir: Annotated[Path, typer.Option("--run-dir", help="Run directory made by `wide calibrate`.")],
    recipe: options.RecipeOpt = None,
    stage: Annotated[int, typer.Option("--stage", help="1 = routers; 2 = LoRA recovery (+ routers).")] = 1,
    steps: options.Steps = None,
    batch_size: options.BatchSize = None,
    grad_accum: options.GradAccum = None,
    lr: options.Lr = None,
    seed: options.Seed = None,
    tau_start: options.TauStart = None,
    tau_end: options.TauEnd = None,
    cost_target: options.CostTarget = None,
    cost_metric: options.CostMetric = None,
    sparsity_warmup: options.SparsityWarmup = None,
    standin: options.Standin = None,
    distill: options.Distill = None,
    distill_temperature: options.DistillTemperature = None,
    lora_joint: options.LoraJoint = None,
    sparsity_weight: options.SparsityWeight = None,
    checkpoint_every: options.CheckpointEvery = None,
    grad_checkpointing: options.GradCheckpointing = None,
    max_memory: options.MaxMemory = None,
    train_dtype: options.TrainDtype = None,
    router_init: options.RouterInit = None,
    lora_steps: options.LoraSteps = None,
    lora_lr: options.LoraLr = None,
    lora_rank: options.LoraRank = None,
    lora_alpha: options.LoraAlpha = None,
    freeze_routers: options.FreezeRouters = None,
    resume: options.ResumeOpt = False,
    threads: options.ThreadsOpt = None,
    json_out: options.JsonOpt = False,
):
    """Stage 2/4: train the routers (stage 1) or LoRA + routers (stage 2) on a calibrated run."""
    from wide_cli.cli import render
    from wide_cli.cli.logging_setup import quiet_libraries
    from wide_cli.errors import ConfigError
    from wide_cli.pipeline import stages

    flags = {k: v for k, v in locals().items() if k in options.FLAG_FIELDS}
    if stage not in (1, 2):
        raise ConfigError(f"--stage {stage} unknown", "use 1 (routers) or 2 (LoRA recovery)")
    if stage == 2:
        flags["lora"] = True
    run, settings = _settings_for_run(run_dir, recipe, flags)
    quiet_libraries()
    from wide_cli.cli.threads import apply_threads
    from wide_cli.pipeline.rundir import rank0_lock
    from wide_cli.train import distributed

    apply_threads(threads)
    info = distributed.init(settings.model.device)  # under torchrun: every rank trains, rank 0 writes
    with rank0_lock(run):
        if stage == 1:
            res = stages.train(settings, run, resume=resume, progress=info.is_main)
        else:
            from wide_cli.pipeline.stage2 import train_stage2

            res = train_stage2(settings, run, resume=resume, progress=info.is_main)
        distributed.barrier()
    if not info.is_main:  # rank 0 reports
        return
    render.log(f"trained stage {stage}: {res.steps} steps, {res.tokens} tokens, {res.seconds:.1f} s")
    if json_out:
        render.emit_json({"run_dir": str(run.root), "stage": stage, **res.to_dict()})


def export_cmd(
    run_dir: Annotated[Path, typer.Option("--run-dir", help="Run directory with trained routers.")],
    out: options.OutOpt = None,
    export_format: Annotated[str, typer.Option(
        "--format", help="wide (default: base config + routers.safetensors, for wide's loaders) | "
        "hf (loads in plain transformers with trust_remote_code; static width physically smaller) | "
        "gguf (one *.gguf file for llama.cpp / Ollama; exports without routers: static depth).")] = "wide",
    lora: Annotated[bool | None, typer.Option(
        "--lora/--no-lora", help="Merge the run's stage-2 LoRA (default: when `wide train --stage 2` ran).")] = None,
    weights: Annotated[str, typer.Option(
        "--weights", help="fp32 (default) | int8 | int4: store int8 (Q8_0-like) or int4 (Q4_0-like) projections "
        "with their scales for the runtime (`wide generate` / `wide bench`; --format wide), or Q8_0 / Q4_0 "
        "matrices with --format gguf (F16 otherwise).")] = "fp32",
    importance: Annotated[bool, typer.Option(
        "--importance/--no-importance", help="With --weights int4: choose each block's scale by the error weighted "
        "with the inputs' mean squares on the run's training data (same bytes, lower perplexity); "
        "--no-importance keeps the plain rule.")] = True,
    threads: options.ThreadsOpt = None,
    json_out: options.JsonOpt = False,
):
    """Stage 3/4: write the deployable export (weights, routers, wide_config, model card, manifest)."""
    from wide_cli.cli import render
    from wide_cli.cli.logging_setup import quiet_libraries
    from wide_cli.errors import ConfigError
    from wide_cli.export.writer import EXPORT_FORMATS
    from wide_cli.pipeline import stages
    from wide_cli.pipeline.rundir import run_lock

    formats = (*EXPORT_FORMATS, "gguf")
    if export_format not in formats:
        raise ConfigError(f"--format {export_format!r} unknown", f"choose one of {', '.join(formats)}")
    if weights not in ("fp32", "int8", "int4"):
        raise ConfigError(f"--weights {weights!r} unknown for an export", "choose fp32, int8 or int4")
    if weights != "fp32" and export_format == "hf":
        raise ConfigError(f"--weights {weights} is stored only in --format wide exports (for wide's runtime) and as "
                          f"{stages.GGUF_TYPE_OF_WEIGHTS[weights]} in --format gguf", "drop --format hf, or export fp32 weights")
    run, settings = _settings_for_run(run_dir, None, {"lora": lora})
    if lora and not (run.stage2 / ADAPTER_FILE).is_file():
        raise ConfigError(f"--lora: {run.stage2} holds no trained adapter",
                          f"run `wide train --run-dir {run.root} --stage 2` first, or drop --lora")
    quiet_libraries()
    from wide_cli.cli.threads import apply_threads

    apply_threads(threads)
    if export_format == "gguf":
        dest = out or run.default_export.with_suffix(".gguf")
        with run_lock(run):
            path = stages.export_gguf(settings, run, dest, weight_format=weights)
        size = path.stat().st_size
        render.log(f"exported {path} ({size / 1e6:.1f} MB, {stages.GGUF_TYPE_OF_WEIGHTS[weights]}) for llama.cpp")
        if json_out:
            render.emit_json({"export_file": str(path), "bytes": size, "gguf_type": stages.GGUF_TYPE_OF_WEIGHTS[weights]})
        return
    dest = out or run.default_export
    with run_lock(run):
        res = stages.export(settings, run, dest, export_format=export_format, weight_format=weights,
                            importance=importance)
    render.log(f"exported {len(res.files)} files ({res.bytes / 1e6:.1f} MB) to {res.path}")
    if json_out:
        render.emit_json({"export_dir": str(res.path), "files": res.files, "bytes": res.bytes,
                          "export_id": res.export_id})
