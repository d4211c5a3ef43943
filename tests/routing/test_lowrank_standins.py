"""Low-rank stand-ins (``--standin lowrank:R``): the definition, the settings that refuse what does
not fit, the cost model's charge, and the calibration fit that initialises them."""

from __future__ import annotations

import warnings

import pytest
import torch

from wide_cli.calibrate.lowrank import _Moments, fit_group_maps, fit_lowrank_standins
from wide_cli.cost import cost_model, flops_report
from wide_cli.errors import ConfigError
from wide_cli.models.arch import model_shape
from wide_cli.models.tiny import tiny_model
from wide_cli.routing import RoutingConfig, attach_routers, resolve_groups
from wide_cli.routing.config import parse_standin
from wide_cli.routing.router import Router, apply_standin


def test_lowrank_standin_equals_its_definition():
    g = torch.Generator().manual_seed(0)
    G, R, D, B, T = 3, 2, 8, 2, 5
    out = torch.randn(B, T, D, generator=g)
    x = torch.randn(B, T, D, generator=g)
    execute = torch.rand(B, T, G, generator=g) > 0.5
    c, v, u = (torch.randn(G, D, generator=g), torch.randn(G, R, D, generator=g), torch.randn(G, R, D, generator=g))
    want = out.clone()
    for b in range(B):
        for t in range(T):
            for j in range(G):
                if not execute[b, t, j]:
                    want[b, t] += c[j] + sum((x[b, t] @ v[j, r]) * u[j, r] for r in range(R))
    got = apply_standin(out, execute, c, x, v, u)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # a float execute (training, STE) weighs the same terms by 1 - execute
    torch.testing.assert_close(apply_standin(out, execute.float(), c, x, v, u), want, atol=1e-5, rtol=1e-5)


def test_constant_standins_have_no_lowrank_parameters():
    assert not hasattr(Router(8, 4, 3, standin=True), "standin_in")
    assert not hasattr(Router(8, 4, 3), "standin")
    r = Router(8, 4, 3, standin_rank=2)
    assert tuple(r.standin.shape) == (3, 8)
    assert tuple(r.standin_in.shape) == tuple(r.standin_out.shape) == (3, 2, 8)


@pytest.mark.parametrize("value,want", [("none", ("none", 0)), ("trained", ("trained", 0)),
                                        ("lowrank:8", ("lowrank", 8))])
def test_standin_settings_parse(value, want):
    assert parse_standin(value) == want
    cfg = RoutingConfig(standin=value)
    assert (cfg.standin_kind, cfg.standin_rank) == want
    assert cfg.standin_trained == (want[0] in ("trained", "lowrank"))


@pytest.mark.parametrize("value,needle", [("lowrank:0", "needs a rank >= 1"), ("lowrank:x", "needs a rank >= 1"),
                                          ("lowrank", "unknown standin 'lowrank'"), ("mean8", "unknown standin")])
def test_bad_standin_settings_are_refused(value, needle):
    with pytest.raises(ConfigError, match=needle):
        RoutingConfig(standin=value)


def test_a_rank_that_does_not_fit_the_group_is_refused():
    shape = model_shape(tiny_model("llama").config)  # head_dim 16, FFN groups of 32 channels below
    resolve_groups(RoutingConfig(attn_group_size=2, ffn_group_size=32, standin="lowrank:31"), shape, warn=False)
    with pytest.raises(ConfigError, match=r"lowrank:32 does not fit the FFN groups of 32 channels \(rank must be "
                                          r"below 32\)"):
        resolve_groups(RoutingConfig(attn_group_size=4, ffn_group_size=32, standin="lowrank:32"), shape)
    with pytest.raises(ConfigError, match="attention groups of 1 heads x 16 dims"):
        resolve_groups(RoutingConfig(attn_group_size=1, ffn_group_size=64, standin="lowrank:16"), shape)


