"""One function per pipeline stage (DESIGN.md §2). Each reads and writes the run directory and
returns a small result; ``prune`` (pipeline/prune.py) only composes them.

calibrate -> <run>/calibration/  packed data cache, per-group activation statistics
train     -> <run>/stage1/       routers (+ checkpoint for --resume); <run>/stage2/ LoRA + routers
export    -> <out>/              deployable checkpoint
evaluate  -> <run>/eval/         report.json (dense vs pruned perplexity, measured sparsity)
"""

from __future__ import annotations

import json
import logging
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from wide_cli.atomic import atomic_write_json
from wide_cli.errors import CheckpointError, ConfigError
from wide_cli.pipeline.rundir import RunDir, model_identity, record_run
from wide_cli.pipeline.settings import Settings

log = logging.getLogger("wide")
STATS_FILE = "statistics.safetensors"


# ----------------------------------------------------------------------------- helpers
def effective_settings(settings: Settings) -> Settings:
    """Settings as they will run: fp16 on CPU becomes fp32 with one warning (public case B12)."""
    if settings.model.dtype in ("fp16", "float16") and not str(settings.model.device).startswith("cuda"):
        warnings.warn(
            "fp16 is not supported on CPU; computing in fp32 instead (pass --dtype fp32 or bf16 on CPU, "
            "or run on a GPU for fp16)",
            UserWarning,
            stacklevel=2,
        )
        settings = settings.replace("model", dtype="fp32")
    if settings.train.dtype == "fp16" and not str(settings.model.device).startswith("cuda"):
        warnings.warn("fp16 training autocast needs CUDA; training in fp32 on CPU (use --train-dtype bf16)",
                      UserWarning, stacklevel=2)
        settings = settings.replace("train", dtype="fp32")
    return settings


def load_backbone(settings: Settings):
    """Load the dense model of ``settings.model`` (LoadedModel) and check the settings against
    it before any work is done: group sizes must divide H and F, and the training and
    perplexity sequence lengths must fit in the model's context (the rule of ``wide eval``).

    Raises:
        ModelSourceError: unknown/missing model, unsupported architecture.
        ConfigError: a group size that does not fit the model; a sequence length longer than
            the model's context length, naming both numbers.
    """
    from wide_cli.models.arch import check_context, context_length, model_shape
    from wide_cli.models.loader import load_model, resolve_dtype
    from wide_cli.routing.config import resolve_groups

    dtype = resolve_dtype(settings.model.dtype, settings.model.device)
    loaded = load_model(settings.model.name, dtype=dtype, device=settings.model.device)
    if settings.routing.method != "static-depth":  # removes whole layers: no groups
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            resolve_groups(settings.routing, model_shape(loaded.model.config))
    if settings.routing.method not in ("static-depth",):
        settings.routing.check_reachable(model_shape(loaded.model.config), settings.train.seq_len)
    max_len = context_length(loaded.model.config)
    check_context(settings.train.seq_len, max_len, f"seq-len {settings.train.seq_len}",
                  f"pass --seq-len {max_len} or less")
    if settings.eval.seq_len:
        check_context(settings.eval.seq_len, max_len, f"eval-seq-len {settings.eval.seq_len}",
                      f"pass --eval-seq-len {max_len} or less")
    return loaded


def _identity(settings: Settings, loaded, *, stage: str) -> dict:
    ident = {
        "model": model_identity(loaded),
        "routing": settings.routing.to_dict(),
        "train": settings.train.math_dict(),
        "data": settings.data.train,
        "router_init": settings.run.router_init,
    }
    if stage == "stage2":
        ident["stage2"] = {**settings.stage2.__dict__, "target_modules": list(settings.stage2.target_modules)}
    return ident


def _packed(settings: Settings, tokenizer, run: RunDir):
    from wide_cli.data.packing import load_or_build

    return load_or_build(
        settings.data.train,
        tokenizer,
        settings.train.seq_len,
        cache_dir=run.calibration / "data",
        heldout_fraction=settings.data.heldout_fraction,
        max_tokens=settings.data.max_train_tokens,
        seed=settings.train.seed if settings.data.shuffle_documents else None,
    )


