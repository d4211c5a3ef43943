"""Static depth pruning (ShortGPT, Men et al. 2024, arXiv 2403.03853): remove whole decoder layers.

Each decoder layer ``i`` is scored by its **Block Influence** on calibration tokens::

    BI_i = 1 - mean_t cos(x_{i,t}, y_{i,t})

where ``x_{i,t}`` is the residual stream entering layer ``i`` at token ``t`` and ``y_{i,t}`` the
stream leaving it (both ``[D]``), averaged over every valid (non-padding) token. A layer that
barely turns the residual stream (BI near 0) is removed first, until the model's per-token cost
is at most the requested fraction of dense. The result is a plain, smaller checkpoint: fewer
layers, a normal ``config.json``, no routers; optional LoRA healing uses the stage-2 machinery.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from wide_cli.cost import fraction_after
from wide_cli.errors import ConfigError
from wide_cli.filenames import RESULT_JSON
from wide_cli.models.depth import drop_for_hybrid, is_layer_pruned, remove_layers
from wide_cli.routing.config import RoutingConfig

log = logging.getLogger("wide")

METHOD = "static-depth"
DEFAULT_COST_TARGET = 0.75
#: The routing of a layer-pruned model: none (group sizes of 1 divide every model).
PLAIN_ROUTING = RoutingConfig(method="dense", attn_group_size=1, ffn_group_size=1)


# ----------------------------------------------------------------------------- Block Influence
@torch.no_grad()
def block_influence(model, sequences: torch.Tensor, *, batch_size: int = 4,
                    attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Block Influence of every decoder layer (ShortGPT, arXiv 2403.03853, eq. 1).

    Args:
        model: a Hugging Face ``*ForCausalLM`` of the Llama family (any dtype).
        sequences: ``[N, T]`` int64 token ids.
        batch_size: sequences per forward.
        attention_mask: optional ``[N, T]`` 0/1 mask; tokens with 0 are not averaged (padding).

    Returns:
        ``[L]`` float64: ``1 - mean cosine(layer input, layer output)`` over valid tokens; the
        cosine is computed in fp32 per token.

    Raises:
        ValueError: no valid token.
    """
    from wide_cli.routing.model import decoder_layers

    layers = decoder_layers(model)
    L = len(layers)
    sums = torch.zeros(L, dtype=torch.float64)
    count = 0
    valid_now: list[torch.Tensor] = []
    device = next(model.parameters()).device

    def make_hook(i):
        def hook(module, args, kwargs, output):
            x = kwargs.get("hidden_states", args[0] if args else None)
            y = output[0] if isinstance(output, tuple) else output
            cos = torch.nn.functional.cosine_similarity(x.float(), y.float(), dim=-1)  # [B, T]
            sums[i] += float((cos * valid_now[0]).sum().double())
        return hook

    handles = [layer.register_forward_hook(make_hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        for s in range(0, len(sequences), batch_size):
            ids = sequences[s : s + batch_size].to(device)
            am = None if attention_mask is None else attention_mask[s : s + batch_size].to(device)
            valid = torch.ones(ids.shape, dtype=torch.float32, device=device) if am is None else am.float()
            valid_now[:] = [valid]
            count += int(valid.sum().item())
            model(input_ids=ids, attention_mask=am, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    if count == 0:
        raise ValueError("no valid token to measure Block Influence on")
    return 1.0 - sums / count


# ----------------------------------------------------------------------------- cost and selection
def depth_cost(shape, *, metric: str = "flops", seq_len: int = 256):
    """The project's cost model of ``shape`` (``wide_cli.cost.cost_model``, whole-module groups):
    dropping a layer removes ``layer_cost`` (its K/V projections and norms too, unlike width
    routing); ``model_floor`` (lm_head; in decode bytes also the final norm and one embedding row)
    stays.

    Raises:
        ConfigError: an unknown metric.
    """
    from wide_cli import cost

    if metric not in cost.METRICS:
        raise ConfigError(f"unknown cost metric {metric!r}", f"choose one of {', '.join(cost.METRICS)}")
    return cost.cost_model(shape, metric=metric, seq_len=seq_len)


def layers_to_remove(influence: torch.Tensor, cm, target: float, *, model_name: str = "the model") -> list[int]:
    """The least influential layers to remove so that the cost is at most ``target`` of dense
    (the fewest that meet it; ties in Block Influence: the later layer first).

    Args:
        influence: ``[L]`` Block Influence per layer.
        cm: ``wide_cli.cost.CostModel`` of the dense model (``depth_cost``).
        target: cost fraction of dense in (0, 1).

    Returns:
        sorted layer indices to remove (at least one).

    Raises:
        ConfigError: ``target`` outside (0, 1), or below the lowest reachable cost (one layer
            kept), naming the value and the reachable range.
    """
    from wide_cli import cost

    lo = fraction_after(cm, cm.num_layers - 1)
    unit = "of dense FLOPs" if cm.metric == "flops" else "of dense decode bytes"
    if not 0.0 < target < 1.0:
        raise ConfigError(f"cost target {target} is outside (0, 1)",
                          f"static-depth on {model_name} reaches [{lo:.3f}, 1) {unit}")
    if target < lo - 1e-9:
        raise ConfigError(
            f"cost target {target} is below what static-depth can reach on {model_name}: keeping 1 of "
            f"{cm.num_layers} layers costs {lo:.3f} {unit} (the dense floor of embeddings and lm_head is "
            f"{cm.model_floor / cm.dense_total:.3f})",
            f"choose a cost target in [{lo:.3f}, 1); one layer is {cm.layer_fraction:.3f} of dense",
        )
    return sorted(cost.layers_to_drop(cm, target + 1e-9, influence_order(influence)))


# ----------------------------------------------------------------------------- pipeline
SELECTION_FILE = "static_depth.json"


def cost_target_of(settings) -> float:
    """The run's cost target (``routing.cost_target``, default ``DEFAULT_COST_TARGET``)."""
    t = settings.routing.cost_target
    return DEFAULT_COST_TARGET if t is None else float(t)


def select(settings, model, packed_train: torch.Tensor, *, calibration_sequences: int = 64) -> dict:
    """Block Influence of ``model`` on up to ``calibration_sequences`` training sequences, then
    the layers to remove for the run's cost target.

    Returns:
        ``{removed, kept, influence, num_layers, cost_target, cost_metric, cost_fraction,
        calibration_tokens}``.

    Raises:
        ConfigError: an unreachable cost target (checked before any forward pass).
    """
    from wide_cli.models.arch import model_shape

    shape = model_shape(model.config)
    metric = settings.routing.cost_metric
    target = cost_target_of(settings)
    cm = depth_cost(shape, metric=metric, seq_len=settings.train.seq_len)
    layers_to_remove(torch.zeros(shape.num_layers), cm, target, model_name=settings.model.name)
    seqs = packed_train[:calibration_sequences]
    bi = block_influence(model, seqs, batch_size=settings.train.batch_size)
    removed = layers_to_remove(bi, cm, target, model_name=settings.model.name)
    return {
        "removed": removed,
        "kept": [i for i in range(shape.num_layers) if i not in removed],
        "influence": [round(float(v), 6) for v in bi],
        "num_layers": shape.num_layers,
        "cost_target": target,
        "cost_metric": metric,
        "cost_fraction": fraction_after(cm, len(removed)),
        "calibration_tokens": int(seqs.numel()),
    }


def read_selection(run) -> dict:
    """``<run>/stage1/static_depth.json``. Raises CheckpointError when stage 1 has not run."""
    import json

    from wide_cli.errors import CheckpointError

    p = Path(run.stage1) / SELECTION_FILE
    if not p.is_file():
        raise CheckpointError(f"{p} is missing", f"run `wide train --run-dir {run.root}` first")
    return json.loads(p.read_text())


def train(settings, run, *, loaded, resume: bool = False, progress: bool = True):
    """Stage 1 of static-depth: rank layers by Block Influence and record which are removed
    (``<run>/stage1/static_depth.json``); with ``settings.stage2.enabled`` also heal with LoRA
    (``<run>/stage2/adapter.safetensors``). Returns the TrainResult of healing (steps 0 without)."""
    from wide_cli.atomic import atomic_write_json
    from wide_cli.pipeline.common import packed_data
    from wide_cli.train.loop import TrainResult

    packed = packed_data(settings, loaded.tokenizer, run)
    p = Path(run.stage1) / SELECTION_FILE
    if resume and p.is_file():
        sel = read_selection(run)
    else:
        sel = select(settings, loaded.model, packed.train)
        run.stage1.mkdir(parents=True, exist_ok=True)
        atomic_write_json(p, sel)
    log.info("static-depth: removing layers %s (cost %.3f of dense %s)", sel["removed"], sel["cost_fraction"],
             sel["cost_metric"])
    if not settings.stage2.enabled:
        return TrainResult(0, 0, 0.0)
    return heal_run(settings, run, loaded=loaded, resume=resume, progress=progress)


def heal_run(settings, run, *, loaded, resume: bool = False, progress: bool = True):
    """LoRA healing of the run's layer-pruned model; writes ``<run>/stage2/adapter.safetensors``."""
    from wide_cli.atomic import atomic_save_safetensors
    from wide_cli.filenames import ADAPTER_FILE
    from wide_cli.pipeline.common import packed_data
    from wide_cli.routing import attach_routers
    from wide_cli.train.loop import train_stage
    from wide_cli.train.lora import adapter_state_dict, wrap_lora

    sel = read_selection(run)
    packed = packed_data(settings, loaded.tokenizer, run)
    model = healing_model(loaded.model, sel["removed"])
    # the training loop drives a RoutingState; a dense one routes nothing and adds no loss term
    attach_routers(model, PLAIN_ROUTING)
    for prm in model.parameters():
        prm.requires_grad_(False)
    torch.manual_seed(settings.train.seed)  # LoRA A's init: same run, same adapter
    peft_model = wrap_lora(model, settings.stage2)
    tcfg = dataclasses.replace(settings.train, steps=settings.stage2.steps, lr=settings.stage2.lr)
    ident = {"method": METHOD, "removed": sel["removed"], "train": tcfg.math_dict(), "data": settings.data.train,
             "stage2": {**settings.stage2.__dict__, "target_modules": list(settings.stage2.target_modules)}}
    res = train_stage(peft_model, packed.train, tcfg, stage_dir=run.stage2, identity=ident, resume=resume,
                      progress=progress, tau=(1.0, 1.0))
    atomic_save_safetensors(run.stage2 / ADAPTER_FILE, adapter_state_dict(peft_model))
    return res


def healing_model(model, removed: list[int]):
    """A copy of ``model`` with ``removed`` layers deleted, for LoRA healing (the original is
    untouched). The removed layers stay aside (``models.depth.drop_for_hybrid``) so that
    distillation's teacher (``train.distill``) is the source model with every layer, not the
    unhealed layer-pruned one."""
    import copy

    return drop_for_hybrid(copy.deepcopy(model), removed)


def pruned_model_from_run(settings, run, *, loaded):
    """The run's smaller model: the selected layers removed, the healing adapter merged when the
    run's stage 2 is on and done. Returns ``(model, selection, healed)``."""
    from wide_cli.filenames import ADAPTER_FILE

    sel = read_selection(run)
    model = remove_layers(loaded.model, sel["removed"])
    apath = run.stage2 / ADAPTER_FILE
    healed = bool(settings.stage2.enabled and apath.is_file())
    if healed:
        from safetensors.torch import load_file

        from wide_cli.train.lora import load_adapter, merge_lora, wrap_lora

        peft_model = wrap_lora(model, settings.stage2)
        load_adapter(peft_model, load_file(str(apath)))
        model = merge_lora(peft_model)
    return model, sel, healed


def export(settings, run, out: Path, *, loaded, export_format: str = "wide"):
    """Write the plain smaller checkpoint: fewer layers, a normal ``config.json`` (no routers,
    no remote code), ``wide_config.json`` recording the removed layers and their Block Influence.

    ``export_format`` ``wide`` and ``hf`` write the same files: the checkpoint already loads in
    plain transformers (``AutoModelForCausalLM``, no ``trust_remote_code``), which is what an hf
    export is for; it is recorded as a ``wide`` export (base ``config.json``, no modeling code).

    Raises:
        ConfigError: an unknown ``export_format``.
    """
    import json

    from wide_cli.export.writer import EXPORT_FORMATS, export_model
    from wide_cli.pipeline.common import shareable

    if export_format not in EXPORT_FORMATS:
        raise ConfigError(f"--format {export_format!r} unknown", f"choose one of {', '.join(EXPORT_FORMATS)}")
    model, sel, healed = pruned_model_from_run(settings, run, loaded=loaded)
    train_info = {}
    p = run.stage2 / RESULT_JSON
    if healed and p.is_file():
        r = json.loads(p.read_text())
        train_info["stage2"] = {k: r.get(k) for k in ("steps", "tokens", "seconds", "final")}
    wide_config = {
        "method": METHOD,
        # the export routes nothing: loaders treat it as a plain (dense) model of fewer layers
        "routing": PLAIN_ROUTING.to_dict(),
        "static_depth": sel,
        "source_model": {**loaded.provenance, "spec": shareable(loaded.source), "resolved": loaded.resolved,
                         "revision": loaded.revision},
        "lora": ({"merged": True, "rank": settings.stage2.lora_rank, "alpha": settings.stage2.lora_alpha,
                  "target_modules": list(settings.stage2.target_modules)} if healed else None),
        "train": train_info,
        "settings": settings.to_dict(),
        "metrics": {},
    }
    return export_model(model, loaded.tokenizer, Path(out), wide_config=wide_config)


# ----------------------------------------------------------------------------- hybrid: depth + width
#: ``<run>/calibration/drop_layers.json``: the layers a hybrid run (``RoutingConfig.drop_layers``)
#: removes before routing width in the rest, with the Block Influence they were chosen by.
DROP_FILE = "drop_layers.json"


def influence_order(influence) -> list[int]:
    """Layer indices, least influential first (ties in Block Influence: the later layer first)."""
    return sorted(range(len(influence)), key=lambda i: (float(influence[i]), -i))


def least_influential(influence, n: int) -> list[int]:
    """The ``n`` layers of lowest Block Influence, sorted by index."""
    return sorted(influence_order(influence)[:n])


def hybrid_selection(settings, model, packed_train: torch.Tensor, *, previous: dict | None = None,
                     calibration_sequences: int = 64) -> dict:
    """The ``settings.routing.drop_layers`` least influential layers of the dense ``model``, by
    Block Influence on up to ``calibration_sequences`` training sequences (reused from
    ``previous``, an earlier selection of the same run, when it has them).

    Returns:
        ``{removed, kept, influence, num_layers, calibration_tokens, cost_fraction, cost_metric}``;
        ``cost_fraction`` is the layer-pruned model's dense cost over the source's.
    """
    from wide_cli.models.arch import model_shape
    from wide_cli.routing.config import kept_shape

    shape = model_shape(model.config)
    n = int(settings.routing.drop_layers)
    if previous and previous.get("num_layers") == shape.num_layers and previous.get("influence"):
        bi, tokens = previous["influence"], previous["calibration_tokens"]
    else:
        seqs = packed_train[:calibration_sequences]
        bi = [round(float(v), 6) for v in block_influence(model, seqs, batch_size=settings.train.batch_size)]
        tokens = int(seqs.numel())
    removed = least_influential(bi, n)
    return {
        "removed": removed,
        "kept": [i for i in range(shape.num_layers) if i not in removed],
        "influence": bi,
        "num_layers": shape.num_layers,
        "calibration_tokens": tokens,
        "cost_metric": settings.routing.cost_metric,
        "cost_fraction": settings.routing.depth_fraction(kept_shape(shape, n), settings.train.seq_len),
    }


def apply_drop_layers(settings, run, loaded, *, packed=None) -> dict | None:
    """Hybrid depth + width (``routing.drop_layers``): remove the run's least influential layers
    from ``loaded.model`` in place, once (later calls see them gone). The selection is made by
    Block Influence on the training data the first time and kept in
    ``<run>/calibration/drop_layers.json``, so every stage removes the same layers.

    Returns the selection (``hybrid_selection``), or None without ``drop_layers``.

    Raises:
        CheckpointError: the model already lost other layers than the run's file names.
    """
    import json

    from wide_cli.atomic import atomic_write_json
    from wide_cli.errors import CheckpointError
    from wide_cli.pipeline.common import packed_data

    n = settings.routing.drop_layers
    if not n:
        return None
    path = Path(run.calibration) / DROP_FILE
    previous = json.loads(path.read_text()) if path.is_file() else None
    if previous is not None and len(previous["removed"]) == n and previous["cost_metric"] == settings.routing.cost_metric:
        sel = previous
    else:
        if is_layer_pruned(loaded.model):
            raise CheckpointError(f"{path} does not match drop-layers {n}",
                                  f"re-run `wide calibrate --run-dir {run.root}`")
        packed = packed or packed_data(settings, loaded.tokenizer, run)
        sel = hybrid_selection(settings, loaded.model, packed.train, previous=previous)
        Path(run.calibration).mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, sel)
    if not is_layer_pruned(loaded.model):
        drop_for_hybrid(loaded.model, sel["removed"])
        log.info("drop-layers %d: removed layers %s by Block Influence (%.3f of dense %s before routing)",
                 n, sel["removed"], sel["cost_fraction"], sel["cost_metric"])
    return sel


def dropped_layers_of_run(settings, run) -> dict | None:
    """The run's ``drop_layers.json`` (what a hybrid export records), None without drop-layers."""
    import json

    if not settings.routing.drop_layers:
        return None
    return json.loads((Path(run.calibration) / DROP_FILE).read_text())
