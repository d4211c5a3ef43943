"""The tiny export the loader tests share: a routed tiny Llama (4 query heads, 2 KV heads of
head_dim 16) written with ``export_model`` in either format."""

from __future__ import annotations

import torch

from wide_cli.export import export_model
from wide_cli.models.tiny import char_tokenizer, tiny_model
from wide_cli.routing import RoutingConfig, attach_routers


def routed_tiny_llama(*, seed: int = 0, skipping_routers: bool = True):
    """A tiny Llama with routers (attention groups of 2 heads, FFN groups of 32 channels);
    returns ``(model, routing config)``. ``skipping_routers`` draws router biases from N(0, 1)
    so that some groups actually skip (fresh routers execute everything)."""
    model = tiny_model("llama", seed=seed)
    cfg = RoutingConfig(attn_group_size=2, ffn_group_size=32)
    attach_routers(model, cfg)
    if skipping_routers:
        with torch.no_grad():
            for n, p in model.named_parameters():
                if ".router_" in n and n.endswith("bias"):
                    p.normal_(0, 1.0)
    return model, cfg


def tiny_export(out, fmt: str = "wide", *, skipping_routers: bool = False):
    """Write the export to ``out``; returns the routed model (see ``routed_tiny_llama``)."""
    model, cfg = routed_tiny_llama(skipping_routers=skipping_routers)
    wc = {"method": "wide", "routing": cfg.to_dict(), "measured_sparsity": {}, "source_model": {"spec": "tiny-llama"}}
    export_model(model, char_tokenizer(), out, wide_config=wc, export_format=fmt)
    return model


def feature_model(kind: str = "llama", *, seed: int = 0, method: str = "wide", standin: str = "none",
                  drop_layers: int = 0, layers: int = 2, ags: int = 2, fgs: int = 32, **overrides):
    """A tiny routed model that uses the export features asked for (``wide_cli.features``):
    ``standin`` (``mean`` / ``trained`` / ``lowrank:R``: seeded non-zero stand-ins and maps), ``drop_layers`` (a hybrid:
    ``layers + drop_layers`` layers built, the first ``drop_layers`` after layer 0 removed, then
    routed), ``method`` (``wide``, ``dynamic-depth``, ``static-width`` with seeded keep masks, or
    ``dense``), config ``overrides`` (``attention_bias``, ``sliding_window``, ``rope_parameters``...).
    Learned routers get biases from N(0, 1) so that some groups skip.

    Returns:
        ``(model, wide_config)``: the model in ``argmax`` mode, and the ``wide_config`` to export
        it with (``export_model``).
    """
    import warnings

    from wide_cli.models.depth import remove_layers

    model = tiny_model(kind, seed=seed, num_hidden_layers=layers + drop_layers, **overrides)
    removed = list(range(1, 1 + drop_layers))
    if removed:
        remove_layers(model, removed)
    cfg = RoutingConfig(method=method, attn_group_size=ags, ffn_group_size=fgs, standin=standin,
                        drop_layers=drop_layers)
    g = torch.Generator().manual_seed(seed + 1000)
    keep = None
    if method == "static-width":
        H, F = model.config.num_attention_heads, model.config.intermediate_size
        keep = {}
        for i in range(layers):
            for module, n in (("attention", H // ags), ("ffn", F // fgs)):
                k = torch.rand(n, generator=g) < 0.5
                k[0] = True
                keep[(i, module)] = k
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = attach_routers(model, cfg, static_keep=keep)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".router_" in n and n.endswith("router.bias"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif n.endswith(".standin"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
            elif n.endswith((".standin_in", ".standin_out")):  # low-rank maps of lowrank:R
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    state.set_mode("argmax")
    lay = state.layout
    wc = {
        "method": method,
        "routing": cfg.to_dict(),
        "layout": {"attn_group_size": lay.attn_group_size, "ffn_group_size": lay.ffn_group_size,
                   "attn_groups": lay.attn_groups, "ffn_groups": lay.ffn_groups},
        "dropped_layers": {"removed": removed, "num_layers": layers + drop_layers} if removed else None,
        "measured_sparsity": {},
        "source_model": {"spec": f"tiny-{kind}"},
    }  # fmt: skip
    return model, wc