def apply_drop_layers(settings: Settings, run: RunDir, loaded, *, packed=None) -> dict | None:
    """Hybrid depth + width (``routing.drop_layers``): remove the run's least influential layers
    from ``loaded.model`` in place, once (later calls see them gone). The selection is made by
    Block Influence on the training data the first time and kept in
    ``<run>/calibration/drop_layers.json``, so every stage removes the same layers.

    Returns the selection (``static_depth.hybrid_selection``), or None without ``drop_layers``.
    """
    from wide_cli.pipeline import static_depth

    n = settings.routing.drop_layers
    if not n:
        return None
    path = run.calibration / static_depth.DROP_FILE
    previous = json.loads(path.read_text()) if path.is_file() else None
    if previous is not None and len(previous["removed"]) == n and previous["cost_metric"] == settings.routing.cost_metric:
        sel = previous
    else:
        if static_depth.is_layer_pruned(loaded.model):
            raise CheckpointError(f"{path} does not match drop-layers {n}",
                                  f"re-run `wide calibrate --run-dir {run.root}`")
        packed = packed or _packed(settings, loaded.tokenizer, run)
        sel = static_depth.hybrid_selection(settings, loaded.model, packed.train, previous=previous)
        run.calibration.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, sel)
    if not static_depth.is_layer_pruned(loaded.model):
        static_depth.drop_for_hybrid(loaded.model, sel["removed"])
        log.info("drop-layers %d: removed layers %s by Block Influence (%.3f of dense %s before routing)",
                 n, sel["removed"], sel["cost_fraction"], sel["cost_metric"])
    return sel


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
    packed = _packed(settings, loaded.tokenizer, run)
    # hybrid: statistics (router init, stand-ins) of the layers that stay, in the pruned model
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


# ----------------------------------------------------------------------------- routers
def static_keep_masks(stats, settings: Settings, layout) -> dict:
    """Static-width baseline: per module, drop the lowest-importance groups so that the module's
    sparsity equals its target as closely as the group count allows.

    ``K = round(target * G * L)`` groups are dropped per module: ``floor(target * G)`` in every
    layer, the remaining ones in the layers whose next-lowest group is least important
    (importance normalised by the layer's total). Returns ``{(layer, module): [G] bool}``.
    """
    keep = {}
    for module in ("attention", "ffn"):
        on = settings.routing.route_attention if module == "attention" else settings.routing.route_ffn
        gs = layout.attn_group_size if module == "attention" else layout.ffn_group_size
        imp = stats.group_importance(module, gs)  # [L, G]
        L, G = imp.shape
        if not on:
            for i in range(L):
                keep[(i, module)] = torch.ones(G, dtype=torch.bool)
            continue
        t = settings.routing.target_for(module)
        total = int(round(t * G * L))
        base = min(int(math.floor(t * G)), G)
        norm = imp / imp.sum(dim=1, keepdim=True).clamp_min(1e-12)
        order = norm.argsort(dim=1)  # ascending importance
        drops = [base] * L
        extra = total - base * L
        if extra > 0:
            cand = torch.tensor([norm[i, order[i, base]].item() if base < G else math.inf for i in range(L)])
            for i in cand.argsort()[:extra].tolist():
                drops[i] += 1
        for i in range(L):
            k = torch.ones(G, dtype=torch.bool)
            k[order[i, : drops[i]]] = False
            keep[(i, module)] = k
    return keep


def init_routers_from_statistics(model, stats, *, strength: float = 1.0) -> None:
    """Router initialisation from calibration statistics: the bias of each group's execute logit
    minus skip logit is ``strength * z + offset``, where ``z`` is the group's standardised
    log-importance within its layer and ``offset = logit(1 - target)`` so that the initial skip
    rate is near the target. Weights keep their kaiming init."""
    from wide_cli.routing.model import decoder_layers

    state = model.wide_routing
    for module in state.active_modules:
        gs = state.layout.attn_group_size if module == "attention" else state.layout.ffn_group_size
        imp = stats.group_importance(module, gs).clamp_min(1e-12).log()  # [L, G]
        if imp.shape[1] == 1:  # one group per module (dynamic-depth): only the offset applies
            z = torch.zeros_like(imp)
        else:
            z = (imp - imp.mean(1, keepdim=True)) / imp.std(1, keepdim=True).nan_to_num(1.0).clamp_min(1e-6)
        t = state.cfg.target_for(module)
        if state.cfg.cost_target is not None:  # the uniform skip rate that meets the cost target
            t = (1.0 - state.cfg.routed_cost_target(state.shape)) / (1.0 - state.cfg.cost_model(state.shape).floor_fraction)
        t = min(max(t, 1e-3), 1 - 1e-3)
        offset = math.log((1 - t) / t)
        for i, layer in enumerate(decoder_layers(model)):
            r = getattr(layer, f"router_{module}", None)
            if r is None or not hasattr(r, "router"):
                continue
            d = strength * z[i] + offset  # [G]: execute - skip
            with torch.no_grad():
                b = torch.stack([d / 2, -d / 2], dim=-1).reshape(-1)
                r.router.bias.copy_(b.to(r.router.bias.dtype))


