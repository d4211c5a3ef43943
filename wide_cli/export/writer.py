"""Write a deployable export directory (DESIGN.md §2).

Layout (``wide`` format): ``config.json`` and tokenizer files (the base model's),
``model.safetensors`` (backbone, Hugging Face names, LoRA merged; sharded with an index when
large), ``routers.safetensors``, ``wide_config.json``, ``README.md`` (model card),
``manifest.json``. The ``hf`` format (``hf_format.py``) loads in plain transformers with
``trust_remote_code``. Written into a temp directory and renamed into place.
"""

from __future__ import annotations

import datetime as _dt
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from wide_cli.artifacts import EXPORT_FORMAT_VERSION, backbone_state_dict, check_export_target
from wide_cli.atomic import atomic_directory, atomic_write_json
from wide_cli.errors import CheckpointError
from wide_cli.export.manifest import write_manifest
from wide_cli.export.model_card import write_model_card
from wide_cli.filenames import MANIFEST, ROUTERS_FILE, WEIGHTS_FILE, WIDE_CONFIG
from wide_cli.routing.model import router_state_dict
from wide_cli.version import __version__

EXPORT_FORMATS = ("wide", "hf")


@dataclass(frozen=True)
class ExportResult:
    """What ``export_model`` wrote: ``path`` (the final directory), ``export_id``, ``files``
    (relative paths) and ``bytes`` (total size)."""

    path: Path
    export_id: str
    files: list[str]
    bytes: int


def check_finite(tensors: dict[str, torch.Tensor], what: str) -> None:
    """Raise CheckpointError naming the first tensor with NaN/Inf (a diverged run must not
    produce a deployable export)."""
    for name, t in tensors.items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise CheckpointError(
                f"{what} tensor {name} contains NaN/Inf; refusing to export",
                "the run diverged: resume from an earlier checkpoint or lower --lr",
            )


def planned_features(model, wide_config: dict, export_format: str, weight_format: str = "fp32") -> frozenset:
    """``wide_cli.features.export_features`` of the export ``export_model`` would write for
    ``model`` (``model.wide_routing`` set, or a plain model) and ``wide_config``."""
    from wide_cli.features import export_features

    config = model.config.to_dict()
    state = getattr(model, "wide_routing", None)
    if export_format == "hf" and state is not None:
        config["wide_routing"] = {"routing": state.cfg.to_dict()}
        if state.cfg.method == "static-width":  # write_hf narrows it physically
            config["wide_layer_heads"] = []
    wc = {**wide_config, "export_format": export_format}
    if weight_format in ("int8", "int4"):
        wc["weight_format"] = {"format": weight_format}
    return export_features(config, wc)


def export_model(
    model,
    tokenizer,
    out_dir: Path,
    *,
    wide_config: dict,
    max_shard_size: str = "2GB",
    export_format: str = "wide",
    weight_format: str = "fp32",
    importance: dict | None = None,
    importance_info: dict | None = None,
) -> ExportResult:
    """Export a routed model (LoRA already merged) to ``out_dir``, atomically.

    Args:
        model: a routed ``*ForCausalLM`` (``model.wide_routing`` set). Its weights are saved in
            their current dtype.
        tokenizer: saved beside it, unchanged.
        out_dir: final directory; an existing export there is replaced only once the new one is
            complete (anything else there is refused: ``artifacts.check_export_target``).
        wide_config: method settings, measured sparsity, source model, metrics... stored as
            ``wide_config.json`` (``format``, ``format_version``, ``wide_version``, ``export_id``
            and ``created`` are added here).
        importance: with ``weight_format`` ``int4``: HF weight name -> ``[K]`` mean squared input
            (``calibrate/importance.py``), which weights the choice of those tensors' scales
            (``quant.quantize_int4``); None = the plain rule. Same bytes either way.
        importance_info: what ``importance`` was collected on (tokens, data), recorded in
            ``wide_config.json`` under ``weight_format.importance``.

    Raises:
        CheckpointError: a router or backbone tensor with NaN/Inf.
        ConfigError: ``out_dir`` is a file, a link or a directory that is not a wide export.
        UnsupportedFeature: ``export_format`` ``hf`` for a model that uses a feature the hf
            modeling code does not run (``wide_cli.features``), before anything is written.
    """
    check_export_target(out_dir)
    if export_format == "hf":
        from wide_cli.features import check_features

        check_features(planned_features(model, wide_config, export_format, weight_format), "hf", out_dir)
    routers = router_state_dict(model)
    check_finite(routers, "router")
    backbone = backbone_state_dict(model)
    check_finite(backbone, "backbone")
    export_id = uuid.uuid4().hex
    with atomic_directory(Path(out_dir)) as tmp:
        extra = {}
        if export_format == "hf":
            from wide_cli.export.hf_format import write_hf

            extra = write_hf(model, tokenizer, tmp, export_id=export_id, max_shard_size=max_shard_size)
        elif weight_format in ("int8", "int4"):
            from wide_cli.quant import SCHEMES, quantize_state_dict

            st = model.wide_routing
            qsd = quantize_state_dict(
                {k: v.float() for k, v in backbone.items()},
                attn_cols=st.layout.attn_group_size * st.shape.head_dim, ffn_group_size=st.layout.ffn_group_size,
                fmt=weight_format, importance=importance,
            )  # fmt: skip
            if getattr(model.config, "tie_word_embeddings", False):
                qsd = {k: v for k, v in qsd.items() if not k.startswith("lm_head.")}
            model.config.save_pretrained(tmp)
            if getattr(model, "generation_config", None) is not None:
                model.generation_config.save_pretrained(tmp)
            save_file(qsd, str(tmp / WEIGHTS_FILE), metadata={"format": "pt", "wide_weight_format": weight_format})
            tokenizer.save_pretrained(tmp)
            if routers:
                save_file(routers, str(tmp / ROUTERS_FILE), metadata={"format": "pt", "wide_export_id": export_id})
            extra = {"weight_format": {"format": weight_format, "scheme": SCHEMES[weight_format]}}
            if importance is not None:
                extra["weight_format"]["importance"] = importance_info or {}
        else:
            model.save_pretrained(tmp, state_dict=backbone, max_shard_size=max_shard_size)
            tokenizer.save_pretrained(tmp)
            if routers:
                save_file(routers, str(tmp / ROUTERS_FILE), metadata={"format": "pt", "wide_export_id": export_id})
        cfg = {
            "format": "wide",
            "format_version": EXPORT_FORMAT_VERSION,
            "export_format": export_format,
            "wide_version": __version__,
            "export_id": export_id,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            **extra,
            **wide_config,
        }
        atomic_write_json(tmp / WIDE_CONFIG, cfg)
        write_model_card(tmp, cfg, export_format=export_format, name=Path(out_dir).name)
        manifest = write_manifest(tmp, export_id=export_id, weight_format=weight_format)
    files = sorted(manifest["files"]) + [MANIFEST]
    total = sum(v["size"] for v in manifest["files"].values())
    return ExportResult(Path(out_dir), export_id, files, total)
