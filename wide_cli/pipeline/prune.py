"""``prune``: calibrate -> train (stage 1, optional stage 2) -> export -> evaluate."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

from wide_cli.pipeline import stages
from wide_cli.pipeline.common import effective_settings
from wide_cli.pipeline.rundir import RunDir, run_lock
from wide_cli.pipeline.settings import Settings


@dataclass
class PruneResult:
    """The summary of a whole run (also what ``--json`` prints).

    Attributes:
        export_dir: the export directory.
        sparsity: measured on the eval data: ``{attention, ffn, total, per_layer}``.
        eval: ``{dense: {perplexity, ...}, pruned: {perplexity, ...}, protocol, data, unit}``.
        train: ``{steps, tokens, seconds}`` of stage 1 (+ ``stage2`` when run).
        seconds: wall time of the whole run, s.
        cost: measured on the eval data (``wide_cli.cost``, routers not counted): ``{flops,
            decode_bytes}`` fractions of dense, plus ``target`` / ``metric`` (the request, or None)
            and ``error`` (measured minus target in the target's metric).
    """

    export_dir: Path
    sparsity: dict
    eval: dict
    train: dict
    settings: dict
    seconds: float
    calibration: dict = field(default_factory=dict)
    cost: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "export_dir": str(self.export_dir),
            "sparsity": self.sparsity,
            "cost": self.cost,
            "eval": self.eval,
            "train": self.train,
            "calibration": self.calibration,
            "seconds": round(self.seconds, 1),
            "settings": self.settings,
        }


def prune(settings: Settings, run_dir: Path, out: Path | None = None, *, resume: bool = False,
          progress: bool = True, log=print) -> PruneResult | None:
    """Run every stage on ``run_dir``; ``out`` defaults to ``<run_dir>/export``.

    ``log(msg)`` receives one line per stage (the CLI sends it to stderr). Under torchrun every
    rank trains; rank 0 alone calibrates, exports and evaluates, and only it returns a result.
    """
    from wide_cli.train import distributed

    t0 = time.perf_counter()
    settings = effective_settings(settings)
    run = RunDir(Path(run_dir))
    out = Path(out) if out else run.default_export
    # before any work: a refused --out or a run with nothing to evaluate on costs nothing
    stages.check_export_destination(settings, run, out)
    stages.check_eval_data(settings)
    info = distributed.init(settings.model.device)
    if not info.is_main:  # rank 0 alone logs, checkpoints and exports
        progress, log = False, (lambda msg: None)
    loaded = stages.load_backbone(settings)  # bad settings fail here, before the run dir exists
    with (run_lock(run) if info.is_main else _nolock()):
        log(f"[1/4] calibrate: model {settings.model.name}, data {settings.data.train}")
        if info.is_main:
            cal = stages.calibrate(settings, run, resume=resume, loaded=loaded)
            log(f"      {cal.train_sequences} train / {cal.heldout_sequences} held-out sequences of "
                f"{settings.train.seq_len} tokens ({cal.seconds:.1f} s)")
        distributed.barrier()  # other ranks read the packed-data cache rank 0 wrote
        if settings.routing.method == "static-depth":
            log(f"[2/4] select layers by Block Influence (cost target {settings.routing.cost_target or 0.75} of "
                f"dense {settings.routing.cost_metric})" + (
                    f", then LoRA healing: {settings.stage2.steps} steps x {settings.train.sequences_per_step} x "
                    f"{settings.train.seq_len} tokens" if settings.stage2.enabled else ""))
        else:
            log(f"[2/4] train: method {settings.routing.method}, {settings.train.steps} steps x "
                f"{settings.train.sequences_per_step * info.world} x {settings.train.seq_len} tokens"
                + (f" ({info.world} processes)" if info.enabled else ""))
        tr = stages.train(settings, run, resume=resume, loaded=loaded, progress=progress)
        train_info = tr.to_dict()
        if settings.routing.drop_layers and info.is_main:
            from wide_cli.pipeline.static_depth import apply_drop_layers

            sel = apply_drop_layers(settings, run, loaded)
            train_info["dropped_layers"] = {k: sel[k] for k in ("removed", "num_layers", "cost_fraction", "cost_metric")}
        if settings.routing.method == "static-depth" and info.is_main:
            from wide_cli.pipeline.static_depth import read_selection

            sel = read_selection(run)
            train_info["static_depth"] = {k: sel[k] for k in ("removed", "num_layers", "cost_target",
                                                              "cost_metric", "cost_fraction")}
        if (settings.stage2.enabled and not settings.stage2.joint
                and settings.routing.method not in ("dense", "static-width", "static-depth")):
            from wide_cli.pipeline.stage2 import train_stage2

            distributed.barrier()
            log(f"[2b] stage 2 (LoRA r={settings.stage2.lora_rank}): {settings.stage2.steps} steps")
            t2 = train_stage2(settings, run, resume=resume, progress=progress)
            train_info["stage2"] = t2.to_dict()
        distributed.barrier()
        if not info.is_main:
            return None
        log(f"[3/4] export -> {out}")
        stages.export(settings, run, out)
        log("[4/4] evaluate: dense vs pruned perplexity")
        report = stages.evaluate(settings, run, out)
    sp = report.get("sparsity") or {}
    # the routed model's shape (a hybrid run's has fewer layers than its source)
    cost = measured_cost(settings, loaded.model.config, sp, report.get("seq_len") or settings.train.seq_len,
                         static_depth=train_info.get("static_depth"))
    if cost.get("error") is not None:
        log(f"      cost on the eval tokens: {cost[cost['metric']]:.3f} of dense {cost['metric']} "
            f"(target {cost['target']:.3f}, off by {cost['error']:+.3f})")
        if abs(cost["error"]) > 0.02:
            log("      warning: the measured cost misses the target by more than 0.02 (train longer, or a "
                "larger --sparsity-weight)")
    return PruneResult(
        cost=cost,
        export_dir=out,
        sparsity=sp,
        eval={k: report.get(k) for k in ("dense", "pruned", "protocol", "data", "unit", "seq_len")},
        train=train_info,
        settings=settings.to_dict(),
        seconds=time.perf_counter() - t0,
        calibration={"train_sequences": cal.train_sequences, "heldout_sequences": cal.heldout_sequences,
                     "seconds": round(cal.seconds, 1)},
    )


def measured_cost(settings: Settings, config, sparsity: dict, seq_len: int, *, static_depth: dict | None = None) -> dict:
    """Cost fractions of dense at a measured sparsity (see ``PruneResult.cost``).

    ``static_depth``: a static-depth run's layer selection (``num_layers`` of the source,
    ``removed``); its cost is that of the shorter dense model against the source (no routers)."""
    from wide_cli.cost import static_depth_export_cost
    from wide_cli.models.arch import model_shape

    shape = model_shape(config)
    rc = settings.routing
    if static_depth is not None:
        flops, decode_bound = static_depth_export_cost({"static_depth": static_depth}, shape, seq_len=seq_len)
        out = {"flops": flops["relative"], "decode_bytes": 1.0 / decode_bound}
    else:
        # a hybrid's routed layers are a fraction of its source: scale to the whole source model
        # the routing's own cost model (its groups and low-rank stand-ins): what training aimed at
        out = {m: dataclasses.replace(rc, cost_metric=m).cost_model(shape, seq_len).relative(sparsity)
               * dataclasses.replace(rc, cost_metric=m).depth_fraction(shape, seq_len)
               for m in ("flops", "decode_bytes")}
    target = settings.routing.cost_target
    out.update(target=target, metric=settings.routing.cost_metric if target is not None else None,
               error=None if target is None else out[settings.routing.cost_metric] - target)
    return out


@contextlib.contextmanager
def _nolock():
    yield
