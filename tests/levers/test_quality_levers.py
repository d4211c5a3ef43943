"""The quality levers: cost targets, distillation, stand-ins for skipped groups, the
target warm-up and the skip offset that lands a run on its cost target."""

from __future__ import annotations

import warnings

import pytest
import torch

from wide_cli.calibrate.statistics import collect_statistics, standin_vectors
from wide_cli.cost import cost_model
from wide_cli.models.arch import model_shape
from wide_cli.models.tiny import tiny_model
from wide_cli.routing import RoutingConfig, attach_routers
from wide_cli.train.config import TrainConfig
from wide_cli.train.loop import distillation_loss, train_stage

DATA = torch.randint(5, 100, (16, 16), generator=torch.Generator().manual_seed(0))


def _routed(seed=0, **cfg):
    model = tiny_model("llama", seed=seed)
    for p in model.parameters():
        p.requires_grad_(False)
    torch.manual_seed(seed + 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        attach_routers(model, RoutingConfig(attn_group_size=2, ffn_group_size=32, **cfg))
    model.wide_routing.set_mode("argmax")
    return model


def _all(model, value: bool) -> dict:
    st = model.wide_routing
    return {(i, m): torch.full((st.groups(m),), value) for i in range(st.shape.num_layers) for m in ("attention", "ffn")}


# ----------------------------------------------------------------------------- distillation
def test_distillation_loss_is_zero_when_routing_is_all_on():
    from wide_cli.train.loop import _teacher_logits

    model = _routed()
    st = model.wide_routing
    st.forced = _all(model, True)
    ids = DATA[:2]
    with torch.no_grad():
        student = model(input_ids=ids).logits
    st.forced = {}
    teacher = _teacher_logits(model, model, ids)  # routing off: the dense backbone
    assert st.mode == "argmax"  # restored
    assert distillation_loss(student, teacher).item() == pytest.approx(0.0, abs=1e-6)
    assert distillation_loss(student, teacher, temperature=2.0).item() == pytest.approx(0.0, abs=1e-6)
    # with groups skipped the student differs and the loss is a real KL
    st.forced = _all(model, False)
    with torch.no_grad():
        pruned = model(input_ids=ids).logits
    st.forced = {}
    kl = distillation_loss(pruned, teacher)
    p, q = torch.softmax(teacher, -1), torch.softmax(pruned, -1)
    assert kl.item() == pytest.approx((p * (p.log() - q.log())).sum(-1).mean().item(), rel=1e-4)
    assert kl.item() > 0.01


def test_distillation_trains_routers_and_reports_kl(tmp_path):
    model = _routed(sparsity=0.5)
    cfg = TrainConfig(steps=3, batch_size=2, seq_len=16, lr=1e-2, distill=0.5, checkpoint_every=0)
    res = train_stage(model, DATA, cfg, stage_dir=tmp_path, identity={}, progress=False)
    assert res.final["kl"] > 0 and res.final["loss"] > 0


# ----------------------------------------------------------------------------- stand-ins
@pytest.fixture(scope="module")
def stats_and_dense():
    dense = tiny_model("llama", seed=0)
    stats = collect_statistics(dense, DATA, batch_size=4)
    return stats, dense


def test_standin_vectors_equal_their_definition(stats_and_dense):
    """Stand-in of group g = mean over calibration tokens of what the group adds to the output."""
    stats, dense = stats_and_dense
    o_in, d_in = {}, {}
    hooks = [dense.model.layers[1].self_attn.o_proj.register_forward_pre_hook(lambda m, a: o_in.setdefault("x", a[0])),
             dense.model.layers[1].mlp.down_proj.register_forward_pre_hook(lambda m, a: d_in.setdefault("x", a[0]))]
    with torch.no_grad():
        dense.model(input_ids=DATA)
    for h in hooks:
        h.remove()
    Wo, Wd = dense.model.layers[1].self_attn.o_proj.weight, dense.model.layers[1].mlp.down_proj.weight
    d = dense.config.hidden_size // dense.config.num_attention_heads
    # attention group 1 = heads 2, 3 = o_proj input columns 2d .. 4d
    x = o_in["x"].reshape(-1, Wo.shape[1])[:, 2 * d:4 * d]
    want = (x @ Wo[:, 2 * d:4 * d].T).mean(0)
    got = standin_vectors(stats, dense, "attention", 2)
    assert got.shape == (2, 2, 64)
    torch.testing.assert_close(got[1, 1], want, atol=1e-5, rtol=1e-4)
    # FFN group 2 = channels 64 .. 96
    x = d_in["x"].reshape(-1, Wd.shape[1])[:, 64:96]
    torch.testing.assert_close(standin_vectors(stats, dense, "ffn", 32)[1, 2], (x @ Wd[:, 64:96].T).mean(0),
                               atol=1e-5, rtol=1e-4)


def test_skipped_group_adds_its_standin_and_disabled_costs_nothing(stats_and_dense):
    from wide_cli.pipeline.routers import init_standins_from_statistics

    stats, _ = stats_and_dense
    plain = _routed(standin="none")
    model = _routed(standin="mean")
    init_standins_from_statistics(model, stats)
    # disabled: no stand-in tensors at all (nothing stored, nothing computed)
    assert not any("standin" in k for k in plain.state_dict())
    assert sum("standin" in k for k in model.state_dict()) == 4
    ids = DATA[:2]
    forced = _all(model, True)
    forced[(0, "ffn")] = torch.tensor([True, False, True, True])  # skip FFN group 1 of layer 0
    outs = {}
    for name, m in (("plain", plain), ("standin", model)):
        m.wide_routing.forced = forced
        h: dict = {}
        hook = m.model.layers[0].register_forward_hook(lambda mod, a, out, h=h: h.setdefault("y", out))
        with torch.no_grad():
            m.model(input_ids=ids)
        hook.remove()
        m.wide_routing.forced = {}
        outs[name] = h["y"][0] if isinstance(h["y"], tuple) else h["y"]
    st = model.model.layers[0].router_ffn.standin[1]
    torch.testing.assert_close(outs["standin"] - outs["plain"], st.expand_as(outs["plain"]), atol=1e-5, rtol=1e-5)
    # all-on: a stand-in model equals the plain one exactly (stand-ins only act on skipped groups)
    for m in (plain, model):
        m.wide_routing.forced = _all(m, True)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, plain(input_ids=ids).logits, atol=0, rtol=0)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_runtime_applies_the_standins_like_the_hf_model(tmp_path, stats_and_dense, backend):
    from wide_cli.pipeline.routers import init_standins_from_statistics
    from wide_cli.runtime.engine import Runtime

    stats, _ = stats_and_dense
    model = _routed(standin="trained")
    init_standins_from_statistics(model, stats)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.router_ffn.standin.mul_(3.0)  # trained stand-ins differ from the means
    ids = DATA[:2, :10]
    with torch.no_grad():
        want = model(input_ids=ids).logits.float()
    rt = Runtime.from_model(model, backend=backend)
    got = rt.forward(ids)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=0)
    assert 0.05 < rt.stats.summary()["total"] < 0.95  # some groups skip, so the stand-ins act


