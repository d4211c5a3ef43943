"""Load a wide export back into a routed Hugging Face model, strictly."""

from __future__ import annotations

import math

import torch
from safetensors import SafetensorError

from wide_cli.artifacts import (
    ExportInfo,
    PrunedModel,
    is_export,
    open_export,
    read_routers,
    routing_config_from,
    static_keep_from_routers,
    unreadable_weights,
)
from wide_cli.errors import CheckpointError
from wide_cli.filenames import CONFIG_JSON

__all__ = ["PrunedModel", "is_export", "load_pruned", "next_token_entropy"]


def next_token_entropy(model, tokenizer, prompt: str = "The quick brown fox jumps over the lazy dog.") -> float:
    """Entropy (nats) of the next-token distribution after ``prompt``; ln(vocab) means uniform."""
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(next(model.parameters()).device)
    with torch.no_grad():
        logits = model(ids).logits[0, -1].float()
    p = torch.softmax(logits, -1)
    return float(-(p * torch.log(p.clamp_min(1e-30))).sum())


def load_pruned(
    path,
    *,
    dtype: torch.dtype = torch.float32,
    device="cpu",
    verify: bool = True,
    allow_extra: bool = False,
    smoke_check: bool = True,
    trust_remote_code: bool = False,
) -> PrunedModel:
    """Load an export written by ``export_model`` (``--format hf`` exports go through
    ``wide_cli.export.hf_format.load_hf_export``: transformers with the export's generated code).

    Args:
        path: export directory.
        dtype: backbone dtype (routers stay fp32).
        device: torch device.
        verify: check ``manifest.json`` (sha256 + size of every file) first.
        allow_extra: tolerate unexpected tensors in the weights (warn instead of failing).
        smoke_check: after loading, require next-token entropy on a fixed prompt to be below
            ln(vocab) - 0.01 (uniform logits mean weights were silently lost).
        trust_remote_code: for an ``hf`` export, run its shipped Python files (see
            ``load_hf_export``); otherwise they are never executed.

    Raises:
        CheckpointError: missing/corrupt files, a manifest from another export, missing or
            unexpected tensors (listed), router shape mismatch, uniform logits.
    """
    import warnings

    from transformers import AutoModelForCausalLM

    from wide_cli.routing.model import attach_routers, load_router_state_dict

    path, wcfg, tokenizer = open_export(path, verify=verify)
    export = ExportInfo(wcfg, path)
    if export.export_format == "hf":  # generated remote code; its manifest is verified
        from wide_cli.export.hf_format import load_hf_export

        pm = load_hf_export(path, dtype=dtype, device=device, verify=False, trust_remote_code=trust_remote_code)
        if smoke_check:
            _smoke_check(pm.model, pm.tokenizer, path)
        return pm
    if export.weight_format in ("int8", "int4"):
        fmt = export.weight_format
        raise CheckpointError(
            f"{path} stores {fmt} weights for wide's runtime (`wide export --weights {fmt}`); "
            "the transformers loaders need float weights",
            f"use `wide generate` / `wide bench` on it, or export again without --weights {fmt}",
        )
    from transformers import AutoConfig

    from wide_cli.models.consistency import check_export_shapes

    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {export.config_path}: {e}", "re-run `wide export`") from None
    check_export_shapes(path, config)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            path, config=config, dtype=dtype, output_loading_info=True, local_files_only=True
        )
    except (OSError, ValueError, RuntimeError, SafetensorError) as e:
        bad = unreadable_weights(path)
        raise CheckpointError(
            f"cannot load the weights of {path}: {bad + ': ' if bad else ''}{e}", "re-run `wide export`"
        ) from None
    missing = sorted(info.get("missing_keys") or [])
    unexpected = sorted(info.get("unexpected_keys") or [])
    mismatched = sorted(str(k) for k in (info.get("mismatched_keys") or []))
    if missing or mismatched or (unexpected and not allow_extra):
        raise CheckpointError(
            f"weights of {path} do not match its {CONFIG_JSON}: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}, mismatched {mismatched[:5]}",
            "the export is corrupt or was edited; re-run `wide export` (or pass allow_extra for extra tensors)",
        )
    if unexpected:
        warnings.warn(f"ignoring unexpected tensors in {path}: {unexpected[:5]}", stacklevel=2)
    model = model.to(device).eval()
    cfg = routing_config_from(wcfg)
    static_keep = None
    routers = {}
    if cfg.method != "dense":
        routers = read_routers(export.routers_path)
        if cfg.method == "static-width":
            static_keep = static_keep_from_routers(routers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        attach_routers(model, cfg, static_keep=static_keep)
    if routers:
        load_router_state_dict(model, routers)
    model.wide_routing.set_mode("dense" if cfg.method == "dense" else "argmax")
    if smoke_check:
        _smoke_check(model, tokenizer, path)
    return PrunedModel(model, tokenizer, wcfg, path)


def _smoke_check(model, tokenizer, path) -> None:
    """Uniform next-token logits on a fixed prompt mean the weights were silently lost (a
    loader that fills missing tensors with random or zero values would otherwise pass)."""
    h = next_token_entropy(model, tokenizer)
    if h >= math.log(model.config.vocab_size) - 0.01:
        raise CheckpointError(
            f"{path}: next-token distribution is uniform (entropy {h:.4f} nats); weights were lost",
            "re-run `wide export`",
        )