def attach(settings: Settings, model, *, stats=None):
    """Attach routers for ``settings.routing`` (static keep masks from ``stats`` for
    static-width). Returns the RoutingState."""
    from wide_cli.models.arch import model_shape
    from wide_cli.routing import attach_routers, resolve_groups

    static_keep = None
    if settings.routing.method == "static-width":
        if stats is None:
            raise ConfigError("static-width needs calibration statistics", "run `wide calibrate` first")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            layout = resolve_groups(settings.routing, model_shape(model.config))
        static_keep = static_keep_masks(stats, settings, layout)
    torch.manual_seed(settings.train.seed)
    return attach_routers(model, settings.routing, static_keep=static_keep)


def _load_stats(run: RunDir):
    from wide_cli.calibrate.statistics import GroupStatistics

    p = run.calibration / STATS_FILE
    if not p.is_file():
        raise CheckpointError(f"{p} is missing", f"run `wide calibrate --run-dir {run.root}` first")
    return GroupStatistics.load(p)


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
    apply_drop_layers(settings, run, loaded)
    model = loaded.model
    rcfg = settings.routing
    need_stats = (rcfg.method == "static-width" or settings.run.router_init == "calibration"
                  or rcfg.standin != "none")
    stats = _load_stats(run) if need_stats else None
    attach(settings, model, stats=stats)
    run.stage1.mkdir(parents=True, exist_ok=True)
    joint = settings.stage2.joint and rcfg.method not in ("dense", "static-width")
    if rcfg.method in ("dense", "static-width"):
        res = TrainResult(0, 0, 0.0)
    else:
        if settings.run.router_init == "calibration":
            init_routers_from_statistics(model, stats)
        if rcfg.standin != "none":
            init_standins_from_statistics(model, stats)
        for n, p in model.named_parameters():
            routed = ".router_attention." in n or ".router_ffn." in n
            p.requires_grad_(routed and (not n.endswith(".standin") or rcfg.standin == "trained"))
        from wide_cli.train import distributed

        packed = _packed(settings, loaded.tokenizer, run)
        info = distributed.dist_info()
        ident = _identity(settings, loaded, stage="stage1")
        train_model, groups = model, None
        if joint:
            from wide_cli.train.lora import wrap_lora

            torch.manual_seed(settings.train.seed)  # LoRA A's init draws from the global RNG
            train_model = wrap_lora(model, settings.stage2)
            for n, p in train_model.named_parameters():  # PEFT froze everything but the adapters
                if ".router_attention." in n or ".router_ffn." in n:
                    p.requires_grad_(not n.endswith(".standin") or rcfg.standin == "trained")
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
        if rcfg.cost_target is not None:
            res.final["skip_offset"] = calibrate_skip_offset(
                train_model, packed.train[-8:], rcfg.cost_model(model.wide_routing.shape, settings.train.seq_len),
                1.0 - rcfg.routed_cost_target(model.wide_routing.shape, settings.train.seq_len),
                batch_size=settings.eval.batch_size)
    save_routers(model, run)
    if joint:
        from wide_cli.train.lora import save_joint_stage2

        save_joint_stage2(train_model, settings, run, res)
    atomic_write_json(run.stage1 / "routers.json", {"routing": settings.routing.to_dict(), "train": res.to_dict()})
    return res


def save_routers(model, run: RunDir) -> None:
    """Write ``<run>/stage1/routers.safetensors`` (atomic rename)."""
    from safetensors.torch import save_file

    from wide_cli.routing.model import router_state_dict

    save_file(router_state_dict(model), str(run.stage1 / "routers.safetensors.tmp"))
    Path(run.stage1 / "routers.safetensors.tmp").replace(run.stage1 / "routers.safetensors")


def init_standins_from_statistics(model, stats) -> None:
    """Set every router's ``standin`` to its group's calibration-mean output (``standin_vectors``)."""
    from wide_cli.calibrate.statistics import standin_vectors
    from wide_cli.routing.model import decoder_layers

    state = model.wide_routing
    layers = decoder_layers(model)
    for module in state.active_modules:
        gs = state.layout.attn_group_size if module == "attention" else state.layout.ffn_group_size
        vecs = standin_vectors(stats, model, module, gs)  # [L, G, D]
        for i, layer in enumerate(layers):
            r = getattr(layer, f"router_{module}", None)
            if r is not None and getattr(r, "standin", None) is not None:
                with torch.no_grad():
                    r.standin.copy_(vecs[i].to(r.standin.dtype))