def test_cost_model_charges_the_standin_of_every_skipped_group():
    shape = model_shape(tiny_model("llama").config)
    D = shape.hidden_size
    plain = cost_model(shape, metric="flops", attn_group_size=2, ffn_group_size=32)
    low = cost_model(shape, metric="flops", attn_group_size=2, ffn_group_size=32, standin_rank=4)
    assert low.dense_total == plain.dense_total  # dense runs no stand-in
    assert low.skip_saving("ffn") == plain.ffn_group - 4 * 4 * D
    half = {"attention": 0.5, "ffn": 0.5}
    extra = 0.5 * shape.num_layers * (low.attn_groups + low.ffn_groups) * 4 * 4 * D
    assert low.relative(half) == pytest.approx(plain.relative(half) + extra / plain.dense_total)
    # everything skipped costs the always-dense part plus every stand-in
    assert low.relative({"attention": 1.0, "ffn": 1.0}) == pytest.approx(low.floor_fraction)
    bytes_ = cost_model(shape, metric="decode_bytes", attn_group_size=2, ffn_group_size=32, standin_rank=4)
    assert bytes_.standin == 2 * 4 * D
    rep = flops_report(shape, half, seq_len=16, router_rank=4, attn_groups=low.attn_groups,
                       ffn_groups=low.ffn_groups, standin_rank=4)
    rep0 = flops_report(shape, half, seq_len=16, router_rank=4, attn_groups=low.attn_groups,
                        ffn_groups=low.ffn_groups)
    assert rep["routed_flops_per_token"] - rep0["routed_flops_per_token"] == pytest.approx(extra)
    # a cost target is a skip fraction of what the maps leave: more skipping for the same target
    cfg = RoutingConfig(attn_group_size=2, ffn_group_size=32, cost_target=0.7, standin="lowrank:4")
    assert cfg.skip_target(shape, 16).uniform_skip > RoutingConfig(attn_group_size=2, ffn_group_size=32,
                                                                   cost_target=0.7).skip_target(shape, 16).uniform_skip


def test_fit_recovers_an_output_that_is_a_low_rank_map_of_the_input():
    """When the group's projection input is an exact rank-2 linear function of the module input,
    the rank-2 fit reproduces the group's output on new inputs (up to the ridge)."""
    g = torch.Generator().manual_seed(1)
    D, w, G, N = 12, 6, 2, 4000
    mix = torch.randn(D, D, generator=g) / D**0.5
    x = torch.randn(N, D, generator=g) @ mix + 0.3
    maps = [torch.randn(D, 2, generator=g) @ torch.randn(2, w, generator=g) for _ in range(G)]
    a = torch.cat([x @ m for m in maps], dim=1) + 0.1  # [N, G * w]
    W = torch.randn(D, G * w, generator=g)
    mom = _Moments(D, G * w)
    mom.add(x, a)
    shift, v, u = fit_group_maps(mom, W, w, 2, ridge=1e-8)
    xt = torch.randn(50, D, generator=g) @ mix + 0.3
    for j in range(G):
        cols = slice(j * w, (j + 1) * w)
        y = (xt @ maps[j] + 0.1) @ W[:, cols].T
        mean_out = a[:, cols].mean(0) @ W[:, cols].T
        pred = mean_out - shift[j] + (xt @ v[j].T) @ u[j]
        torch.testing.assert_close(pred, y, atol=1e-3 * float(y.abs().max()), rtol=0)
    with pytest.raises(ConfigError, match="rank 6 does not fit groups of width 6"):
        fit_group_maps(mom, W, w, 6)


def test_fit_minimises_the_output_error_under_the_input_covariance():
    """With a group of higher rank than R, the fit's squared output error over the calibration
    tokens is below that of truncating the least-squares map's SVD without weighting by the input
    covariance (what a fit that ignores how the inputs are spread would keep)."""
    g = torch.Generator().manual_seed(3)
    D, w, N, R = 10, 6, 6000, 2
    x = torch.randn(N, D, generator=g) * torch.logspace(1, -1, D)  # strongly anisotropic inputs
    a = x @ torch.randn(D, w, generator=g) + 0.05 * torch.randn(N, w, generator=g)
    W = torch.randn(D, w, generator=g)
    mom = _Moments(D, w)
    mom.add(x, a)
    _, v, u = fit_group_maps(mom, W, w, R, ridge=1e-8)
    xc = (x - x.mean(0)).double()
    y = (a - a.mean(0)).double() @ W.double().T
    fitted = float(((xc @ (v[0].T @ u[0]).double() - y) ** 2).sum())
    full = torch.linalg.lstsq(xc, (a - a.mean(0)).double()).solution @ W.double().T  # [D, D]
    left, s, right = torch.linalg.svd(full)
    plain = left[:, :R] * s[:R] @ right[:R]
    assert fitted < 0.9 * float(((xc @ plain - y) ** 2).sum())


