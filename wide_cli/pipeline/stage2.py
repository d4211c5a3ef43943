"""Stage 2 of the pipeline: LoRA recovery on top of the stage-1 routers (DESIGN.md §1).

Reads and writes the run directory like the other stages: ``<run>/stage2/adapter.safetensors``
and ``<run>/stage2/routers.safetensors`` (+ ``result.json``, whose identity names the stage-1
routers the adapter was trained on). The LoRA maths itself (wrap, load, merge) is the library
``wide_cli.train.lora``, which knows nothing of run directories.
"""

from __future__ import annotations

import dataclasses

import torch

from wide_cli.artifacts import is_router_tensor
from wide_cli.atomic import atomic_save_safetensors, atomic_write_json
from wide_cli.filenames import ADAPTER_FILE, RESULT_JSON, ROUTERS_FILE
from wide_cli.pipeline.common import load_backbone, packed_data, stage_identity
from wide_cli.pipeline.routers import routed_model_from_run, stage1_routers_sha256
from wide_cli.pipeline.rundir import model_identity, record_run
from wide_cli.pipeline.settings import Settings
from wide_cli.train.lora import adapter_state_dict, wrap_lora


def train_stage2(settings: Settings, run, *, resume: bool = False, progress: bool = True, on_step=None):
    """Stage 2 on a run whose stage 1 is done: LoRA + (unless frozen) routers.

    Trains with the shared loop (same loss), lr/steps from ``settings.stage2``, at the constant
    Gumbel temperature ``tau_end`` where stage 1 stopped; data parallel under torchrun like stage 1
    (rank 0 alone writes). Writes ``<run>/stage2/{adapter,routers}.safetensors`` and
    ``result.json`` (its identity holds the sha256 of the stage-1 routers it started from), then
    records the settings with stage 2 enabled in ``run.json``. For ``static-depth`` this is the
    healing of the layer-pruned model (``static_depth.heal_run``).

    Returns the ``TrainResult``.
    """
    from wide_cli.routing.model import router_state_dict
    from wide_cli.train import distributed
    from wide_cli.train.loop import train_stage

    info = distributed.dist_info()
    loaded = load_backbone(settings)
    settings = dataclasses.replace(settings, stage2=dataclasses.replace(settings.stage2, enabled=True))
    if settings.routing.method == "static-depth":  # healing of the layer-pruned model, no routers
        from wide_cli.pipeline import static_depth

        res = static_depth.heal_run(settings, run, loaded=loaded, resume=resume, progress=progress)
        record_run(run, settings.to_dict(), model_identity(loaded), resume=True)
        return res
    s1 = dataclasses.replace(settings, stage2=dataclasses.replace(settings.stage2, enabled=False))
    _, model = routed_model_from_run(s1, run, loaded=loaded)
    for p in model.parameters():
        p.requires_grad_(False)
    torch.manual_seed(settings.train.seed)  # LoRA A's init draws from the global RNG: same run, same adapter
    peft_model = wrap_lora(model, settings.stage2)
    if not settings.stage2.freeze_routers:
        for n, p in peft_model.named_parameters():
            if is_router_tensor(n):
                p.requires_grad_(True)
    tcfg = dataclasses.replace(settings.train, steps=settings.stage2.steps, lr=settings.stage2.lr)
    packed = packed_data(settings, loaded.tokenizer, run)
    ident = stage_identity(settings, loaded, stage="stage2")
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
    atomic_save_safetensors(run.stage2 / ADAPTER_FILE, adapter_state_dict(peft_model))
    atomic_save_safetensors(run.stage2 / ROUTERS_FILE, router_state_dict(peft_model))
    # run.json now says stage 2 is on (with these settings): `wide export` merges the adapter
    record_run(run, settings.to_dict(), model_identity(loaded), resume=True)
    return res


def save_joint_stage2(peft_model, run, res) -> None:
    """After stage 1 trained LoRA jointly with the routers (``stage2.joint``): write the adapter
    and routers where ``wide export`` looks for a stage 2 (``<run>/stage2/``), with a
    ``result.json`` whose identity names the stage-1 routers they belong to."""
    from wide_cli.routing.model import router_state_dict

    run.stage2.mkdir(parents=True, exist_ok=True)
    atomic_save_safetensors(run.stage2 / ADAPTER_FILE, adapter_state_dict(peft_model))
    atomic_save_safetensors(run.stage2 / ROUTERS_FILE, router_state_dict(peft_model))
    atomic_write_json(run.stage2 / RESULT_JSON, {**res.to_dict(), "joint": True, "identity": {
        "stage1_routers_sha256": stage1_routers_sha256(run)}})
