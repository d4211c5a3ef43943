"""The ``hf`` export format: a directory that plain ``transformers`` loads with
``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)``, no ``wide`` needed.

Layout (besides README.md, wide_config.json and manifest.json, written by ``writer.py``):

- ``config.json``: the base config with ``model_type: wide_<base>``, ``architectures:
  [Wide<Base>ForCausalLM]``, ``auto_map`` to the shipped code, ``wide_routing`` (routing settings
  and group layout) and, for static width, per-layer sizes ``wide_layer_heads`` (kept query-head
  indices) and ``wide_layer_intermediate_sizes``.
- ``configuration_wide.py``, ``modeling_wide.py``: generated from the package's routing code
  (``modeling_template.py``).
- ``model.safetensors`` (sharded with ``model.safetensors.index.json`` when large): backbone with
  Hugging Face names plus the routers ``model.layers.{i}.router_{attention,ffn}.{compressor,
  router}.{weight,bias}`` (fp32), in one set of weight files.
- tokenizer files and ``generation_config.json``.

Static width is exported physically smaller: the removed query heads' ``q_proj`` rows (and bias)
and ``o_proj`` columns, and the removed channels' ``gate_proj`` / ``up_proj`` rows and
``down_proj`` columns are gone. K/V projections are never narrowed (removing a head group never
removes a KV head), so the KV cache keeps its shape.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from wide_cli.artifacts import PrunedModel, backbone_state_dict, open_export, unreadable_weights
from wide_cli.atomic import atomic_write_json
from wide_cli.export.modeling_template import (
    ARCH_PREFIX,
    CONFIGURATION_FILE,
    MODELING_FILE,
    render_configuration,
    render_modeling,
)
from wide_cli.filenames import CONFIG_JSON, WEIGHTS_INDEX
from wide_cli.models.arch import ROUTED_MODULES


# ----------------------------------------------------------------------------- pure functions
def keep_masks_of_model(model) -> dict[tuple[int, str], torch.Tensor]:
    """``{(layer, module): [G] bool}`` keep masks of a static-width routed model (True = kept);
    a module without a router keeps every group."""
    from wide_cli.routing.model import decoder_layers

    state = model.wide_routing
    out = {}
    for i, layer in enumerate(decoder_layers(model)):
        for module in ROUTED_MODULES:
            r = getattr(layer, f"router_{module}", None)
            g = state.groups(module)
            out[(i, module)] = r.keep.detach().cpu().bool() if r is not None else torch.ones(g, dtype=torch.bool)
    return out


def compact_static(
    tensors: dict[str, torch.Tensor],
    keep: dict[tuple[int, str], torch.Tensor],
    *,
    num_layers: int,
    head_dim: int,
    attn_group_size: int,
    ffn_group_size: int,
) -> tuple[dict[str, torch.Tensor], list[list[int]], list[int]]:
    """Physically remove the dropped query heads and FFN channels of a static-width model.

    Args:
        tensors: backbone tensors with HF names (``q_proj.weight [H*d, D]``, ``o_proj.weight
            [D, H*d]``, ``gate_proj``/``up_proj.weight [F, D]``, ``down_proj.weight [D, F]``,
            optional biases); not modified.
        keep: ``{(layer, 'attention'): [G_a] bool, (layer, 'ffn'): [G_f] bool}``, True = kept.
        head_dim: d; attn_group_size: query heads per group; ffn_group_size: channels per group.

    Returns:
        ``(tensors, kept_heads, intermediate_sizes)``: new tensors (k/v, norms and everything
        else unchanged), per layer the sorted original indices of the kept query heads, and per
        layer the number of kept FFN channels.
    """
    out = dict(tensors)
    kept_heads, inter = [], []
    for i in range(num_layers):
        p = f"model.layers.{i}."
        heads = keep[(i, "attention")].repeat_interleave(attn_group_size)  # [H] bool
        q_rows = heads.repeat_interleave(head_dim).nonzero().flatten()  # kept rows of [H*d]
        chans = keep[(i, "ffn")].repeat_interleave(ffn_group_size).nonzero().flatten()  # kept of [F]
        for name in ("q_proj.weight", "q_proj.bias"):
            if p + "self_attn." + name in out:
                out[p + "self_attn." + name] = out[p + "self_attn." + name].index_select(0, q_rows).contiguous()
        out[p + "self_attn.o_proj.weight"] = out[p + "self_attn.o_proj.weight"].index_select(1, q_rows).contiguous()
        for name in ("gate_proj.weight", "gate_proj.bias", "up_proj.weight", "up_proj.bias"):
            if p + "mlp." + name in out:
                out[p + "mlp." + name] = out[p + "mlp." + name].index_select(0, chans).contiguous()
        out[p + "mlp.down_proj.weight"] = out[p + "mlp.down_proj.weight"].index_select(1, chans).contiguous()
        kept_heads.append(heads.nonzero().flatten().tolist())
        inter.append(int(chans.numel()))
    return out, kept_heads, inter


def hf_config_dict(config, routing: dict, layout: dict, *, kept_heads=None, intermediate_sizes=None) -> dict:
    """``config.json`` of an hf export: the base config plus ``auto_map`` and the wide fields.

    Args:
        config: the base model's ``PretrainedConfig`` (head_dim, rope settings, ... kept as is).
        routing: ``RoutingConfig.to_dict()``; layout: the ``GroupLayout`` fields.
        kept_heads / intermediate_sizes: per-layer sizes of a physically narrowed static export.
    """
    mt = config.model_type
    prefix = ARCH_PREFIX[mt]
    d = config.to_diff_dict()  # what save_pretrained writes: the non-default fields
    d.pop("_name_or_path", None)  # a local path of the machine that exported it
    d.update(
        architectures=[f"Wide{prefix}ForCausalLM"],
        model_type=f"wide_{mt}",
        auto_map={
            "AutoConfig": f"{CONFIGURATION_FILE.removesuffix('.py')}.Wide{prefix}Config",
            "AutoModelForCausalLM": f"{MODELING_FILE.removesuffix('.py')}.Wide{prefix}ForCausalLM",
        },
        wide_routing={"routing": dict(routing), "layout": dict(layout)},
    )
    if kept_heads is not None:
        d["wide_layer_heads"] = [list(map(int, h)) for h in kept_heads]
        d["wide_layer_intermediate_sizes"] = [int(n) for n in intermediate_sizes]
    return d


def _unshare(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous tensors with no two sharing storage (safetensors refuses aliases)."""
    seen, out = set(), {}
    for k, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        ptr = (t.untyped_storage().data_ptr(), t.storage_offset()) if t.numel() else None
        if ptr is not None and ptr in seen:
            t = t.clone()
        elif ptr is not None:
            seen.add(ptr)
        out[k] = t
    return out


