"""Shared builders for the runtime tests: tiny seeded routed models (STYLE.md: build in the test)."""

from __future__ import annotations

import warnings

import pytest
import torch

from wide_cli.models.tiny import tiny_model
from wide_cli.routing import RoutingConfig, attach_routers


def _routed_model(kind: str = "llama", *, seed: int = 0, routers: str = "natural", ags: int = 2, fgs: int = 32, **overrides):
    """A tiny routed model.

    routers: ``natural`` (random kaiming routers, about half the groups skip), ``execute`` (bias
    forces every group on), ``skip`` (bias forces every group off).
    """
    model = tiny_model(kind, seed=seed, **overrides)
    torch.manual_seed(seed + 1000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = attach_routers(model, RoutingConfig(attn_group_size=ags, ffn_group_size=fgs))
    if routers != "natural":
        col = 0 if routers == "execute" else 1
        with torch.no_grad():
            for layer in model.model.layers:
                for r in (layer.router_attention, layer.router_ffn):
                    r.router.bias[col::2] = 1e4
    state.set_mode("argmax")
    return model


def _random_masks(model, batch: int, slots: int, p_skip: float, seed: int = 0) -> dict:
    """Forced decisions ``{(layer, module): [B, S, G] bool}`` skipping with probability p_skip."""
    g = torch.Generator().manual_seed(seed)
    st = model.wide_routing
    out = {}
    for i in range(st.shape.num_layers):
        for m in ("attention", "ffn"):
            out[(i, m)] = torch.rand(batch, slots, st.groups(m), generator=g) >= p_skip
    return out


def _hf_logits(model, ids, mask=None, forced=None) -> torch.Tensor:
    """Routed HF forward (the oracle); forced ``[B, S, G]`` masks are cut to the input length."""
    st = model.wide_routing
    st.forced = {} if forced is None else {k: v[:, : ids.shape[1]] for k, v in forced.items()}
    try:
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask).logits.float()
    finally:
        st.forced = {}


def _write_export(model, path, method="wide"):
    """Export a routed tiny model with ``export_model`` (char tokenizer); returns the tokenizer."""
    from wide_cli.export import export_model
    from wide_cli.models.tiny import char_tokenizer

    st = model.wide_routing
    wc = {
        "method": method,
        "routing": st.cfg.to_dict(),
        "layout": {"attn_group_size": st.layout.attn_group_size, "ffn_group_size": st.layout.ffn_group_size,
                   "attn_groups": st.layout.attn_groups, "ffn_groups": st.layout.ffn_groups},
        "measured_sparsity": {},
        "source_model": {"spec": "tiny-llama"},
    }  # fmt: skip
    tok = char_tokenizer(with_pad=False)
    export_model(model, tok, path, wide_config=wc)
    return tok


# The helpers as fixtures (test modules take them as arguments instead of importing this file,
# so the tests run however pytest is started).
@pytest.fixture
def routed_model():
    return _routed_model


@pytest.fixture
def random_masks():
    return _random_masks


@pytest.fixture
def hf_logits():
    return _hf_logits


@pytest.fixture
def write_export():
    return _write_export


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory):
    """An export of a tiny routed Llama (natural routers), shared by a module's tests."""
    path = tmp_path_factory.mktemp("rt") / "exp"
    _write_export(_routed_model("llama"), path)
    return path


@pytest.fixture
def prompts_ids():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(5, 100, (n,), generator=g).tolist() for n in (5, 9)]