@torch.no_grad()
def calibrate_skip_offset(model, sequences: torch.Tensor, cost, target_skip: float, *, batch_size: int = 4,
                          iters: int = 12, tol: float = 0.004) -> float:
    """Shift every learned router's skip logits by one offset so that the deterministic (argmax)
    decisions skip ``target_skip`` of the dense cost on ``sequences`` (training tokens).

    Training samples hard Gumbel decisions, inference takes the argmax, so the trained routers
    miss the requested cost at inference; one shared offset, found by bisection and folded into
    the router biases, closes the gap without changing which groups each router prefers.

    Args:
        model: routed model (a PEFT wrapper is fine). sequences: ``[N, T]`` int64 training tokens.
        cost: ``wide_cli.cost.CostModel``. target_skip: wanted cost-weighted skip fraction.
    Returns:
        the offset added to the skip logits (0.0 when already within ``tol``).
    """
    from wide_cli.routing.model import decoder_layers
    from wide_cli.routing.router import Router

    routers = [r for layer in decoder_layers(model) for r in (getattr(layer, "router_attention", None),
                                                             getattr(layer, "router_ffn", None))
               if isinstance(r, Router)]
    state = model.wide_routing
    device = next(model.parameters()).device
    was_training, mode = model.training, state.mode
    model.eval()
    state.set_mode("argmax")

    def shift(delta: float) -> None:
        for r in routers:
            r.router.bias[1::2] += delta  # logits are [.., G, 2]: odd entries are the skip logits

    def measured() -> float:
        counter = state.start_counting()
        try:
            for i in range(0, len(sequences), batch_size):
                model(input_ids=sequences[i : i + batch_size].to(device), use_cache=False)
        finally:
            state.stop_counting()
        return cost.skip_from_summary(counter.summary())

    applied = 0.0
    try:
        s0 = measured()
        if abs(s0 - target_skip) <= tol:
            return 0.0
        lo, hi = (0.0, 8.0) if s0 < target_skip else (-8.0, 0.0)
        for _ in range(iters):
            mid = (lo + hi) / 2
            shift(mid - applied)
            applied = mid
            s = measured()
            if abs(s - target_skip) <= tol:
                break
            if s < target_skip:
                lo = mid
            else:
                hi = mid
        return applied
    finally:
        state.set_mode(mode)
        model.train(was_training)


def routed_model_from_run(settings: Settings, run: RunDir, *, loaded=None):
    """The backbone with the run's trained routers (stage 2 weights merged when present).

    Returns ``(loaded, model)``.
    """
    from safetensors.torch import load_file

    from wide_cli.routing.model import load_router_state_dict

    loaded = loaded or load_backbone(settings)
    apply_drop_layers(settings, run, loaded)
    model = loaded.model
    stats = _load_stats(run) if settings.routing.method == "static-width" else None
    attach(settings, model, stats=stats)
    if (settings.stage2.enabled or settings.stage2.joint) and (run.stage2 / "adapter.safetensors").is_file():
        from wide_cli.train.lora import apply_stage2, stage1_routers_sha256

        try:
            trained_on = json.loads((run.stage2 / "result.json").read_text())["identity"].get("stage1_routers_sha256")
        except (OSError, ValueError, KeyError):
            trained_on = None
        if trained_on is not None and trained_on != stage1_routers_sha256(run):
            raise CheckpointError(
                f"the stage-2 adapter in {run.stage2} was trained on other stage-1 routers than "
                f"{run.stage1 / 'routers.safetensors'} (stage 1 was retrained after stage 2)",
                f"rerun `wide train --run-dir {run.root} --stage 2`, or pass --no-lora to export stage 1 alone")

        model = apply_stage2(model, run.stage2, settings.stage2)
    else:
        rp = run.stage1 / "routers.safetensors"
        if not rp.is_file():
            raise CheckpointError(f"{rp} is missing", f"run `wide train --run-dir {run.root}` first")
        load_router_state_dict(model, load_file(str(rp)))
    model.wide_routing.set_mode("dense" if settings.routing.method == "dense" else "argmax")
    return loaded, model


# ----------------------------------------------------------------------------- measure
def measure_sparsity(model, sequences: torch.Tensor, *, batch_size: int = 4, max_sequences: int | None = 64) -> dict:
    """Measured sparsity of a routed model on ``sequences [N, T]`` (no padding).

    Returns ``SparsityCounter.summary()``: ``{attention, ffn, total, per_layer}``, plus ``tokens``.
    """
    state = model.wide_routing
    seqs = sequences if max_sequences is None else sequences[:max_sequences]
    device = next(model.parameters()).device
    counter = state.start_counting()
    try:
        with torch.no_grad():
            for i in range(0, len(seqs), batch_size):
                model(input_ids=seqs[i : i + batch_size].to(device))
    finally:
        state.stop_counting()
    return {**counter.summary(), "tokens": int(seqs.numel())}


