"""One function per pipeline stage (DESIGN.md §2). Each reads and writes the run directory and
returns a small result; ``prune`` (pipeline/prune.py) only composes them. The routers of a run
(attach, initialise, save, reload) are ``pipeline/routers.py``; what stages share is
``pipeline/common.py``.

calibrate -> <run>/calibration/  packed data cache, per-group activation statistics
train     -> <run>/stage1/       routers (+ checkpoint for --resume)
stage 2   -> <run>/stage2/       LoRA + routers (``pipeline/stage2.py``)
export    -> <out>/              deployable checkpoint
evaluate  -> <run>/eval/         report.json (dense vs pruned perplexity, measured sparsity)
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from wide_cli.artifacts import is_router_tensor
from wide_cli.atomic import atomic_write_json
from wide_cli.errors import CheckpointError, ConfigError
from wide_cli.filenames import ADAPTER_FILE, CONFIG_JSON, RESULT_JSON, STATS_FILE
from wide_cli.pipeline.common import load_backbone, packed_data, shareable, shareable_settings, stage_identity
from wide_cli.pipeline.routers import (
    attach,
    calibrate_skip_offset,
    init_routers_from_statistics,
    init_standins_from_statistics,
    load_stats,
    routed_model_from_run,
    save_routers,
    standardize_router_inputs,
)
from wide_cli.pipeline.rundir import RunDir, model_identity, record_run
from wide_cli.pipeline.settings import Settings
from wide_cli.routing.measure import batches_of, measure_sparsity

log = logging.getLogger("wide")


# ----------------------------------------------------------------------------- calibrate
@dataclass
class CalibrationResult:
    """``train_sequences`` / ``heldout_sequences``: packed sequence counts; ``tokens``: tokens
    in the packed data; ``statistics``: path of the per-group statistics."""

    train_sequences: int
    heldout_sequences: int
    tokens: int
    statistics: Path
    seconds: float


def calibrate(settings: Settings, run: RunDir, *, resume: bool = False, loaded=None, max_batches: int = 16):
    """Tokenise and pack the training data (cached) and collect per-group activation statistics
    of the dense model on up to ``max_batches`` x ``batch_size`` training sequences.

    Raises:
        DataError: missing/empty/too-short data. CheckpointError: run dir of another model.
    """
    import time

    from wide_cli.calibrate.statistics import GroupStatistics, collect_statistics

    t0 = time.perf_counter()
    loaded = loaded or load_backbone(settings)
    record_run(run, settings.to_dict(), model_identity(loaded), resume=resume)
    packed = packed_data(settings, loaded.tokenizer, run, model=loaded.model)  # the dense model, before any pruning
    # hybrid: statistics (router init, stand-ins) of the layers that stay, in the pruned model
    from wide_cli.pipeline.static_depth import apply_drop_layers

    apply_drop_layers(settings, run, loaded, packed=packed)
    stats_path = run.calibration / STATS_FILE
    # static-depth ranks whole layers by Block Influence in its train stage: no group statistics
    needs_stats = settings.routing.method != "static-depth"
    if needs_stats and not (resume and stats_path.is_file()):
        stats = collect_statistics(
            loaded.model, packed.train, batch_size=settings.train.batch_size, max_batches=max_batches
        )
        stats.save(stats_path)
    elif needs_stats:
        GroupStatistics.load(stats_path)  # validates it is readable
    res = CalibrationResult(
        len(packed.train), len(packed.heldout), int(packed.train.numel() + packed.heldout.numel()),
        stats_path, time.perf_counter() - t0,
    )
    atomic_write_json(
        run.calibration / "calibration.json",
        {**packed.meta, "train_sequences": res.train_sequences, "heldout_sequences": res.heldout_sequences},
    )
    return res


# ----------------------------------------------------------------------------- train
def train(settings: Settings, run: RunDir, *, resume: bool = False, loaded=None, progress: bool = True,
          on_step=None):
    """Stage 1: train the routers with the backbone frozen (no-op for ``dense`` and
    ``static-width``, which need no training). Writes ``<run>/stage1/routers.safetensors``.

    Returns the TrainResult (``steps=0`` when nothing trains).
    """
    from wide_cli.train.distributed import dist_info
    from wide_cli.train.loop import TrainResult, train_stage

    loaded = loaded or load_backbone(settings)
    if dist_info().is_main:
        record_run(run, settings.to_dict(), model_identity(loaded), resume=True)
    if settings.routing.method == "static-depth":
        from wide_cli.pipeline import static_depth

        return static_depth.train(settings, run, loaded=loaded, resume=resume, progress=progress)
    from wide_cli.pipeline.static_depth import apply_drop_layers

    apply_drop_layers(settings, run, loaded)
    model = loaded.model
    rcfg = settings.routing
    need_stats = (rcfg.method == "static-width" or settings.run.router_init == "calibration"
                  or rcfg.standin != "none")
    stats = load_stats(run) if need_stats else None
    attach(settings, model, stats=stats)
    run.stage1.mkdir(parents=True, exist_ok=True)
    joint = settings.stage2.joint and rcfg.method not in ("dense", "static-width")
    if rcfg.method in ("dense", "static-width"):
        res = TrainResult(0, 0, 0.0)
    else:
        # the cost target as a skip fraction of the routed model at the training length: where the
        # routers start, what the loss drives (train_stage converts it the same way) and where the
        # offset lands
        target = rcfg.skip_target(model.wide_routing.shape, settings.train.seq_len)
        packed = packed_data(settings, loaded.tokenizer, run)
        if rcfg.router_input == "standardized":
            standardize_router_inputs(model, packed.train, batch_size=settings.eval.batch_size)
        if settings.run.router_init == "calibration":
            init_routers_from_statistics(model, stats, target)
        if rcfg.standin != "none":
            init_standins_from_statistics(model, stats)
        if rcfg.standin_rank:
            from wide_cli.calibrate.lowrank import fit_lowrank_standins

            fit_lowrank_standins(model, packed.train, batch_size=settings.eval.batch_size)
        for n, p in model.named_parameters():
            routed = is_router_tensor(n)
            p.requires_grad_(routed and (not _is_standin(n) or rcfg.standin_trained))
        from wide_cli.train import distributed

        info = distributed.dist_info()
        ident = stage_identity(settings, loaded, stage="stage1")
        train_model, groups = model, None
        if joint:
            from wide_cli.train.lora import wrap_lora

            torch.manual_seed(settings.train.seed)  # LoRA A's init draws from the global RNG
            train_model = wrap_lora(model, settings.stage2)
            for n, p in train_model.named_parameters():  # PEFT froze everything but the adapters
                if is_router_tensor(n):
                    p.requires_grad_(not _is_standin(n) or rcfg.standin_trained)
            routers = [p for n, p in train_model.named_parameters() if p.requires_grad and "lora_" not in n]
            lora = [p for n, p in train_model.named_parameters() if p.requires_grad and "lora_" in n]
            groups = [{"params": routers, "lr": settings.train.lr}, {"params": lora, "lr": settings.stage2.lr}]
        res = train_stage(
            train_model, packed.train, settings.train, stage_dir=run.stage1,
            identity=ident, resume=resume, progress=progress,
            on_step=on_step, rank=info.rank, world=info.world,
            ddp_model=distributed.wrap(train_model, settings.model.device), param_groups=groups,
        )
        if not info.is_main:
            return res
        if target is not None:
            res.final["skip_offset"] = calibrate_skip_offset(train_model, packed.train[-8:], target,
                                                             batch_size=settings.eval.batch_size)
    save_routers(model, run)
    if joint:
        from wide_cli.pipeline.stage2 import save_joint_stage2

        save_joint_stage2(train_model, run, res)
    atomic_write_json(run.stage1 / "routers.json", {"routing": settings.routing.to_dict(), "train": res.to_dict()})
    return res


def _is_standin(name: str) -> bool:
    """True for a router's stand-in tensors (``standin``, ``standin_in``, ``standin_out``)."""
    return name.endswith((".standin", ".standin_in", ".standin_out"))