# ----------------------------------------------------------------------------- cost targets
def test_cost_target_drives_the_weighted_fraction(tmp_path):
    model = _routed(cost_target=0.6)
    cm = model.wide_routing.cfg.cost_model(model.wide_routing.shape, 16)
    seen = []

    def on_step(step, metrics):
        seen.append(metrics["cost"])

    cfg = TrainConfig(steps=2, batch_size=2, seq_len=16, lr=1e-2, checkpoint_every=0)
    train_stage(model, DATA, cfg, stage_dir=tmp_path, identity={}, progress=False, on_step=on_step)
    # the metric is 1 - the weighted skip of the step's hard decisions, recomputed here
    st = model.wide_routing
    st.set_mode("argmax")
    counter = st.start_counting()
    with torch.no_grad():
        model(input_ids=DATA[:2])
    st.stop_counting()
    assert 0 < cm.relative(counter.summary()) <= 1 and len(seen) == 2 and all(0 < c <= 1 for c in seen)


def test_skip_offset_lands_on_the_cost_target():
    from wide_cli.pipeline.routers import calibrate_skip_offset
    from wide_cli.routing.config import SkipTarget

    model = _routed(cost_target=0.7)
    st = model.wide_routing
    cm = st.cfg.cost_model(st.shape, 16)
    delta = calibrate_skip_offset(model, DATA[:8], SkipTarget(cm, 0.3), batch_size=4, tol=0.01, iters=20)
    counter = st.start_counting()
    with torch.no_grad():
        model(input_ids=DATA[:8])
    st.stop_counting()
    assert cm.skip_from_summary(counter.summary()) == pytest.approx(0.3, abs=0.01)
    assert delta != 0.0


def test_warmup_ramps_the_target():
    model = _routed(sparsity=0.5, sparsity_warmup=0.5)
    ramps = []
    cfg = TrainConfig(steps=4, batch_size=2, seq_len=16, lr=1e-2, checkpoint_every=0)
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        train_stage(model, DATA, cfg, stage_dir=d, identity={}, progress=False,
                    on_step=lambda s, m: ramps.append(m["target_ramp"]))
    assert ramps == [0.5, 1.0, 1.0, 1.0]


def test_unreachable_cost_target_names_the_range():
    from wide_cli.errors import ConfigError

    shape = model_shape(tiny_model("llama").config)
    floor = cost_model(shape, seq_len=256).floor_fraction
    cfg = RoutingConfig(attn_group_size=2, ffn_group_size=32, cost_target=floor / 2)
    with pytest.raises(ConfigError, match=rf"cost-target {floor / 2:g} \(flops\) is not reachable.*\({floor:.3f}, 1\)"):
        cfg.check_reachable(shape, 256)
    with pytest.raises(ConfigError, match=r"cost-target 1.2 is outside \(0, 1\)"):
        RoutingConfig(cost_target=1.2)


@pytest.mark.parametrize("value, message", [
    ("0.1", r"error: cost-target 0.1 \(flops\) is not reachable: routing can reach a cost in \(0\.1\d\d, 1\)"),
    ("1.5", r"error: cost-target 1.5 is outside \(0, 1\)"),
])
def test_cli_unreachable_cost_target_exits_2_and_writes_nothing(tmp_path, value, message, capsys):
    import re

    from wide_cli.cli.app import main

    run = tmp_path / "run"
    code = main(["prune", "tiny-llama", "--attn-group-size", "2", "--ffn-group-size", "32",
                 "--cost-target", value, "--run-dir", str(run)])
    err = capsys.readouterr().err
    assert code == 2
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and re.search(message, errors[0]), err
    assert not run.exists()
