"""Tiny exports for the serving tests, shaped for vLLM's CPU attention (head_dim 32) and routed
like the demo (one attention group per KV head: 3 query heads; FFN groups of 128 channels)."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

# head_dim 32 (the CPU attention kernel's smallest), H = 6 over H_kv = 2, F = 512 = 4 x 128.
SHAPE = {"hidden_size": 192, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 512}
CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"


def build_export(path, kind: str = "llama", *, export_format: str = "wide", method: str = "wide", seed: int = 0,
                 standin: str = "none", drop_layers: int = 0, weight_format: str = "fp32", **overrides):
    """Export a tiny seeded routed ``kind`` model (random routers: about half the groups skip;
    static width: a seeded keep mask per layer and module, the first group always kept) with a
    character tokenizer that has a chat template. ``standin``: seeded non-zero stand-ins;
    ``drop_layers``: a hybrid (that many of ``2 + drop_layers`` layers removed, then routed);
    ``method="static-depth"``: a plain model, layer 1 of 3 removed, no routers;
    ``overrides``: config fields. Returns ``path``."""
    from wide_cli.export import export_model
    from wide_cli.models.depth import remove_layers
    from wide_cli.models.tiny import char_tokenizer, tiny_model
    from wide_cli.routing import RoutingConfig, attach_routers

    shape = {"max_position_embeddings": 256, **SHAPE, **overrides}
    tok = char_tokenizer(with_pad=False)
    tok.chat_template = CHAT_TEMPLATE
    if method == "static-depth":  # what pipeline/static_depth.export writes: layer 1 of 3 removed
        from wide_cli.pipeline.static_depth import PLAIN_ROUTING

        model = tiny_model(kind, seed=seed, num_hidden_layers=3, **shape)
        remove_layers(model, [1])
        sel = {"removed": [1], "kept": [0, 2], "num_layers": 3, "cost_target": 0.75, "cost_metric": "flops",
               "cost_fraction": 0.67, "calibration_tokens": 64}
        wc = {"method": method, "routing": PLAIN_ROUTING.to_dict(), "static_depth": sel,
              "source_model": {"spec": f"tiny-{kind}"}}
        export_model(model, tok, path, wide_config=wc, export_format=export_format, weight_format=weight_format)
        return path
    model = tiny_model(kind, seed=seed, num_hidden_layers=2 + drop_layers, **shape)
    removed = list(range(1, 1 + drop_layers))
    if removed:
        remove_layers(model, removed)
    torch.manual_seed(seed + 1000)
    cfg = RoutingConfig(method=method, attn_group_size=3, ffn_group_size=128, router_rank=32, standin=standin,
                        drop_layers=drop_layers)
    keep = None
    if method == "static-width":
        g = torch.Generator().manual_seed(seed)
        keep = {}
        for i in range(model.config.num_hidden_layers):
            for module, n in (("attention", 2), ("ffn", 4)):  # groups: 6 heads / 3, 512 channels / 128
                k = torch.rand(n, generator=g) < 0.5
                k[0] = True
                keep[(i, module)] = k
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = attach_routers(model, cfg, static_keep=keep)
    state.set_mode("argmax")
    if standin != "none":
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith(".standin"):
                    p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    lay = state.layout
    wc = {
        "method": method,
        "routing": cfg.to_dict(),
        "layout": {"attn_group_size": lay.attn_group_size, "ffn_group_size": lay.ffn_group_size,
                   "attn_groups": lay.attn_groups, "ffn_groups": lay.ffn_groups},
        "dropped_layers": {"removed": removed, "num_layers": 2 + drop_layers} if removed else None,
        "measured_sparsity": {},
        "source_model": {"spec": f"tiny-{kind}"},
    }  # fmt: skip
    export_model(model, tok, path, wide_config=wc, export_format=export_format, weight_format=weight_format)
    return path


def pytest_collection_modifyitems(config, items):
    if os.environ.get("WIDE_SERVE_TESTS", "") in ("", "0"):
        skip = pytest.mark.skip(reason="vLLM serving test: run `make test-serving` (builds .venv-serve)")
        for item in items:
            if item.get_closest_marker("serving") is not None:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def export_factory(tmp_path_factory):
    made = {}

    def get(kind: str = "llama", export_format: str = "wide", method: str = "wide", **features):
        key = (kind, export_format, method, json.dumps(features, sort_keys=True))
        if key not in made:
            name = "-".join([kind, export_format, method, *(f"{k}{v}" for k, v in sorted(features.items())
                                                            if not isinstance(v, dict))])
            made[key] = build_export(tmp_path_factory.mktemp("serve") / name, kind, export_format=export_format,
                                     method=method, **features)  # fmt: skip
        return made[key]

    return get