# ----------------------------------------------------------------------------- measure
# ----------------------------------------------------------------------------- export
#: Training tokens the importance matrix of an int4 export is collected on (``calibrate/importance.py``):
#: what the SmolLM2-135M measurement used (64 sequences of 512, docs/results/weight-format-perplexity.md).
IMPORTANCE_TOKENS = 32768


def export(settings: Settings, run: RunDir, out: Path, *, loaded=None, metrics: dict | None = None,
           export_format: str = "wide", weight_format: str = "fp32", check_destination: bool = True,
           importance: bool = True):
    """Write the deployable export of the run to ``out`` (atomic), with sparsity measured on
    the held-out split; ``export_format`` is ``wide`` or ``hf``, ``weight_format`` ``fp32``,
    ``int8`` or ``int4`` (see ``export/writer.py``). With ``int4`` and ``importance``, each block's
    scale is chosen by the importance-weighted error (``quant.quantize_int4``), the importance
    collected on the exported model over up to ``IMPORTANCE_TOKENS`` tokens of the run's training
    split (the calibration data); ``importance=False`` keeps the plain rule.
    Returns the ExportResult.

    Raises:
        CheckpointError: the export cannot be written (disk full, permissions...); a previous
            export at ``out`` is left untouched.
    """

    from wide_cli.export.writer import export_model
    from wide_cli.routing.config import resolve_groups

    if check_destination:  # off for a caller's own temporary directory (the GGUF export)
        check_export_destination(settings, run, out)
    if settings.routing.method == "static-depth":
        from wide_cli.pipeline import static_depth

        return static_depth.export(settings, run, out, loaded=loaded or load_backbone(settings),
                                   export_format=export_format)
    from wide_cli.pipeline.static_depth import dropped_layers_of_run

    loaded, model = routed_model_from_run(settings, run, loaded=loaded)
    packed = packed_data(settings, loaded.tokenizer, run)
    heldout = packed.heldout if len(packed.heldout) else packed.train
    # at most 64 held-out sequences: the export's recorded measurement, not an evaluation
    measured = measure_sparsity(model, batches_of(heldout[:64], settings.eval.batch_size))
    state = model.wide_routing
    layout = resolve_groups(settings.routing, state.shape, warn=False)
    train_info = {}
    for stage in ("stage1", "stage2"):
        p = getattr(run, stage) / RESULT_JSON
        if p.is_file():
            r = json.loads(p.read_text())
            train_info[stage] = {k: r.get(k) for k in ("steps", "tokens", "seconds", "final")}
    wide_config = {
        "method": settings.routing.method,
        "routing": settings.routing.to_dict(),
        "layout": {
            "attn_group_size": layout.attn_group_size,
            "ffn_group_size": layout.ffn_group_size,
            "attn_groups": layout.attn_groups,
            "ffn_groups": layout.ffn_groups,
            "kv_aligned": layout.kv_aligned,
        },
        "measured_sparsity": {**measured, "data": "held-out split of " + shareable(settings.data.train)},
        # hybrid: the source model's layers this export no longer has (its config.json has the rest)
        "dropped_layers": dropped_layers_of_run(settings, run),
        "source_model": {**loaded.provenance, "spec": shareable(loaded.source), "resolved": loaded.resolved,
                         "revision": loaded.revision},
        "lora": (
            {"merged": True, "rank": settings.stage2.lora_rank, "alpha": settings.stage2.lora_alpha,
             "target_modules": list(settings.stage2.target_modules)}
            if (settings.stage2.enabled or settings.stage2.joint) and (run.stage2 / ADAPTER_FILE).is_file()
            else None
        ),
        "train": train_info,
        "settings": shareable_settings(settings.to_dict()),
        "metrics": metrics or {},
    }
    imp = imp_info = None
    if weight_format == "int4" and importance:
        from wide_cli.calibrate.importance import collect_importance

        seqs = packed.train[: max(1, IMPORTANCE_TOKENS // packed.train.shape[1])]
        imp = collect_importance(model, seqs, batch_size=settings.eval.batch_size)
        imp_info = {"tokens": int(seqs.numel()), "data": "training split of " + shareable(settings.data.train),
                    "statistic": "mean squared input per channel of each quantized matrix"}
    try:
        return export_model(model, loaded.tokenizer, Path(out), wide_config=wide_config, export_format=export_format,
                            weight_format=weight_format, importance=imp, importance_info=imp_info)
    except Exception as e:  # only failed writes are turned into a user error; the rest propagates
        reason = _write_failure(e)
        if reason is None:
            raise
        raise CheckpointError(
            f"cannot write the export to {out}: {reason}",
            "free disk space or choose another --out, then re-run `wide export`; any previous export there is "
            "untouched",
        ) from e


def check_export_destination(settings: Settings, run: RunDir, out: Path) -> None:
    """Refuse an export destination that would destroy what wide did not write (see
    ``artifacts.check_export_target``): besides a file, a link or a foreign directory, the run
    directory, anything inside it but its default ``export/``, and the model source (the local
    path given, and the local copy the run recorded) are never replaced, nor is a directory
    holding them.

    Raises:
        ConfigError: naming ``out`` and what it is.
    """
    from wide_cli.artifacts import check_export_target

    recorded = (run.read_run() or {}).get("model") or {}
    spec = Path(settings.model.name).expanduser()
    local = recorded.get("resolved_dir")
    check_export_target(out, protected=[
        ("the run directory", run.root),
        ("the model source", spec if spec.exists() else None),
        ("the model source's local copy", Path(local) if local and local != "None" else None),
    ], inside=(run.root, run.default_export))


#: ``wide export --format gguf``: the GGUF tensor type for each ``--weights`` value.
GGUF_TYPE_OF_WEIGHTS = {"fp32": "F16", "int8": "Q8_0", "int4": "Q4_0"}


def export_gguf(settings: Settings, run: RunDir, out: Path, *, weight_format: str = "fp32", loaded=None) -> Path:
    """Write the run's model as one llama.cpp GGUF file at ``out`` (atomic: temp file + rename),
    for runs whose export has no routers (static depth): F16 matrices, or Q8_0 / Q4_0 with
    ``weight_format`` ``int8`` / ``int4`` (``GGUF_TYPE_OF_WEIGHTS``). The run's ``--format wide`` export is
    written to a temp directory beside ``out`` first and converted by ``runtime/gguf_writer.py``.

    Raises:
        UnsupportedFeature: a feature llama.cpp does not run (``wide_cli.features``, row
            ``gguf``): routers, and what the run's recorded model config declares (the Gemma 3
            layer, biases, q/k norms, scaled RoPE, sliding windows), checked before anything is
            loaded, and again on the written export, before the GGUF.
        ConfigError: ``out`` is not a ``*.gguf`` path, or is something else than a GGUF file.
    """
    import os
    import shutil
    import tempfile

    from wide_cli.features import check_features, export_features, read_export_features
    from wide_cli.runtime.gguf_writer import write_gguf

    out = Path(out)
    label = f"run {run.root}"
    # the routing settings and the model config the run recorded: a routed run, or a model whose
    # layer the writer has no graph for (Gemma 3), is refused before the model is loaded
    check_features(export_features(_recorded_model_config(run), {"method": settings.routing.method,
                                                                 "routing": settings.routing.to_dict()}),
                   "gguf", label=label)
    if out.suffix != ".gguf":
        raise ConfigError(f"--out {out}: a GGUF export is one file named *.gguf", f"e.g. --out {out.with_suffix('.gguf')}")
    if out.exists() and not (out.is_file() and not out.is_symlink() and _magic(out) == b"GGUF"):
        raise ConfigError(f"--out {out} exists and is not a GGUF file", "choose another --out (wide replaces only a GGUF file)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        export(settings, run, tmp / "export", loaded=loaded, check_destination=False)
        check_features(read_export_features(tmp / "export"), "gguf", label=label)
        write_gguf(tmp / "export", tmp / out.name, GGUF_TYPE_OF_WEIGHTS[weight_format])
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp / out.name, 0o666 & ~umask)
        os.replace(tmp / out.name, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _recorded_model_config(run: RunDir) -> dict:
    """The ``config.json`` of the run's model as ``run.json`` recorded its local copy, with its
    config class defaults (``features.full_config``); ``{}`` when there is none to read (the
    written export is checked again in any case)."""
    from wide_cli.features import full_config

    local = ((run.read_run() or {}).get("model") or {}).get("resolved_dir")
    if not local or local == "None":
        return {}
    try:
        return full_config(json.loads((Path(local) / CONFIG_JSON).read_text()))
    except (OSError, ValueError, TypeError, KeyError):
        return {}


def _magic(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(4)


def _write_failure(e: Exception) -> str | None:
    """The OS reason of a failed write (disk full, file too large, permissions), else None.

    safetensors reports its own write errors as ``SafetensorError("... I/O error: <reason> (os
    error N)")``, not as OSError.
    """
    if isinstance(e, OSError):
        return e.strerror or str(e)
    if type(e).__name__ == "SafetensorError" and "I/O error: " in str(e):
        return str(e).split("I/O error: ", 1)[1]
    return None


# ----------------------------------------------------------------------------- evaluate
def check_eval_data(settings: Settings) -> None:
    """Refuse settings that leave the evaluation nothing to read: no ``data.eval`` and no
    held-out split (``heldout_fraction`` 0). Cheap, so ``prune`` calls it before calibrating.

    Raises:
        ConfigError: naming the fraction and both fixes.
    """
    if not settings.data.eval and settings.data.heldout_fraction == 0:
        raise ConfigError("--heldout-fraction 0 leaves no held-out data to evaluate on",
                          "pass --eval-data FILE or --heldout-fraction > 0")


def eval_stream(settings: Settings, tokenizer, run: RunDir) -> tuple[torch.Tensor, str]:
    """The token stream for perplexity: ``data.eval`` when set, else the held-out split.

    Returns ``(ids [N] int64, description)``.

    Raises:
        ConfigError: neither (``check_eval_data``).
    """
    check_eval_data(settings)
    if settings.data.eval:
        from wide_cli.data.sources import read_documents

        docs = read_documents(settings.data.eval)
        ids = torch.tensor(
            tokenizer("\n\n".join(docs), add_special_tokens=False).input_ids, dtype=torch.long
        )
        desc = settings.data.eval
    else:
        packed = packed_data(settings, tokenizer, run)
        ids = packed.heldout.reshape(-1)
        desc = f"held-out split of {settings.data.train}"
    if settings.eval.max_tokens:
        ids = ids[: settings.eval.max_tokens]
    return ids, desc


def evaluate(settings: Settings, run: RunDir, export_dir: Path | None = None, *, dense: bool = True) -> dict:
    """Token-level perplexity of the dense model and of the pruned one (from ``export_dir``, or
    the run's routers), with measured sparsity per module and per layer. Writes
    ``<run>/eval/report.json`` and returns it."""
    from wide_cli.eval.perplexity import token_perplexity

    seq_len = settings.eval.seq_len or settings.train.seq_len
    report: dict = {"protocol": None}
    loaded = load_backbone(settings)
    ids, desc = eval_stream(settings, loaded.tokenizer, run)
    if dense:
        r = token_perplexity(loaded.model, ids, seq_len=seq_len, batch_size=settings.eval.batch_size)
        report["dense"] = {k: r[k] for k in ("perplexity", "nll_mean", "n_tokens_scored", "n_windows")}
        report["protocol"] = r["protocol"]
    if export_dir is not None:
        from wide_cli.export.loader import load_pruned
        from wide_cli.models.loader import resolve_dtype

        pm = load_pruned(export_dir, dtype=resolve_dtype(settings.model.dtype, settings.model.device),
                         device=settings.model.device)
        model = pm.model
    else:
        _, model = routed_model_from_run(settings, run, loaded=load_backbone(settings))
    r = token_perplexity(model, ids, seq_len=seq_len, batch_size=settings.eval.batch_size)
    report["pruned"] = {k: r[k] for k in ("perplexity", "nll_mean", "n_tokens_scored", "n_windows")}
    report["protocol"] = r["protocol"]
    report["sparsity"] = r.get("sparsity")
    report["data"] = desc
    report["unit"] = "token-level perplexity"
    report["seq_len"] = seq_len
    run.eval.mkdir(parents=True, exist_ok=True)
    atomic_write_json(run.eval / "report.json", report)
    return report