# ----------------------------------------------------------------------------- export
def export(settings: Settings, run: RunDir, out: Path, *, loaded=None, metrics: dict | None = None,
           export_format: str = "wide", weight_format: str = "fp32"):
    """Write the deployable export of the run to ``out`` (atomic), with sparsity measured on
    the held-out split; ``export_format`` is ``wide`` or ``hf``, ``weight_format`` ``fp32`` or
    ``int8`` (see ``export/writer.py``).
    Returns the ExportResult.

    Raises:
        CheckpointError: the export cannot be written (disk full, permissions...); a previous
            export at ``out`` is left untouched.
    """
    import json

    from wide_cli.export.writer import export_model
    from wide_cli.routing.config import resolve_groups

    if export_format == "hf" and settings.routing.standin != "none":
        raise ConfigError(f"--format hf cannot carry the stand-ins of standin={settings.routing.standin!r}",
                          "export with --format wide (the runtime, wide eval and wide bench apply them)")
    if settings.routing.method == "static-depth":
        from wide_cli.pipeline import static_depth

        return static_depth.export(settings, run, out, loaded=loaded or load_backbone(settings),
                                   export_format=export_format)
    loaded, model = routed_model_from_run(settings, run, loaded=loaded)
    packed = _packed(settings, loaded.tokenizer, run)
    heldout = packed.heldout if len(packed.heldout) else packed.train
    measured = measure_sparsity(model, heldout, batch_size=settings.eval.batch_size)
    state = model.wide_routing
    layout = resolve_groups(settings.routing, state.shape, warn=False)
    train_info = {}
    for stage in ("stage1", "stage2"):
        p = getattr(run, stage) / "result.json"
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
        "dropped_layers": _dropped_layers(settings, run),
        "source_model": {**loaded.provenance, "spec": shareable(loaded.source), "resolved": loaded.resolved,
                         "revision": loaded.revision},
        "lora": (
            {"merged": True, "rank": settings.stage2.lora_rank, "alpha": settings.stage2.lora_alpha,
             "target_modules": list(settings.stage2.target_modules)}
            if (settings.stage2.enabled or settings.stage2.joint) and (run.stage2 / "adapter.safetensors").is_file()
            else None
        ),
        "train": train_info,
        "settings": shareable_settings(settings.to_dict()),
        "metrics": metrics or {},
    }
    try:
        return export_model(model, loaded.tokenizer, Path(out), wide_config=wide_config, export_format=export_format,
                            weight_format=weight_format)
    except Exception as e:  # only failed writes are turned into a user error; the rest propagates
        reason = _write_failure(e)
        if reason is None:
            raise
        raise CheckpointError(
            f"cannot write the export to {out}: {reason}",
            "free disk space or choose another --out, then re-run `wide export`; any previous export there is "
            "untouched",
        ) from e


def _dropped_layers(settings: Settings, run: RunDir) -> dict | None:
    if not settings.routing.drop_layers:
        return None
    from wide_cli.pipeline.static_depth import DROP_FILE

    return json.loads((run.calibration / DROP_FILE).read_text())


def shareable(value: str | None) -> str | None:
    """``value`` as an export may record it: a local file or directory (or any absolute path)
    becomes its name, so a shared export names no path of the machine that built it; aliases,
    hub ids and ``builtin:`` sources stay as they are."""
    if not value:
        return value
    p = Path(value).expanduser()
    return p.name if p.is_absolute() or p.exists() else value


def shareable_settings(d: dict) -> dict:
    """``Settings.to_dict()`` with the model and data paths passed through ``shareable``."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in d.items()}
    for section, key in (("model", "name"), ("data", "train"), ("data", "eval")):
        if key in out.get(section, {}):
            out[section][key] = shareable(out[section][key])
    return out


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
def eval_stream(settings: Settings, tokenizer, run: RunDir) -> tuple[torch.Tensor, str]:
    """The token stream for perplexity: ``data.eval`` when set, else the held-out split.

    Returns ``(ids [N] int64, description)``.
    """
    if settings.data.eval:
        from wide_cli.data.sources import read_documents

        docs = read_documents(settings.data.eval)
        ids = torch.tensor(
            tokenizer("\n\n".join(docs), add_special_tokens=False).input_ids, dtype=torch.long
        )
        desc = settings.data.eval
    else:
        packed = _packed(settings, tokenizer, run)
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
