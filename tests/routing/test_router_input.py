"""Routers that read the standardised residual stream (``router_input = "standardized"``): the
definition, the fold into the compressor that exports store, loading it back, and the moments
taken on the dense model."""

from __future__ import annotations

import warnings

import pytest
import torch

from wide_cli.calibrate.statistics import router_input_moments
from wide_cli.errors import ConfigError
from wide_cli.models.tiny import tiny_model
from wide_cli.routing import RoutingConfig, attach_routers
from wide_cli.routing.model import decoder_layers, load_router_state_dict, router_state_dict
from wide_cli.routing.router import Router


def _standardized_router(seed: int = 0) -> tuple[Router, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = Router(16, 4, 3)
    with torch.no_grad():
        for p in r.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    mean, std = 100.0 * torch.randn(16, generator=g), 1.0 + 50.0 * torch.rand(16, generator=g)
    r.standardize_input(mean, std)
    return r, mean, std


def test_standardized_router_reads_the_standardised_input():
    r, mean, std = _standardized_router()
    x = 1000.0 * torch.randn(2, 5, 16, dtype=torch.float64).float()
    want = r.router(r.compressor((x - mean) / std)).view(2, 5, 3, 2)
    torch.testing.assert_close(r(x), want, rtol=1e-5, atol=1e-4)


def test_folded_compressor_gives_the_same_logits_on_the_raw_input():
    r, _, _ = _standardized_router()
    x = 1000.0 * torch.randn(7, 16)
    w, b = r.folded_compressor()
    want = r(x)
    got = r.router(x @ w.T + b).view(7, 3, 2)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
    plain = Router(16, 4, 3)  # an unstandardised router folds to its own weights
    assert plain.folded_compressor()[0] is not None
    torch.testing.assert_close(plain.folded_compressor()[0], plain.compressor.weight)


def _routed_tiny(cfg: RoutingConfig):
    torch.manual_seed(0)
    model = tiny_model("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        attach_routers(model, cfg)
    return model


def test_saved_routers_load_into_a_plain_and_into_a_standardized_model():
    cfg = RoutingConfig(router_rank=4, router_input="standardized")
    trained = _routed_tiny(cfg)
    g = torch.Generator().manual_seed(1)
    D = trained.config.hidden_size
    routers = [r for layer in decoder_layers(trained) for r in (layer.router_attention, layer.router_ffn)]
    for r in routers:
        r.standardize_input(torch.randn(D, generator=g), 0.5 + torch.rand(D, generator=g))
    saved = router_state_dict(trained)
    x = 3.0 * torch.randn(2, 4, D)
    # an export is loaded into routers that were never standardised: the folded map alone
    plain = _routed_tiny(cfg)
    load_router_state_dict(plain, saved)
    again = _routed_tiny(cfg)  # a resumed or re-attached run standardises with the same moments
    for r, src in zip((r for layer in decoder_layers(again) for r in (layer.router_attention, layer.router_ffn)),
                      routers, strict=True):
        r.standardize_input(src.input_mean, 1.0 / src.input_inv_std)
    load_router_state_dict(again, saved)
    for i, layer in enumerate(decoder_layers(trained)):
        for module in ("attention", "ffn"):
            want = getattr(layer, f"router_{module}")(x)
            torch.testing.assert_close(getattr(decoder_layers(plain)[i], f"router_{module}")(x), want,
                                       rtol=1e-4, atol=1e-4)
            r_again = getattr(decoder_layers(again)[i], f"router_{module}")
            torch.testing.assert_close(r_again(x), want, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(r_again.compressor.weight, getattr(layer, f"router_{module}").compressor.weight,
                                       rtol=1e-5, atol=1e-5)
    assert set(saved) == set(router_state_dict(plain))  # the moments are not tensors of the export


def test_router_input_moments_are_the_dense_residual_stream_moments():
    model = _routed_tiny(RoutingConfig(router_rank=4))
    ids = torch.randint(0, model.config.vocab_size, (6, 12), generator=torch.Generator().manual_seed(2))
    moments = router_input_moments(model, ids, batch_size=4)
    assert model.wide_routing.mode == "argmax"  # the pass switched routing off and back
    model.wide_routing.set_mode("dense")
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states  # hs[i]: input of layer i
    L = len(decoder_layers(model))
    assert set(moments) == {(i, m) for i in range(L) for m in ("attention", "ffn")}
    for i in range(L):
        h = hs[i].reshape(-1, hs[i].shape[-1]).double()
        mean, std = moments[(i, "attention")]
        torch.testing.assert_close(mean, h.mean(0).float(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(std, h.std(0, correction=0).float(), rtol=1e-4, atol=1e-5)
        assert tuple(moments[(i, "ffn")][0].shape) == (model.config.hidden_size,)


def test_unknown_router_input_is_refused():
    with pytest.raises(ConfigError, match="unknown router-input 'normed'"):
        RoutingConfig(router_input="normed")