def save_weights(tensors: dict[str, torch.Tensor], dest: Path, *, max_shard_size: str, metadata: dict) -> list[str]:
    """Write ``model.safetensors`` (or shards + ``model.safetensors.index.json``) to ``dest``.

    Returns the written file names.
    """
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    split = split_torch_state_dict_into_shards(tensors, max_shard_size=max_shard_size)
    names = []
    for fname, keys in split.filename_to_tensors.items():
        save_file({k: tensors[k] for k in keys}, str(dest / fname), metadata={"format": "pt", **metadata})
        names.append(fname)
    if split.is_sharded:
        atomic_write_json(dest / WEIGHTS_INDEX, {"metadata": {**split.metadata}, "weight_map": split.tensor_to_filename})
        names.append(WEIGHTS_INDEX)
    return names


# ----------------------------------------------------------------------------- writer
def write_hf(model, tokenizer, dest: Path, *, export_id: str, max_shard_size: str = "2GB") -> dict:
    """Write the hf-format files of a routed model (``model.wide_routing`` set) into ``dest``
    (the writer's temp directory; README, wide_config and manifest are added by the caller).

    Returns a summary for ``wide_config.json``: for static width ``{"static": {kept_heads,
    intermediate_sizes, kept_groups: {attention: [[g, ...] per layer], ffn: [...]}}}``, else ``{}``.
    """
    from wide_cli.routing.model import router_state_dict

    state = model.wide_routing
    cfg, layout = state.cfg, state.layout
    base = model.config
    backbone = backbone_state_dict(model)
    if getattr(base, "tie_word_embeddings", False):
        backbone.pop("lm_head.weight", None)  # transformers re-ties it from embed_tokens (tied embeddings)
    info: dict = {}
    kept_heads = inter = None
    if cfg.method == "static-width":
        keep = keep_masks_of_model(model)
        backbone, kept_heads, inter = compact_static(
            backbone,
            keep,
            num_layers=state.shape.num_layers,
            head_dim=state.shape.head_dim,
            attn_group_size=layout.attn_group_size,
            ffn_group_size=layout.ffn_group_size,
        )
        tensors = backbone
        info["static"] = {
            "kept_heads": kept_heads,
            "intermediate_sizes": inter,
            "kept_groups": {
                m: [keep[(i, m)].nonzero().flatten().tolist() for i in range(state.shape.num_layers)]
                for m in ROUTED_MODULES
            },
        }
    else:
        tensors = {**backbone, **router_state_dict(model)}
    tensors = _unshare(tensors)
    dest = Path(dest)
    config = hf_config_dict(
        base, cfg.to_dict(), dataclasses.asdict(layout), kept_heads=kept_heads, intermediate_sizes=inter
    )
    atomic_write_json(dest / CONFIG_JSON, config)
    (dest / MODELING_FILE).write_text(render_modeling(base.model_type))
    (dest / CONFIGURATION_FILE).write_text(render_configuration(base.model_type))
    save_weights(tensors, dest, max_shard_size=max_shard_size, metadata={"wide_export_id": export_id})
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        gen.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    return info


