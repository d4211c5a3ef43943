"""LoRA adapters with PEFT on a (routed) model: wrap, read out, load strictly, merge.

LoRA (Hu et al. 2021): ``W x + (alpha / r) * B A x`` on the target linear layers; merging adds
``(alpha / r) * B @ A`` to ``W``. A library: it takes LoRA settings and models, and knows nothing
of run directories or pipeline stages (the pipeline's stage 2 is ``wide_cli.pipeline.stage2``).
"""

from __future__ import annotations

from typing import Protocol

import torch

from wide_cli.errors import CheckpointError


class LoraSettings(Protocol):
    """The LoRA settings these functions read (``pipeline.settings.Stage2Config`` has them)."""

    lora_rank: int
    lora_alpha: float
    lora_dropout: float
    target_modules: tuple[str, ...]


def lora_config(cfg: LoraSettings):
    """The ``peft.LoraConfig`` of ``cfg`` (no bias, causal-LM task)."""
    from peft import LoraConfig

    return LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=list(cfg.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )


def wrap_lora(model, cfg: LoraSettings):
    """Wrap a routed model with PEFT LoRA adapters (fp32 adapter weights: low-precision
    adapters lose small updates).

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
    """The adapter tensors of a PEFT model (PEFT names), detached, contiguous, on CPU."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(peft_model).items()}


def load_adapter(peft_model, tensors: dict[str, torch.Tensor]) -> None:
    """Load adapter tensors strictly: a mismatch is an error, never a silent no-op.

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
            (an adapter that silently did nothing), or NaN/Inf after merging.
    """
    before = {}
    if check_changed:
        for n, m in peft_model.named_modules():
            if hasattr(m, "lora_B") and "default" in m.lora_B and m.lora_B["default"].weight.abs().sum() > 0:
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
