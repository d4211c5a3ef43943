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
