"""Depth surgery on a loaded transformers model: remove decoder layers in place, and run a
model whose layers were removed with its source layers back (the dense teacher of hybrid
depth + width distillation). Used by static-depth pruning (``wide_cli.pipeline.static_depth``)
and by the training loop; it knows nothing of run dirs or pipelines."""

from __future__ import annotations

import torch

from wide_cli.errors import ConfigError


def remove_layers(model, removed: list[int]):
    """Delete decoder layers ``removed`` from ``model`` in place and make its config consistent
    (``num_hidden_layers``, per-layer ``layer_types``, each attention's ``layer_idx`` for the
    KV cache). Returns the model."""
    from wide_cli.routing.model import decoder_layers

    layers = decoder_layers(model)
    L = len(layers)
    drop = set(removed)
    keep = [i for i in range(L) if i not in drop]
    if not keep:
        raise ConfigError("static-depth cannot remove every layer")
    new = torch.nn.ModuleList([layers[i] for i in keep])
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.model.layers = new
    cfg = base.config
    cfg.num_hidden_layers = len(keep)
    for attr in ("layer_types",):
        v = getattr(cfg, attr, None)
        if isinstance(v, (list, tuple)) and len(v) == L:
            setattr(cfg, attr, [v[i] for i in keep])
    for j, layer in enumerate(new):
        attn = getattr(layer, "self_attn", None)
        if attn is not None and hasattr(attn, "layer_idx"):
            attn.layer_idx = j
        if hasattr(layer, "layer_idx"):
            layer.layer_idx = j
    return model


def drop_for_hybrid(model, removed: list[int]):
    """Remove ``removed`` layers from ``model`` in place (``remove_layers``) and keep the full
    layer list aside (not registered: it is neither trained nor saved) so that ``source_depth``
    can run the source model as the distillation teacher. Returns the model."""
    from wide_cli.routing.model import decoder_layers

    full = list(decoder_layers(model))
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    cfg = base.config
    saved = {"num_hidden_layers": cfg.num_hidden_layers, "layer_types": getattr(cfg, "layer_types", None)}
    remove_layers(model, removed)
    base.__dict__["wide_source_layers"] = (full, saved)
    return model


def is_layer_pruned(model) -> bool:
    """True when ``drop_for_hybrid`` already removed layers from ``model``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "wide_source_layers" in base.__dict__


class source_depth:
    """Context manager: run a model that ``drop_for_hybrid`` pruned with all its source layers
    (for the dense teacher of distillation); a no-op on any other model. The removed layers are
    cast to the dtype of the kept ones (training casts the frozen backbone to bf16) and, since
    ``use_cache`` is off in training, their stale ``layer_idx`` does not matter."""

    def __init__(self, model):
        base = model
        while hasattr(base, "module") and not hasattr(base, "config"):  # DDP
            base = base.module
        self.base = base.get_base_model() if hasattr(base, "get_base_model") else base
        self.source = self.base.__dict__.get("wide_source_layers")

    def __enter__(self):
        if self.source is None:
            return self
        full, saved = self.source
        inner = self.base.model
        self.kept = inner.layers
        ref = next(self.kept.parameters())
        for layer in full:
            p = next(layer.parameters())
            if p.dtype != ref.dtype or p.device != ref.device:
                layer.to(device=ref.device, dtype=ref.dtype)
        cfg = self.base.config
        self.restore = {"num_hidden_layers": cfg.num_hidden_layers, "layer_types": getattr(cfg, "layer_types", None)}
        inner.layers = torch.nn.ModuleList(full)
        cfg.num_hidden_layers = saved["num_hidden_layers"]
        if saved["layer_types"] is not None:
            cfg.layer_types = saved["layer_types"]
        return self

    def __exit__(self, *exc):
        if self.source is None:
            return False
        self.base.model.layers = self.kept
        cfg = self.base.config
        cfg.num_hidden_layers = self.restore["num_hidden_layers"]
        if self.restore["layer_types"] is not None:
            cfg.layer_types = self.restore["layer_types"]
        return False
