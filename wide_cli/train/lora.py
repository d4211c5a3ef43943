"""Stage 2: LoRA recovery with PEFT on top of the stage-1 routers (DESIGN.md §1).

LoRA (Hu et al. 2021) r=16, alpha=32, dropout 0.1 on q,k,v,o,gate,up,down by default; routers
keep training unless frozen; lr 2e-4. The adapter is stored in ``<run>/stage2/adapter.safetensors``
and merged into the base weights for export: ``W += (alpha / r) * B @ A``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from wide_cli.errors import CheckpointError
from wide_cli.pipeline.settings import Settings, Stage2Config

ADAPTER = "adapter.safetensors"
ROUTERS = "routers.safetensors"


def lora_config(cfg: Stage2Config):
    from peft import LoraConfig

    return LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=list(cfg.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )


def wrap_lora(model, cfg: Stage2Config):
    """Wrap a routed model with PEFT LoRA adapters (fp32 adapter weights, public case B11).

    Raises:
        CheckpointError: a target module name that matches nothing in the model.
    """
    from peft import get_peft_model

    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    absent = [t for t in cfg.target_modules if t not in names]
    if absent:
        raise CheckpointError(
            f"LoRA target modules {absent} do not exist in this model",
            "use names among q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj",
        )
    return get_peft_model(model, lora_config(cfg), autocast_adapter_dtype=True)


def adapter_state_dict(peft_model) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    return {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(peft_model).items()}


def load_adapter(peft_model, tensors: dict[str, torch.Tensor]) -> None:
    """Load adapter tensors strictly (public case B22: never a silent no-op).

    Raises:
        CheckpointError: listing unmatched names or mismatched shapes.
    """
    from peft import set_peft_model_state_dict

    expected = adapter_state_dict(peft_model)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    bad = sorted(k for k in set(expected) & set(tensors) if expected[k].shape != tensors[k].shape)
    if missing or unexpected or bad:
        raise CheckpointError(
            "LoRA adapter does not match the model: "
            f"missing {missing[:3]}, unexpected {unexpected[:3]}, "
            f"shape mismatch {[(k, tuple(tensors[k].shape), tuple(expected[k].shape)) for k in bad[:3]]}",
            "the adapter was trained on another model or with other LoRA settings",
        )
    set_peft_model_state_dict(peft_model, tensors)


def merge_lora(peft_model, *, check_changed: bool = True):
    """Merge LoRA into the base weights (``W += alpha/r * B @ A``) and unwrap.

    Raises:
        CheckpointError: a targeted weight left unchanged by the merge while its B is non-zero
            (an adapter that silently did nothing, public case B22), or NaN/Inf after merging.
    """
    before = {}
    if check_changed:
        for n, m in peft_model.named_modules():
            if hasattr(m, "lora_B") and "default" in m.lora_B:
                if m.lora_B["default"].weight.abs().sum() > 0:
                    before[n] = m.base_layer.weight.detach().clone()
    merged = peft_model.merge_and_unload()
    if check_changed:
        mods = dict(merged.named_modules())
        for n, w in before.items():
            name = n.removeprefix("base_model.model.")
            if torch.equal(mods[name].weight.detach(), w):
                raise CheckpointError(f"LoRA merge left {name}.weight unchanged", "the adapter was not applied")
    for n, p in merged.named_parameters():
        if not torch.isfinite(p).all():
            raise CheckpointError(f"{n} has NaN/Inf after merging LoRA", "the stage-2 run diverged")
    return merged


def train_stage2(settings: Settings, run, *, resume: bool = False, progress: bool = True, on_step=None):
    """Stage 2 on a run whose stage 1 is done: LoRA + (unless frozen) routers.

    Trains with the shared loop (same loss), lr/steps from ``settings.stage2``, at the constant
    Gumbel temperature ``tau_end`` where stage 1 stopped; data parallel under torchrun like stage 1
    (rank 0 alone writes). Writes ``<run>/stage2/{adapter,routers}.safetensors`` and
    ``result.json`` (its identity holds the sha256 of the stage-1 routers it started from), then
    records the settings with stage 2 enabled in ``run.json``.
    """
    import dataclasses

    from wide_cli.pipeline import stages
    from wide_cli.pipeline.rundir import model_identity, record_run
    from wide_cli.routing.model import router_state_dict
    from wide_cli.train import distributed
    from wide_cli.train.loop import train_stage

    info = distributed.dist_info()
    loaded = stages.load_backbone(settings)
    settings = dataclasses.replace(settings, stage2=dataclasses.replace(settings.stage2, enabled=True))
    if settings.routing.method == "static-depth":  # healing of the layer-pruned model, no routers
        from wide_cli.pipeline import static_depth

        res = static_depth.heal_run(settings, run, loaded=loaded, resume=resume, progress=progress)
        record_run(run, settings.to_dict(), model_identity(loaded), resume=True)
        return res
    s1 = dataclasses.replace(settings, stage2=dataclasses.replace(settings.stage2, enabled=False))
    _, model = stages.routed_model_from_run(s1, run, loaded=loaded)
    for p in model.parameters():
        p.requires_grad_(False)
    torch.manual_seed(settings.train.seed)  # LoRA A's init draws from the global RNG: same run, same adapter
    peft_model = wrap_lora(model, settings.stage2)
    if not settings.stage2.freeze_routers:
        for n, p in peft_model.named_parameters():
            if ".router_attention." in n or ".router_ffn." in n:
                p.requires_grad_(True)
    tcfg = dataclasses.replace(settings.train, steps=settings.stage2.steps, lr=settings.stage2.lr)
    packed = stages._packed(settings, loaded.tokenizer, run)
    ident = stages._identity(settings, loaded, stage="stage2")
    # the stage-1 routers this adapter is trained on: a retrained stage 1 invalidates it
    ident["stage1_routers_sha256"] = stage1_routers_sha256(run)
    # The routers arrive annealed: stage 2 holds the final stage-1 temperature instead of
    # re-heating to tau_start, which would randomise the decisions LoRA is recovering from.
    tau_end = settings.routing.tau_end
    res = train_stage(peft_model, packed.train, tcfg, stage_dir=run.stage2, identity=ident, resume=resume,
                      progress=progress, on_step=on_step, tau=(tau_end, tau_end), rank=info.rank,
                      world=info.world, ddp_model=distributed.wrap(peft_model, settings.model.device))
    if not info.is_main:  # rank 0 alone writes
        return res
    save_file(adapter_state_dict(peft_model), str(run.stage2 / (ADAPTER + ".tmp")))
    (run.stage2 / (ADAPTER + ".tmp")).replace(run.stage2 / ADAPTER)
    save_file(router_state_dict(peft_model), str(run.stage2 / (ROUTERS + ".tmp")))
    (run.stage2 / (ROUTERS + ".tmp")).replace(run.stage2 / ROUTERS)
    # run.json now says stage 2 is on (with these settings): `wide export` merges the adapter
    record_run(run, settings.to_dict(), model_identity(loaded), resume=True)
    return res


def save_joint_stage2(peft_model, settings: Settings, run, res) -> None:
    """After stage 1 trained LoRA jointly with the routers (``stage2.joint``): write the adapter
    and routers where ``wide export`` looks for a stage 2 (``<run>/stage2/``), with a
    ``result.json`` whose identity names the stage-1 routers they belong to."""
    from wide_cli.atomic import atomic_write_json
    from wide_cli.routing.model import router_state_dict

    run.stage2.mkdir(parents=True, exist_ok=True)
    save_file(adapter_state_dict(peft_model), str(run.stage2 / (ADAPTER + ".tmp")))
    (run.stage2 / (ADAPTER + ".tmp")).replace(run.stage2 / ADAPTER)
    save_file(router_state_dict(peft_model), str(run.stage2 / (ROUTERS + ".tmp")))
    (run.stage2 / (ROUTERS + ".tmp")).replace(run.stage2 / ROUTERS)
    atomic_write_json(run.stage2 / "result.json", {**res.to_dict(), "joint": True, "identity": {
        "stage1_routers_sha256": stage1_routers_sha256(run)}})


def stage1_routers_sha256(run) -> str | None:
    """sha256 of ``<run>/stage1/routers.safetensors`` (None when absent)."""
    from wide_cli.export.manifest import sha256_file

    p = Path(run.stage1) / "routers.safetensors"
    return sha256_file(p) if p.is_file() else None


def apply_stage2(model, stage2_dir: Path, cfg: Stage2Config):
    """Load stage-2 routers and adapter onto a routed model and merge the adapter.

    Returns the merged routed model (routing state unchanged).
    """
    from wide_cli.routing.model import load_router_state_dict

    stage2_dir = Path(stage2_dir)
    for f in (ADAPTER, ROUTERS):
        if not (stage2_dir / f).is_file():
            raise CheckpointError(f"{stage2_dir / f} is missing", "run `wide train --stage 2` first")
    load_router_state_dict(model, load_file(str(stage2_dir / ROUTERS)))
    peft_model = wrap_lora(model, cfg)
    load_adapter(peft_model, load_file(str(stage2_dir / ADAPTER)))
    return merge_lora(peft_model)