# ----------------------------------------------------------------------------- loader
def hf_base_model_type(path) -> str:
    """The base ``model_type`` (llama, mistral, qwen2, qwen3, gemma3_text) of an hf-format export, read from
    its ``config.json`` as data.

    Raises:
        CheckpointError: unreadable config, or a ``model_type`` that is not ``wide_<supported>``.
    """
    from wide_cli.errors import CheckpointError

    p = Path(path) / CONFIG_JSON
    try:
        mt = str(json.loads(p.read_text()).get("model_type", ""))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {p}: {e}", "re-run `wide export`") from None
    base = mt.removeprefix("wide_")
    if not mt.startswith("wide_") or base not in ARCH_PREFIX:
        raise CheckpointError(f"{p}: model_type {mt!r} is not a wide hf export of a supported model",
                              f"expected one of {', '.join('wide_' + k for k in ARCH_PREFIX)}; re-run `wide export`")
    return base


def hf_export_config(path):
    """The config of an hf-format export as wide's own config class (no shipped code runs)."""
    from wide_cli.export.modeling_template import own_classes

    config_cls, _ = own_classes(hf_base_model_type(path))
    return config_cls.from_pretrained(path, local_files_only=True)


def refuse_shipped_code(path) -> None:
    """Raise unless the export's generated code files are exactly what this wide generates.

    wide never executes code from an export it reads: it loads into its own classes, and
    refuses an export whose code it would not have written, since that export expects code
    wide does not run (and may carry code that runs on load in other tools).

    Raises:
        CheckpointError: naming the file and ``--trust-remote-code``.
    """
    from wide_cli.errors import CheckpointError
    from wide_cli.export.modeling_template import differing_shipped_file

    bad = differing_shipped_file(path, hf_base_model_type(path))
    if bad is not None:
        from wide_cli.version import __version__

        raise CheckpointError(
            f"{Path(path) / bad} is not the code wide {__version__} generates (edited, or from another wide "
            "version); wide does not execute code shipped in an export",
            "re-export it with this wide, or pass --trust-remote-code if you trust whoever made the export",
        )


def load_hf_export(path, *, dtype: torch.dtype = torch.float32, device="cpu", verify: bool = True,
                   trust_remote_code: bool = False):
    """Load an hf-format export after checking its manifest, into wide's own classes (the
    generated code of this wide version; the export's ``.py`` files are compared, never run).
    With ``trust_remote_code`` transformers runs the export's shipped files instead, as a user
    without wide would.

    Returns a ``PrunedModel`` (model in eval mode; routing in its default mode, ``argmax``).

    Raises:
        CheckpointError: missing/corrupt files (named), a manifest of another export, shipped
            code that differs from this wide's (without ``trust_remote_code``), missing or
            mismatched tensors, or a tokenizer that cannot be loaded.
        UnsupportedFeature: a feature the hf modeling code does not run (``wide_cli.features``).
    """
    import warnings

    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    from wide_cli.errors import CheckpointError
    from wide_cli.export.modeling_template import own_classes

    path, wcfg, tokenizer = open_export(path, verify=verify)
    if not trust_remote_code:
        refuse_shipped_code(path)
    from wide_cli.features import check_export

    check_export(path, "hf")
    from wide_cli.models.consistency import check_export_shapes

    check_export_shapes(path, hf_export_config(path))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            kw = {"dtype": dtype, "local_files_only": True, "output_loading_info": True}
            if trust_remote_code:
                model, info = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, **kw)
            else:
                model, info = own_classes(hf_base_model_type(path))[1].from_pretrained(path, **kw)
    except (OSError, ValueError, RuntimeError, SafetensorError) as e:
        bad = unreadable_weights(path)
        raise CheckpointError(
            f"cannot load the weights of {path}: {bad + ': ' if bad else ''}{e}", "re-run `wide export`"
        ) from None
    bad = {k: sorted(map(str, info.get(k) or [])) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if any(bad.values()):
        raise CheckpointError(
            f"weights of {path} do not match its {CONFIG_JSON}: missing {bad['missing_keys'][:5]}, "
            f"unexpected {bad['unexpected_keys'][:5]}, mismatched {bad['mismatched_keys'][:5]}",
            "the export is corrupt or was edited; re-run `wide export`",
        )
    return PrunedModel(model.to(device).eval(), tokenizer, wcfg, path)
