"""One cost target, one number: the router initialisation, the cost loss and the skip-logit offset
of a cost-target run all aim at the same cost-weighted skip fraction, the one the cost model gives
for the training sequence length (the attention core's FLOPs grow with the context)."""

from __future__ import annotations

import pytest

from tests.cli._invoke import ok
from wide_cli.cost import cost_model
from wide_cli.models.arch import model_shape
from wide_cli.models.tiny import tiny_model
from wide_cli.routing.config import kept_shape

SEQ_LEN = 32
COST_TARGET = 0.4


def _expected(seq_len: int | None) -> tuple[float, float]:
    """(skip fraction, uniform per-group skip rate) that meet COST_TARGET on tiny-llama with one
    layer removed, from the cost formulas directly."""
    source = model_shape(tiny_model("llama").config)
    kept = kept_shape(source, 1)
    depth = cost_model(kept, seq_len=seq_len).dense_total / cost_model(source, seq_len=seq_len).dense_total
    skip = 1.0 - COST_TARGET / depth
    floor = cost_model(kept, attn_group_size=2, ffn_group_size=32, seq_len=seq_len).floor_fraction
    return skip, skip / (1.0 - floor)


def test_router_init_cost_loss_and_skip_offset_aim_at_one_skip_fraction(tmp_path, text_file, monkeypatch):
    from wide_cli.calibrate import selection
    from wide_cli.pipeline import stages
    from wide_cli.train import loop

    seen = {"init": [], "loss": [], "offset": []}
    init_bias, offset, loss = selection.router_init_bias, stages.calibrate_skip_offset, loop.cost_loss

    def init_spy(importance, skip_rate, **kw):
        seen["init"].append(skip_rate)
        return init_bias(importance, skip_rate, **kw)

    def offset_spy(model, sequences, target, **kw):
        seen["offset"].append(target.skip)
        return offset(model, sequences, target, **kw)

    def loss_spy(s_weighted, target_skip):
        seen["loss"].append(target_skip)
        return loss(s_weighted, target_skip)

    monkeypatch.setattr(selection, "router_init_bias", init_spy)
    monkeypatch.setattr(stages, "calibrate_skip_offset", offset_spy)
    monkeypatch.setattr(loop, "cost_loss", loss_spy)
    run = str(tmp_path / "run")
    ok(["calibrate", "tiny-llama", "--data", str(text_file), "--run-dir", run, "--drop-layers", "1",
        "--ffn-group-size", "32", "--cost-target", str(COST_TARGET), "--seq-len", str(SEQ_LEN),
        "--batch-size", "2"])
    ok(["train", "--run-dir", run, "--steps", "2", "--router-init", "calibration"])

    skip, uniform = _expected(SEQ_LEN)
    assert seen["init"] == pytest.approx([uniform, uniform])  # attention and FFN routers
    assert seen["loss"] == pytest.approx([skip, skip])  # one micro-batch per step, no warm-up
    assert seen["offset"] == pytest.approx([skip])
    # the context matters here: without it the numbers differ by more than the tolerance above
    assert abs(_expected(None)[0] - skip) > 1e-3 and abs(_expected(None)[1] - uniform) > 1e-3


def test_skip_target_converts_the_cost_target_once_with_the_sequence_length():
    from wide_cli.routing.config import RoutingConfig

    shape = model_shape(tiny_model("llama").config)
    cfg = RoutingConfig(attn_group_size=2, ffn_group_size=32, cost_target=0.6)
    target = cfg.skip_target(shape, 256)
    assert target.cost.context_len == 128.5 and target.skip == pytest.approx(0.4)
    # every routed group skipping at the uniform rate removes exactly the target's share of the cost
    uniform = {(i, m): target.uniform_skip for i in range(shape.num_layers) for m in ("attention", "ffn")}
    assert target.cost.weighted_skip(uniform) == pytest.approx(target.skip)
    assert target.uniform_skip == pytest.approx(0.4 / (1.0 - cost_model(shape, seq_len=256).floor_fraction))
    # with layers removed the skip is what the routers still owe: 1 - target / depth fraction
    hybrid = RoutingConfig(attn_group_size=2, ffn_group_size=32, cost_target=COST_TARGET, drop_layers=1)
    assert hybrid.skip_target(kept_shape(shape, 1), SEQ_LEN).skip == pytest.approx(_expected(SEQ_LEN)[0])
    assert RoutingConfig(sparsity=0.5).skip_target(shape, 256) is None