def test_fitted_standins_predict_the_skipped_output_better_than_the_mean():
    """On a tiny model, for every routed group: the fitted low-rank stand-in's squared error on the
    group's output over calibration tokens is at most the mean stand-in's (it is a least-squares fit
    that contains the mean as its rank-0 case)."""
    model = tiny_model("llama", seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = attach_routers(model, RoutingConfig(attn_group_size=2, ffn_group_size=32, standin="lowrank:4"))
    ids = torch.randint(5, 100, (8, 64), generator=torch.Generator().manual_seed(2))
    assert fit_lowrank_standins(model, ids, batch_size=4) == 8 * 64
    assert state.mode == "argmax"  # restored
    layer = model.model.layers[0]
    grabbed = {}
    hooks = [layer.mlp.gate_proj.register_forward_pre_hook(lambda m, a: grabbed.__setitem__("x", a[0])),
             layer.mlp.down_proj.register_forward_pre_hook(lambda m, a: grabbed.__setitem__("a", a[0]))]
    state.set_mode("dense")
    with torch.no_grad():
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    x, a = grabbed["x"].reshape(-1, grabbed["x"].shape[-1]), grabbed["a"].reshape(-1, grabbed["a"].shape[-1])
    r, W = layer.router_ffn, layer.mlp.down_proj.weight
    with torch.no_grad():
        for j in range(4):
            cols = slice(j * 32, (j + 1) * 32)
            y = a[:, cols] @ W[:, cols].T
            mean_err = float(((y - y.mean(0)) ** 2).sum())
            pred = r.standin[j] + (x @ r.standin_in[j].T) @ r.standin_out[j]
            assert float(((y - pred) ** 2).sum()) < mean_err
            # centred: on the calibration tokens the stand-in averages to the group's mean output
            torch.testing.assert_close(pred.mean(0), y.mean(0), atol=1e-4, rtol=0)


def test_fit_in_several_passes_equals_one_pass():
    model = tiny_model("llama", seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        attach_routers(model, RoutingConfig(attn_group_size=2, ffn_group_size=32, standin="lowrank:4"))
    ids = torch.randint(5, 100, (4, 32), generator=torch.Generator().manual_seed(2))

    def fitted(max_bytes):
        fit_lowrank_standins(model, ids, max_moment_bytes=max_bytes)
        return {n: p.detach().clone() for n, p in model.named_parameters() if ".standin" in n}

    one, many = fitted(1 << 40), fitted(1)  # one pass; one module a pass
    assert one.keys() == many.keys() and len(one) == 2 * 2 * 3
    for n in one:
        torch.testing.assert_close(many[n], one[n], atol=1e-6, rtol=1e-5)


def test_router_maps_start_as_the_constant_alone_and_both_sides_get_gradients():
    r = Router(8, 4, 3, standin_rank=2)
    assert float(r.standin_out.detach().abs().sum()) == 0 and float(r.standin_in.detach().abs().sum()) > 0
    x = torch.randn(5, 8)
    out = apply_standin(torch.zeros(5, 8), torch.zeros(5, 3), r.standin, x, r.standin_in, r.standin_out)
    torch.testing.assert_close(out, r.standin.sum(0).expand(5, 8))
    (out * torch.randn(5, 8)).sum().backward()
    assert float(r.standin_out.grad.abs().sum()) > 0  # the input side then follows


@pytest.mark.parametrize("value", ["lowrank:\u00b2", "lowrank:-1", "lowrank:4.0"])
def test_a_rank_that_is_not_a_plain_integer_is_refused(value):
    with pytest.raises(ConfigError, match="needs a rank >= 1"):
        RoutingConfig(standin=value)


def test_prune_reports_the_cost_its_cost_model_charged():
    """``measured_cost`` (what `wide prune` prints against the target) charges the stand-ins."""
    from wide_cli.pipeline.prune import measured_cost
    from wide_cli.pipeline.settings import settings_from_dict

    model = tiny_model("llama")
    half = {"attention": 0.5, "ffn": 0.5}
    costs = {}
    for standin in ("trained", "lowrank:8"):
        s = settings_from_dict({"model": {"name": "tiny-llama"},
                                "routing": {"attn_group_size": 2, "ffn_group_size": 32, "standin": standin}})
        costs[standin] = measured_cost(s, model.config, half, 16)["flops"]
    cfg = RoutingConfig(attn_group_size=2, ffn_group_size=32, standin="lowrank:8")
    assert costs["lowrank:8"] == pytest.approx(cfg.cost_model(model_shape(model.config), 16).relative(half))
    assert costs["lowrank:8"] > costs["trained"]
