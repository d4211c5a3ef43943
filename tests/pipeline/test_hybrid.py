"""Hybrid depth + width (``--drop-layers N`` with ``--method wide``): the N least influential
layers (Block Influence) are removed, width is routed in the rest, and the cost target counts the
whole source model. The export is a wide export of a model with fewer layers that wide eval, the
transformers loader and the runtime all run."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from wide_cli.cli.app import app, main
from wide_cli.cost import fraction_after
from wide_cli.errors import ConfigError
from wide_cli.models import depth
from wide_cli.models.arch import model_shape
from wide_cli.models.tiny import tiny_model
from wide_cli.pipeline import static_depth as sd
from wide_cli.routing.config import RoutingConfig, kept_shape

TINY = ["--seq-len", "32", "--batch-size", "2", "--eval-max-tokens", "1024"]


def test_routed_cost_target_is_the_whole_model_target_over_the_depth_fraction():
    shape = model_shape(tiny_model("llama", num_hidden_layers=6).config)
    cm = sd.depth_cost(shape, metric="flops", seq_len=32)
    cfg = RoutingConfig(cost_target=0.5, drop_layers=2)
    kept = kept_shape(shape, 2)
    assert kept.num_layers == 4
    # the layer-pruned model costs what static depth computes for two removed layers
    assert cfg.depth_fraction(kept, 32) == pytest.approx(fraction_after(cm, 2))
    assert cfg.routed_cost_target(kept, 32) == pytest.approx(0.5 / fraction_after(cm, 2))
    assert RoutingConfig(cost_target=0.5).routed_cost_target(shape, 32) == 0.5
    assert RoutingConfig(drop_layers=2).routed_cost_target(kept, 32) is None
    cfg.check_reachable(shape, 32)  # 0.5 is between routing's floor and the depth fraction


def test_drop_layers_bad_values_name_the_value_and_the_range():
    shape = model_shape(tiny_model("llama", num_hidden_layers=6).config)
    with pytest.raises(ConfigError, match="drop-layers 6 would remove every layer of a 6-layer model"):
        RoutingConfig(drop_layers=6).check_reachable(shape, 32)
    with pytest.raises(ConfigError, match="drop-layers -1 must be >= 0"):
        RoutingConfig(drop_layers=-1)
    with pytest.raises(ConfigError, match="applies to --method wide or dynamic-depth, not static-depth"):
        RoutingConfig(method="static-depth", drop_layers=2)
    depth = fraction_after(sd.depth_cost(shape, metric="flops", seq_len=32), 2)
    with pytest.raises(ConfigError) as e:
        RoutingConfig(cost_target=0.95, drop_layers=2).check_reachable(shape, 32)
    assert f"removing 2 of 6 layers costs {depth:.3f} of dense" in str(e.value)


def test_teacher_runs_the_source_model_and_the_student_the_pruned_one():
    dense = tiny_model("llama", seed=1, num_hidden_layers=4).eval()
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want_full = dense(input_ids=ids, use_cache=False).logits
    pruned = depth.drop_for_hybrid(dense, [1, 2])
    assert depth.is_layer_pruned(pruned) and pruned.config.num_hidden_layers == 2
    ref = depth.remove_layers(tiny_model("llama", seed=1, num_hidden_layers=4).eval(), [1, 2])
    with torch.no_grad():
        torch.testing.assert_close(pruned(input_ids=ids, use_cache=False).logits, ref(input_ids=ids).logits)
        with depth.source_depth(pruned):
            torch.testing.assert_close(pruned(input_ids=ids, use_cache=False).logits, want_full)
        # and back to the pruned model afterwards
        torch.testing.assert_close(pruned(input_ids=ids, use_cache=False).logits, ref(input_ids=ids).logits)
    assert len(pruned.model.layers) == 2 and pruned.config.num_hidden_layers == 2


@pytest.fixture
def hybrid_run(tmp_path, text_file):
    """tiny-llama (2 layers) pruned with --drop-layers 1 and every lever, 2 steps."""
    run = tmp_path / "run"
    args = ["prune", "tiny-llama", "--data", str(text_file), "--run-dir", str(run), "--drop-layers", "1",
            "--ffn-group-size", "32", "--cost-target", "0.4", "--standin", "trained", "--distill", "0.5",
            "--lora-joint", "--steps", "2", *TINY, "--json"]
    r = CliRunner().invoke(app, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return run, json.loads(r.stdout.strip().splitlines()[-1])


def test_hybrid_prune_exports_a_routed_model_with_fewer_layers(hybrid_run):
    from wide_cli.eval.run import evaluate_model, load_target, make_plan
    from wide_cli.export.loader import load_pruned
    from wide_cli.runtime.engine import Runtime

    run, res = hybrid_run
    sel = json.loads((run / "calibration" / sd.DROP_FILE).read_text())
    assert res["train"]["dropped_layers"]["removed"] == sel["removed"] and len(sel["removed"]) == 1
    assert sel["num_layers"] == 2 and len(sel["influence"]) == 2
    exp = run / "export"
    wcfg = json.loads((exp / "wide_config.json").read_text())
    assert wcfg["dropped_layers"]["removed"] == sel["removed"] and wcfg["routing"]["drop_layers"] == 1
    assert wcfg["lora"]["merged"] and (exp / "routers.safetensors").is_file()
    assert json.loads((exp / "config.json").read_text())["num_hidden_layers"] == 1

    # the cost counts the whole source: below what removing the layer alone reaches
    depth = sel["cost_fraction"]
    assert 0 < res["cost"]["flops"] <= depth + 1e-9 and res["cost"]["target"] == 0.4

    pm = load_pruned(exp)
    assert pm.model.config.num_hidden_layers == 1 and pm.model.wide_routing.cfg.drop_layers == 1
    ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = pm.model(input_ids=ids).logits.float()
    for backend in ("reference", "cpu"):
        got = Runtime.from_export(exp, backend=backend).forward(ids)
        torch.testing.assert_close(got, want, atol=2e-4, rtol=0)

    # wide eval reports FLOPs against the source model, not the 1-layer export
    text = run.parent / "train.txt"
    plan = make_plan([], data_dir=None, limit=None, seq_len=32, stride=None, batch_size=2, eval_data=text)
    row = evaluate_model(load_target(str(exp), dtype=torch.float32, device="cpu"), plan)
    full = sd.depth_cost(model_shape(tiny_model("llama").config), metric="flops", seq_len=32).dense_total
    assert row["flops"]["dense_flops_per_token"] == pytest.approx(full)
    assert row["flops"]["relative"] == pytest.approx(row["flops"]["routed_flops_per_token"] / full)
    assert row["flops"]["relative"] < depth + 0.05  # routers add a little on top of the routed layers


def test_hybrid_stage_by_stage_removes_the_same_layers(tmp_path, text_file):
    from tests.cli._invoke import ok

    run = str(tmp_path / "run")
    ok(["calibrate", "tiny-llama", "--data", str(text_file), "--run-dir", run, "--drop-layers", "1",
        "--cost-target", "0.4", "--seq-len", "32", "--batch-size", "2"])
    sel = json.loads((tmp_path / "run" / "calibration" / sd.DROP_FILE).read_text())
    ok(["train", "--run-dir", run, "--steps", "2"])
    ok(["export", "--run-dir", run, "--out", str(tmp_path / "exp")])
    wcfg = json.loads((tmp_path / "exp" / "wide_config.json").read_text())
    assert wcfg["dropped_layers"]["removed"] == sel["removed"]
    assert json.loads((tmp_path / "exp" / "config.json").read_text())["num_hidden_layers"] == 1


@pytest.mark.parametrize("args, message", [
    (["--drop-layers", "2"], "drop-layers 2 would remove every layer of a 2-layer model"),
    (["--drop-layers", "1", "--method", "static-depth"], "applies to --method wide or dynamic-depth"),
    (["--drop-layers", "1", "--cost-target", "0.9"], "is not reachable with drop-layers 1"),
    (["--drop-layers", "-1"], "drop-layers -1 must be >= 0"),
])
def test_bad_drop_layers_one_line_exit_2_nothing_written(tmp_path, text_file, capsys, args, message):
    argv = ["prune", "tiny-llama", "--data", str(text_file), "--run-dir", str(tmp_path / "r"), *args, *TINY]
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    errors = [line for line in err if line.startswith("error: ")]
    assert len(errors) == 1 and err[-1] == errors[0] and message in errors[0], err
    assert not (tmp_path / "r").exists()
