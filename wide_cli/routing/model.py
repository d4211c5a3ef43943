"""Turn a Hugging Face Llama-family model into a routed model, in place.

The result is still a normal ``PreTrainedModel``: ``forward(labels=...)`` gives the LM loss,
``generate`` works with the KV cache, and ``state_dict`` holds the routers under
``model.layers.{i}.router_{attention,ffn}.{compressor,router}.{weight,bias}``.
"""

from __future__ import annotations

import torch

from wide_cli.artifacts import is_router_tensor
from wide_cli.models.arch import ROUTED_MODULES, model_shape
from wide_cli.routing.config import RoutingConfig, resolve_groups
from wide_cli.routing.layer import routed_layer_class
from wide_cli.routing.router import Router, StaticRouter
from wide_cli.routing.state import RoutingState


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder layers of a CausalLM (``model.model.layers``), also under a PEFT wrapper."""
    base = model
    if hasattr(base, "get_base_model"):
        base = base.get_base_model()
    return base.model.layers


def _capture_valid(state: RoutingState):
    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        emb = kwargs.get("inputs_embeds")
        T = ids.shape[1] if ids is not None else (emb.shape[1] if emb is not None else None)
        am = kwargs.get("attention_mask")
        state.records.clear()
        if am is None or T is None or am.dim() != 2:
            state.valid = None
        else:
            state.valid = am[:, -T:].bool()

    return hook


def attach_routers(model, cfg: RoutingConfig, *, static_keep: dict | None = None) -> RoutingState:
    """Add routers to every decoder layer of ``model`` and make its layers routed.

    Args:
        model: a ``*ForCausalLM`` of a supported architecture (any dtype; routers are fp32).
        cfg: routing settings; ``dense`` attaches no routers (routing is then the identity).
        static_keep: for ``static-width``, ``{(layer, module): [G] bool}`` keep masks.

    Returns:
        The model's ``RoutingState`` (also at ``model.wide_routing``).

    Raises:
        ConfigError: group sizes that do not divide H or F (see ``resolve_groups``).
        ModelSourceError: unsupported architecture.
    """
    if getattr(model, "wide_routing", None) is not None:
        raise RuntimeError("model already has routers attached")
    shape = model_shape(model.config)
    layout = resolve_groups(cfg, shape)
    state = RoutingState(cfg, shape, layout)
    device = next(model.parameters()).device
    for i, layer in enumerate(decoder_layers(model)):
        layer.__class__ = routed_layer_class(type(layer))
        layer._wide_state = state
        if cfg.method == "dense":
            continue
        for module, on, groups in (
            ("attention", cfg.route_attention, layout.attn_groups),
            ("ffn", cfg.route_ffn, layout.ffn_groups),
        ):
            if not on:
                continue
            if cfg.method == "static-width":
                keep = None if static_keep is None else static_keep.get((i, module))
                router = StaticRouter(groups, keep)
            else:
                router = Router(shape.hidden_size, cfg.router_rank, groups, standin=cfg.standin != "none",
                                standin_rank=cfg.standin_rank)
            setattr(layer, f"router_{module}", router.to(device))
    model.wide_routing = state
    model.register_forward_pre_hook(_capture_valid(state), with_kwargs=True)
    return state


def router_parameters(model) -> list[torch.nn.Parameter]:
    """Trainable router parameters (``router_attention`` / ``router_ffn``), in layer order."""
    return [p for n, p in model.named_parameters() if is_router_tensor(n)]


def router_state_dict(model) -> dict[str, torch.Tensor]:
    """Router tensors with export names ``model.layers.{i}.router_{module}.{...}`` (fp32, CPU)."""
    out = {}
    for i, layer in enumerate(decoder_layers(model)):
        for module in ROUTED_MODULES:
            r = getattr(layer, f"router_{module}", None)
            if r is None:
                continue
            tensors = r.state_dict()
            if isinstance(r, Router):  # the compressor as it acts on the raw residual stream
                tensors["compressor.weight"], tensors["compressor.bias"] = r.folded_compressor()
            for k, t in tensors.items():
                out[f"model.layers.{i}.router_{module}.{k}"] = t.detach().to("cpu").contiguous()
    return out


def load_router_state_dict(model, tensors: dict[str, torch.Tensor], *, strict: bool = True) -> None:
    """Load router tensors named as in ``router_state_dict``.

    Raises:
        CheckpointError: missing, unexpected or mis-shaped router tensors (all listed).
    """
    from wide_cli.errors import CheckpointError

    expected = router_state_dict(model)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    bad = sorted(k for k in set(expected) & set(tensors) if tuple(expected[k].shape) != tuple(tensors[k].shape))
    if strict and (missing or unexpected or bad):
        parts = []
        if missing:
            parts.append(f"missing {missing[:4]}{' ...' if len(missing) > 4 else ''}")
        if unexpected:
            parts.append(f"unexpected {unexpected[:4]}{' ...' if len(unexpected) > 4 else ''}")
        if bad:
            parts.append(
                "shape mismatch "
                + ", ".join(f"{k}: {tuple(tensors[k].shape)} vs {tuple(expected[k].shape)}" for k in bad[:3])
            )
        raise CheckpointError("router tensors do not match the model: " + "; ".join(parts),
                              "was the checkpoint made with other group sizes or another model?")
    layers = decoder_layers(model)
    for name, t in tensors.items():
        if name not in expected:
            continue
        _, _, i, mod, *rest = name.split(".")
        router = getattr(layers[int(i)], mod)
        if isinstance(router, Router) and rest[0] == "compressor":
            if rest[1] == "weight":  # stored folded: unfold into a standardised router's parameters
                bias = tensors.get(name.rsplit(".", 1)[0] + ".bias")
                router.load_folded_compressor(t, router.folded_compressor()[1] if bias is None else bias)
            continue
        target = router.get_parameter(".".join(rest)) if rest[-1] != "keep" else router.keep
        with torch.no_grad():
            target.copy_(t.to(target.dtype))
