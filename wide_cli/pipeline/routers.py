"""The routers of a run: attach them to the backbone, initialise them from the calibration
statistics, save them, and rebuild the routed model from ``<run>/stage1`` (and ``<run>/stage2``,
merged, when the run's stage 2 is on). Used by every stage that needs the routed model."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from wide_cli.artifacts import read_routers, sha256_file
from wide_cli.atomic import atomic_save_safetensors
from wide_cli.errors import CheckpointError, ConfigError
from wide_cli.filenames import ADAPTER_FILE, RESULT_JSON, ROUTERS_FILE, STATS_FILE
from wide_cli.models.arch import ROUTED_MODULES
from wide_cli.pipeline.common import load_backbone
from wide_cli.pipeline.rundir import RunDir
from wide_cli.pipeline.settings import Settings, Stage2Config

if TYPE_CHECKING:
    from wide_cli.routing.config import SkipTarget


def static_keep_from_statistics(stats, settings: Settings, layout) -> dict:
    """Static-width keep masks from the calibration statistics: per routed module the least
    important groups are dropped to its target (``calibrate.selection.static_width_keep``); a
    module that is not routed keeps every group. Returns ``{(layer, module): [G] bool}``."""
    from wide_cli.calibrate.selection import static_width_keep

    keep = {}
    for module in ROUTED_MODULES:
        on = settings.routing.route_attention if module == "attention" else settings.routing.route_ffn
        gs = layout.attn_group_size if module == "attention" else layout.ffn_group_size
        imp = stats.group_importance(module, gs)  # [L, G]
        masks = static_width_keep(imp, settings.routing.target_for(module)) if on else torch.ones(imp.shape, dtype=torch.bool)
        keep.update({(i, module): masks[i] for i in range(imp.shape[0])})
    return keep


def init_routers_from_statistics(model, stats, target: SkipTarget | None = None, *, strength: float = 1.0) -> None:
    """Router initialisation from calibration statistics (``calibrate.selection.router_init_bias``):
    every router's bias starts at the importance-based value for the module's target skip rate,
    or with a cost target (``target``, ``RoutingConfig.skip_target``) the uniform skip rate that
    meets it. Weights keep their kaiming init."""
    from wide_cli.calibrate.selection import router_init_bias
    from wide_cli.routing.model import decoder_layers

    state = model.wide_routing
    for module in state.active_modules:
        gs = state.layout.attn_group_size if module == "attention" else state.layout.ffn_group_size
        t = target.uniform_skip if target is not None else state.cfg.target_for(module)
        bias = router_init_bias(stats.group_importance(module, gs), t, strength=strength)  # [L, 2G]
        for i, layer in enumerate(decoder_layers(model)):
            r = getattr(layer, f"router_{module}", None)
            if r is None or not hasattr(r, "router"):
                continue
            with torch.no_grad():
                r.router.bias.copy_(bias[i].to(r.router.bias.dtype))


#: Forward passes (of ``eval.batch_size`` training sequences) the router input moments are taken on.
ROUTER_INPUT_BATCHES = 16


def standardize_router_inputs(model, sequences: torch.Tensor, *, batch_size: int = 4) -> None:
    """``router_input = "standardized"``: every learned router reads its input standardised by the
    dense model's per-channel moments on ``sequences`` (``[N, T]`` int64 training tokens, the first
    ``ROUTER_INPUT_BATCHES`` forward passes; ``Router.standardize_input``). Deterministic in the
    tokens, so a resumed run sets the same moments before its checkpoint is loaded."""
    from wide_cli.calibrate.statistics import router_input_moments
    from wide_cli.routing.model import decoder_layers
    from wide_cli.routing.router import Router

    moments = router_input_moments(model, sequences, batch_size=batch_size, max_batches=ROUTER_INPUT_BATCHES)
    for i, layer in enumerate(decoder_layers(model)):
        for module in ROUTED_MODULES:
            r = getattr(layer, f"router_{module}", None)
            if isinstance(r, Router):
                r.standardize_input(*moments[(i, module)])


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
        static_keep = static_keep_from_statistics(stats, settings, layout)
    torch.manual_seed(settings.train.seed)
    return attach_routers(model, settings.routing, static_keep=static_keep)


def load_stats(run: RunDir):
    """The run's calibration statistics (``GroupStatistics``).

    Raises:
        CheckpointError: ``<run>/calibration/statistics.safetensors`` is missing.
    """
    from wide_cli.calibrate.statistics import GroupStatistics

    p = run.calibration / STATS_FILE
    if not p.is_file():
        raise CheckpointError(f"{p} is missing", f"run `wide calibrate --run-dir {run.root}` first")
    return GroupStatistics.load(p)


def save_routers(model, run: RunDir) -> None:
    """Write ``<run>/stage1/routers.safetensors`` (atomically)."""
    from wide_cli.routing.model import router_state_dict

    atomic_save_safetensors(run.stage1 / ROUTERS_FILE, router_state_dict(model))


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
def calibrate_skip_offset(model, sequences: torch.Tensor, target: SkipTarget, *, batch_size: int = 4,
                          iters: int = 12, tol: float = 0.004) -> float:
    """Shift every learned router's skip logits by one offset so that the deterministic (argmax)
    decisions skip ``target.skip`` of the dense cost on ``sequences`` (training tokens).

    Training samples hard Gumbel decisions, inference takes the argmax, so the trained routers
    miss the requested cost at inference; one shared offset, found by bisection and folded into
    the router biases, closes the gap without changing which groups each router prefers.

    Args:
        model: routed model (a PEFT wrapper is fine). sequences: ``[N, T]`` int64 training tokens.
        target: the cost target as a weighted skip fraction and its cost model
            (``RoutingConfig.skip_target`` at the training sequence length).
    Returns:
        the offset added to the skip logits (0.0 when already within ``tol``).
    """
    from wide_cli.routing.measure import batches_of, measure_sparsity
    from wide_cli.routing.model import decoder_layers
    from wide_cli.routing.router import Router

    routers = [r for layer in decoder_layers(model) for r in (getattr(layer, "router_attention", None),
                                                             getattr(layer, "router_ffn", None))
               if isinstance(r, Router)]
    state = model.wide_routing
    was_training, mode = model.training, state.mode
    model.eval()
    state.set_mode("argmax")

    def shift(delta: float) -> None:
        for r in routers:
            r.router.bias[1::2] += delta  # logits are [.., G, 2]: odd entries are the skip logits

    def measured() -> float:
        return target.cost.skip_from_summary(measure_sparsity(model, batches_of(sequences, batch_size)))

    applied = 0.0
    try:
        s0 = measured()
        if abs(s0 - target.skip) <= tol:
            return 0.0
        lo, hi = (0.0, 8.0) if s0 < target.skip else (-8.0, 0.0)
        for _ in range(iters):
            mid = (lo + hi) / 2
            shift(mid - applied)
            applied = mid
            s = measured()
            if abs(s - target.skip) <= tol:
                break
            if s < target.skip:
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
    from wide_cli.routing.model import load_router_state_dict

    loaded = loaded or load_backbone(settings)
    from wide_cli.pipeline.static_depth import apply_drop_layers

    apply_drop_layers(settings, run, loaded)  # hybrid: the routers sit in the layer-pruned model
    model = loaded.model
    stats = load_stats(run) if settings.routing.method == "static-width" else None
    attach(settings, model, stats=stats)
    if (settings.stage2.enabled or settings.stage2.joint) and (run.stage2 / ADAPTER_FILE).is_file():
        try:
            trained_on = json.loads((run.stage2 / RESULT_JSON).read_text())["identity"].get("stage1_routers_sha256")
        except (OSError, ValueError, KeyError):
            trained_on = None
        if trained_on is not None and trained_on != stage1_routers_sha256(run):
            raise CheckpointError(
                f"the stage-2 adapter in {run.stage2} was trained on other stage-1 routers than "
                f"{run.stage1 / ROUTERS_FILE} (stage 1 was retrained after stage 2)",
                f"rerun `wide train --run-dir {run.root} --stage 2`, or pass --no-lora to export stage 1 alone")

        model = apply_stage2(model, run.stage2, settings.stage2)
    else:
        load_router_state_dict(model, read_routers(run.stage1 / ROUTERS_FILE, f"run `wide train --run-dir {run.root}` first"))
    model.wide_routing.set_mode("dense" if settings.routing.method == "dense" else "argmax")
    return loaded, model


def stage1_routers_sha256(run) -> str | None:
    """sha256 of ``<run>/stage1/routers.safetensors`` (None when absent)."""
    p = Path(run.stage1) / ROUTERS_FILE
    return sha256_file(p) if p.is_file() else None


def apply_stage2(model, stage2_dir: Path, cfg: Stage2Config):
    """Load stage-2 routers and adapter onto a routed model and merge the adapter.

    Returns the merged routed model (routing state unchanged).

    Raises:
        CheckpointError: a stage-2 file missing or unreadable, or an adapter that does not fit.
    """
    from safetensors.torch import load_file

    from wide_cli.routing.model import load_router_state_dict
    from wide_cli.train.lora import load_adapter, merge_lora, wrap_lora

    stage2_dir = Path(stage2_dir)
    for f in (ADAPTER_FILE, ROUTERS_FILE):
        if not (stage2_dir / f).is_file():
            raise CheckpointError(f"{stage2_dir / f} is missing", "run `wide train --stage 2` first")
    load_router_state_dict(model, read_routers(stage2_dir / ROUTERS_FILE, "run `wide train --stage 2` again"))
    peft_model = wrap_lora(model, cfg)
    load_adapter(peft_model, load_file(str(stage2_dir / ADAPTER_FILE)))
    return merge_lora(peft_model)
