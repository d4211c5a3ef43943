"""Reading a checkpoint into the runtime's ``ModelWeights``: an export directory, an in-memory
Hugging Face model, or plain tensors (Hugging Face tensor names).

Strict: a missing or extra tensor is an error, never a silently random or dropped weight; per-layer
sizes come from the weight shapes, so layers may differ. The export's files are read through
``wide_cli.artifacts`` like every other loader's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from wide_cli.artifacts import ExportInfo, parse_router_name
from wide_cli.errors import CheckpointError, ConfigError
from wide_cli.filenames import CONFIG_JSON, ROUTERS_FILE, WIDE_CONFIG
from wide_cli.runtime.backend import LayerWeights, ModelWeights, RouterWeights


@dataclass(frozen=True)
class RoutingInfo:
    """The routing facts the runtime needs (from ``wide_config.json`` or a model's RoutingState).

    Attributes:
        method: ``wide``, ``dynamic-depth``, ``static-width`` or ``dense``.
        route_attention, route_ffn: which modules are routed.
        attn_group_size: query heads per group; ffn_group_size: channels per group (resolved,
            i.e. the full width for dynamic-depth). None = not routed / unknown.
    """

    method: str = "dense"
    route_attention: bool = False
    route_ffn: bool = False
    attn_group_size: int | None = None
    ffn_group_size: int | None = None

    @classmethod
    def from_wide_config(cls, wc: dict | ExportInfo | None) -> RoutingInfo:
        """From an export's ``wide_config.json`` (a dict or its ``ExportInfo``); what runs is
        ``ExportInfo.routing_method`` (a static-depth export routes nothing: ``dense``)."""
        if not wc:
            return cls()
        info = wc if isinstance(wc, ExportInfo) else ExportInfo(wc)
        routing, layout = info.routing, info.layout
        attn, ffn = "attention" in info.routed_modules, "ffn" in info.routed_modules
        # a module that routes nothing (a static-depth or dense export, whose recorded settings
        # still carry the recipe's group sizes) runs as one group: as many groups as heads or
        # channels would make every kernel loop over slivers of the weights
        return cls(
            method=info.routing_method,
            route_attention=attn,
            route_ffn=ffn,
            attn_group_size=(layout.get("attn_group_size") or routing.get("attn_group_size")) if attn else None,
            ffn_group_size=(layout.get("ffn_group_size") or routing.get("ffn_group_size")) if ffn else None,
        )


def _ckpt_error(msg: str, hint: str | None = "the export is corrupt or was edited; re-run `wide export`"):
    return CheckpointError(msg, hint)


class _Pool:
    """HF-named tensors; records which were consumed so leftovers can be reported."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors
        self.used: set[str] = set()
        self.missing: list[str] = []

    def get(self, name: str, required: bool = True) -> torch.Tensor | None:
        t = self.tensors.get(name)
        if t is None:
            if required:
                self.missing.append(name)
            return None
        self.used.add(name)
        return t


def rope_tables(config, head_dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """``(inv_freq [d/2] fp32, attention_scaling)`` exactly as transformers computes them, incl.
    ``rope_scaling`` types such as ``llama3``, via ``ROPE_INIT_FUNCTIONS``.

    Args:
        layer_type: for a config with one RoPE per layer type (Gemma 3's ``rope_parameters =
            {"sliding_attention": {...}, "full_attention": {...}}``), the type whose RoPE to build.

    Raises:
        ConfigError: RoPE types whose frequencies change with the sequence length (``dynamic``,
            ``longrope``), which this runtime does not implement.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(getattr(config, "rope_parameters", None) or {})
    kw = {}
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params, kw = dict(params[layer_type]), {"layer_type": layer_type}
    scaling = {} if kw else dict(getattr(config, "rope_scaling", None) or {})
    rtype = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rtype == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv, 1.0
    if rtype in ("dynamic", "longrope"):
        raise ConfigError(
            f"rope type {rtype!r} changes with the sequence length and is not supported by the runtime",
            "use the Hugging Face model (`wide eval`) for this checkpoint",
        )
    if rtype not in ROPE_INIT_FUNCTIONS:
        raise ConfigError(f"unknown rope type {rtype!r}", f"known: {', '.join(ROPE_INIT_FUNCTIONS)}")
    inv, scale = ROPE_INIT_FUNCTIONS[rtype](config, torch.device("cpu"), **kw)
    return inv.float(), float(scale)


def _window(config, i: int) -> int | None:
    sw = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is not None:
        return sw if types[i] == "sliding_attention" else None
    return sw if getattr(config, "model_type", None) == "mistral" else None


def _eos_ids(config, extra=None) -> tuple[int, ...]:
    out: list[int] = []
    for v in (getattr(config, "eos_token_id", None), extra):
        for x in v if isinstance(v, (list, tuple)) else [v]:
            if x is not None and int(x) not in out:
                out.append(int(x))
    return tuple(out)


def weights_from_tensors(
    config,
    tensors: dict[str, torch.Tensor],
    routers: dict[str, torch.Tensor],
    wide_config: dict | RoutingInfo | None,
    *,
    allow_extra: bool = False,
    extra_eos=None,
) -> ModelWeights:
    """Arrange Hugging Face-named tensors into ``ModelWeights``.

    Per-layer sizes come from the weight shapes (layers may differ); ``config`` gives only the layer count,
    ``head_dim``, norm epsilon, RoPE, sliding windows and the tie flag (and, for Gemma 3, the
    activation, the query scale and the layer types: ``_gemma3``).

    Raises:
        CheckpointError: missing tensors (all listed), unexpected tensors (unless
            ``allow_extra``), shapes that do not fit together, an untied model without
            ``lm_head.weight`` (it would otherwise be random), routers that do not match the layer widths.
    """
    from wide_cli.models.arch import check_supported, context_length

    check_supported(config)
    gemma = getattr(config, "model_type", None) == "gemma3_text"
    info = wide_config if isinstance(wide_config, RoutingInfo) else RoutingInfo.from_wide_config(wide_config)
    if gemma:
        if getattr(config, "hidden_activation", None) != "gelu_pytorch_tanh":
            raise ConfigError(f"Gemma 3 hidden_activation {getattr(config, 'hidden_activation', None)!r} is not "
                              "supported by the runtime", "gelu_pytorch_tanh (the released checkpoints') only")
    elif getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
        raise ConfigError(f"hidden_act {config.hidden_act!r} is not supported by the runtime", "SwiGLU (silu) only")
    pool = _Pool(tensors)
    D = int(config.hidden_size)
    head_dim = int(getattr(config, "head_dim", None) or D // int(config.num_attention_heads))
    embed = pool.get("model.embed_tokens.weight")
    final_norm = pool.get("model.norm.weight")
    tie = bool(getattr(config, "tie_word_embeddings", False))
    lm_head = pool.get("lm_head.weight", required=False)
    if lm_head is None:
        if not tie:
            raise _ckpt_error(
                f"tensor lm_head.weight is missing and {CONFIG_JSON} has tie_word_embeddings=false",
                "the checkpoint lost its output layer; re-export it, or set tie_word_embeddings if it is tied",
            )
        lm_head = embed
    tied = lm_head is embed or (
        tie and embed is not None and lm_head.shape == embed.shape and torch.equal(lm_head, embed)
    )
    # router tensors by (layer, module)
    rt: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    bad_router = []
    for name, t in routers.items():
        try:
            i, mod, rest = parse_router_name(name)
        except ValueError:
            bad_router.append(name)
            continue
        if not name.startswith(f"model.layers.{i}.router_{mod}."):  # the runtime reads Llama-style names only
            bad_router.append(name)
            continue
        rt.setdefault((i, mod), {})[rest] = t
    if bad_router:
        raise _ckpt_error(f"unexpected router tensors {bad_router[:5]}")

    layers = []
    n_layers = int(config.num_hidden_layers)
    for i in range(n_layers):
        pre = f"model.layers.{i}."
        def g(n, req=True, pre=pre):
            return pool.get(pre + n, req)

        lw = {
            "wq": g("self_attn.q_proj.weight"), "wk": g("self_attn.k_proj.weight"), "wv": g("self_attn.v_proj.weight"),
            "wo": g("self_attn.o_proj.weight"), "bq": g("self_attn.q_proj.bias", False), "bk": g("self_attn.k_proj.bias", False),
            "bv": g("self_attn.v_proj.bias", False), "bo": g("self_attn.o_proj.bias", False),
            "q_norm": g("self_attn.q_norm.weight", False), "k_norm": g("self_attn.k_norm.weight", False),
            "w_gate": g("mlp.gate_proj.weight"), "w_up": g("mlp.up_proj.weight"), "w_down": g("mlp.down_proj.weight"),
            "ln_attn": g("input_layernorm.weight"), "ln_ffn": g("post_attention_layernorm.weight"),
        }  # fmt: skip
        if gemma:  # sandwich norms: post_attention_layernorm normalises the attention output
            lw["ln_attn_out"], lw["ln_ffn"] = lw["ln_ffn"], g("pre_feedforward_layernorm.weight")
            lw["ln_ffn_out"] = g("post_feedforward_layernorm.weight")
        for b in ("gate", "up", "down"):
            if g(f"mlp.{b}_proj.bias", False) is not None:
                raise ConfigError(f"layer {i}: mlp.{b}_proj.bias (mlp_bias) is not supported by the runtime")
        layers.append(lw)
    leftovers = sorted(set(tensors) - pool.used)
    if pool.missing or (leftovers and not allow_extra):
        raise _ckpt_error(
            f"weights do not match the {getattr(config, 'model_type', '?')} layout: "
            f"missing {pool.missing[:6]}{' ...' if len(pool.missing) > 6 else ''}, "
            f"unexpected {leftovers[:6]}{' ...' if len(leftovers) > 6 else ''}"
        )
    if leftovers:
        import warnings

        warnings.warn(f"ignoring unexpected tensors: {leftovers[:6]}", stacklevel=2)

    out_layers = []
    for i, lw in enumerate(layers):
        out_layers.append(_layer_weights(i, lw, D, head_dim, info, rt.pop((i, "attention"), None),
                                         rt.pop((i, "ffn"), None), _window(config, i)))  # fmt: skip
    if rt:
        raise _ckpt_error(f"router tensors for layers that do not exist: {sorted(rt)[:5]}")
    if embed.shape[1] != D or lm_head.shape[1] != D:
        raise _ckpt_error(f"embedding {tuple(embed.shape)} / lm_head {tuple(lm_head.shape)} do not have hidden size {D}")
    if gemma:
        return _gemma3(config, embed, lm_head, final_norm, out_layers, head_dim, tied, extra_eos)
    inv_freq, scale = rope_tables(config, head_dim)
    return ModelWeights(
        embed=embed, lm_head=lm_head, final_norm=final_norm, layers=out_layers,
        rms_eps=float(getattr(config, "rms_norm_eps", 1e-6)), inv_freq=inv_freq, rope_scale=scale,
        eos_token_ids=_eos_ids(config, extra_eos), tied=bool(tied), max_positions=context_length(config),
    )  # fmt: skip


def _gemma3(config, embed, lm_head, final_norm, layers: list[LayerWeights], head_dim: int, tied: bool,
            extra_eos) -> ModelWeights:
    """The Gemma 3 (text) parts of ``ModelWeights`` (``modeling_gemma3.py``): every RMSNorm weight
    ``w`` of ``x * (1 + w)`` folded once to ``1 + w`` in fp32 (``norm_fp32``), GELU-tanh gating,
    the query scale ``query_pre_attn_scalar ** -0.5``, one RoPE per layer type, embeddings scaled
    by sqrt(D)."""
    from wide_cli.models.arch import context_length

    def fold(w):
        return None if w is None else 1.0 + w.float()

    types = list(config.layer_types)
    ropes = {t: rope_tables(config, head_dim, t) for t in sorted(set(types))}
    scale = float(config.query_pre_attn_scalar) ** -0.5
    for lw in layers:
        for name in ("ln_attn", "ln_ffn", "ln_attn_out", "ln_ffn_out", "q_norm", "k_norm"):
            setattr(lw, name, fold(getattr(lw, name)))
        lw.act, lw.attn_scale, lw.rope = "gelu_tanh", scale, ropes[types[lw.index]]
    inv_freq, rope_scale = ropes.get("full_attention") or next(iter(ropes.values()))  # unused: every layer has its own
    return ModelWeights(
        embed=embed, lm_head=lm_head, final_norm=fold(final_norm), layers=layers,
        rms_eps=float(getattr(config, "rms_norm_eps", 1e-6)), inv_freq=inv_freq, rope_scale=rope_scale,
        eos_token_ids=_eos_ids(config, extra_eos), tied=bool(tied), max_positions=context_length(config),
        embed_scale=float(config.hidden_size) ** 0.5, norm_fp32=True,
    )  # fmt: skip


def _layer_weights(i, w, D, d, info: RoutingInfo, r_att, r_ffn, window) -> LayerWeights:
    def shape_err(msg):
        return _ckpt_error(f"layer {i}: {msg}")

    if w["wq"].shape[0] % d or w["wk"].shape[0] % d:
        raise shape_err(f"q_proj {tuple(w['wq'].shape)} / k_proj {tuple(w['wk'].shape)} rows are not multiples of head_dim {d}")
    H, Hkv = w["wq"].shape[0] // d, w["wk"].shape[0] // d
    F_ = w["w_gate"].shape[0]
    checks = [
        (w["wq"].shape[1] == D, "q_proj input width"),
        (w["wk"].shape == w["wv"].shape and w["wk"].shape[1] == D, "k_proj/v_proj shapes"),
        (tuple(w["wo"].shape) == (D, H * d), f"o_proj {tuple(w['wo'].shape)} vs {(D, H * d)}"),
        (Hkv > 0 and H % Hkv == 0, f"{H} query heads are not a multiple of {Hkv} KV heads"),
        (w["w_gate"].shape == w["w_up"].shape and w["w_gate"].shape[1] == D, "gate_proj/up_proj shapes"),
        (tuple(w["w_down"].shape) == (D, F_), f"down_proj {tuple(w['w_down'].shape)} vs {(D, F_)}"),
        (w["q_norm"] is None or tuple(w["q_norm"].shape) == (d,), "q_norm must have shape [head_dim]"),
        ((w["q_norm"] is None) == (w["k_norm"] is None), "q_norm and k_norm come together"),
    ]
    for ok, what in checks:
        if not ok:
            raise shape_err(what)
    ags = info.attn_group_size or H
    fgs = info.ffn_group_size or F_
    routers, keeps = {}, {}
    for mod, on, t, units, gs in (("attention", info.route_attention, r_att, H, ags), ("ffn", info.route_ffn, r_ffn, F_, fgs)):
        routers[mod] = keeps[mod] = None
        if not on:
            if t:
                raise shape_err(f"router_{mod} tensors present but {mod} is not routed in {WIDE_CONFIG}")
            continue
        if units % gs:
            raise shape_err(f"{mod} group size {gs} does not divide its {units} {'heads' if mod == 'attention' else 'channels'}")
        G = units // gs
        if not t:
            raise _ckpt_error(f"layer {i}: router_{mod} tensors are missing", f"re-run `wide export` ({ROUTERS_FILE})")
        if "keep" in t:
            keep = t["keep"].bool()
            if keep.numel() != G:
                raise shape_err(f"router_{mod}.keep has {keep.numel()} groups, the layer has {G}")
            keeps[mod] = None if bool(keep.all()) else keep
            continue
        need = {"compressor.weight", "compressor.bias", "router.weight", "router.bias"}
        if set(t) - {"standin", "standin_in", "standin_out"} != need:
            raise shape_err(f"router_{mod} tensors {sorted(t)} != {sorted(need)} (+ optional standin, "
                            f"standin_in and standin_out)")
        rw = RouterWeights(t["compressor.weight"], t["compressor.bias"], t["router.weight"], t["router.bias"],
                           t.get("standin"), t.get("standin_in"), t.get("standin_out"))
        if rw.standin is not None and tuple(rw.standin.shape) != (G, D):
            raise shape_err(f"router_{mod}.standin has shape {tuple(rw.standin.shape)}, expected ({G}, {D})")
        if (rw.standin_in is None) != (rw.standin_out is None) or (rw.standin_in is not None and rw.standin is None):
            raise shape_err(f"router_{mod}: standin_in and standin_out come together, with standin")
        if rw.standin_in is not None:
            si, so = tuple(rw.standin_in.shape), tuple(rw.standin_out.shape)
            if len(si) != 3 or si[0] != G or si[2] != D or so != si:
                raise shape_err(f"router_{mod}.standin_in {si} / standin_out {so}: expected ({G}, R, {D}) both")
        if rw.wc.shape[1] != D or rw.wr.shape[0] != 2 * G or rw.wr.shape[1] != rw.wc.shape[0]:
            raise shape_err(
                f"router_{mod} shapes compressor {tuple(rw.wc.shape)} router {tuple(rw.wr.shape)} "
                f"do not fit D={D} and {G} groups"
            )
        routers[mod] = rw
    return LayerWeights(
        index=i, wq=w["wq"], wk=w["wk"], wv=w["wv"], wo=w["wo"], w_gate=w["w_gate"], w_up=w["w_up"],
        w_down=w["w_down"], ln_attn=w["ln_attn"], ln_ffn=w["ln_ffn"], head_dim=d, attn_group_size=ags,
        ffn_group_size=fgs, bq=w["bq"], bk=w["bk"], bv=w["bv"], bo=w["bo"], q_norm=w["q_norm"],
        k_norm=w["k_norm"], router_attention=routers["attention"], router_ffn=routers["ffn"],
        keep_attention=keeps["attention"], keep_ffn=keeps["ffn"], window=window,
        ln_attn_out=w.get("ln_attn_out"), ln_ffn_out=w.get("ln_ffn_out"),
    )  # fmt: skip


def weights_from_model(model, importance: dict | None = None) -> tuple[ModelWeights, bool]:
    """Read an in-memory Hugging Face model (routed by ``attach_routers``, or plain).

    ``importance`` (HF weight name -> ``[K]``, ``calibrate/importance.py``): the tensors it names
    are read as their importance-weighted int4 values (``quant.int4_values_state_dict``), which the
    runtime's int4 format keeps as they are.

    Returns:
        ``(weights, routed)``: routed is False for a plain model, ``dense`` method, or routing
        mode ``dense``.
    """
    from wide_cli.artifacts import split_router_tensors

    state = getattr(model, "wide_routing", None)
    tensors, routers = split_router_tensors(model.state_dict())
    if importance is not None:
        from wide_cli.quant import int4_values_state_dict

        tensors = int4_values_state_dict(tensors, importance)
    if state is None:
        info, routed = RoutingInfo(), False
    else:
        cfg = state.cfg
        info = RoutingInfo(
            method=cfg.method,
            route_attention=cfg.route_attention and cfg.method != "dense",
            route_ffn=cfg.route_ffn and cfg.method != "dense",
            attn_group_size=state.layout.attn_group_size,
            ffn_group_size=state.layout.ffn_group_size,
        )
        routed = cfg.method != "dense" and state.mode != "dense"
    return weights_from_tensors(model.config, tensors, routers, info), routed


def weights_from_export(path, *, verify: bool = True, allow_extra: bool = False) -> ModelWeights:
    """Read an export directory (``manifest.json`` verified first) into ``ModelWeights``.

    An int8 or int4 export (``wide export --weights int8|int4``) is dequantized here (exactly
    ``q * scale``) and marked ``extra["weight_format"]``; the cpu backend re-quantizes it to the
    same values (``wide_cli/quant.py``).

    Raises:
        CheckpointError: see ``verify_manifest``, ``read_backbone``, ``weights_from_tensors``;
            also a missing ``routers.safetensors`` for a routed export (it would otherwise run unrouted), an int8 tensor
            without (or with a mismatched) scale tensor.
    """
    import json
    from pathlib import Path

    from transformers import AutoConfig

    from wide_cli.artifacts import (
        check_manifest_owner,
        read_backbone,
        read_routers,
        split_router_tensors,
        verify_manifest,
    )
    from wide_cli.export.hf_format import hf_export_config
    from wide_cli.models.consistency import check_config_matches

    path = Path(path)
    if verify:
        check_manifest_owner(path)
        verify_manifest(path)
    export = ExportInfo.read(path)
    hf = export.export_format == "hf"  # read as data into wide's own config class; its .py files never run
    try:
        config = hf_export_config(path) if hf else AutoConfig.from_pretrained(
            path, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise _ckpt_error(f"cannot read {export.config_path}: {e}") from None
    if getattr(config, "wide_layer_heads", None) is not None:
        raise ConfigError(f"{path} is a physically narrowed static-width hf export, which the runtime does not run",
                          "run the `--format wide` export of the same run (`wide export --run-dir R`)")
    info = RoutingInfo.from_wide_config(export)
    from wide_cli.quant import dequantize_state_dict

    tensors, quantized = dequantize_state_dict(read_backbone(path), str(export.weights_path))
    check_config_matches(config, {k: tuple(v.shape) for k, v in tensors.items()}, config_file=export.config_path,
                         weights_file=export.weights_path.name, error=CheckpointError)
    routers = {}
    if hf:  # the routers sit with the backbone in one set of weight files
        tensors, routers = split_router_tensors(tensors)
    elif info.method != "dense" and (info.route_attention or info.route_ffn):
        routers = read_routers(export.routers_path)
    extra_eos = None
    gen = export.generation_config_path
    if gen.is_file():
        try:
            extra_eos = json.loads(gen.read_text()).get("eos_token_id")
        except ValueError:
            extra_eos = None
    weights = weights_from_tensors(config, tensors, routers, info, allow_extra=allow_extra, extra_eos=extra_eos)
    if quantized:
        weights.extra["weight_format"] = quantized
    return weights
