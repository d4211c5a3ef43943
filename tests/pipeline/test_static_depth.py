"""Static depth pruning (ShortGPT): Block Influence against a direct computation, layer selection
against the cost model, the export as a plain smaller transformers model (logits equal the dense
model with those layers removed, also in the runtime), and bad cost targets."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from wide_cli.cli.app import app, main
from wide_cli.cost import fraction_after
from wide_cli.models import depth
from wide_cli.models.arch import model_shape
from wide_cli.models.tiny import tiny_model
from wide_cli.pipeline import static_depth as sd


def _direct_block_influence(model, ids, mask):
    """1 - mean cosine(h_i, h_{i+1}) from output_hidden_states, with the final norm removed so the
    last hidden state is the last layer's raw output."""
    model.model.norm = torch.nn.Identity()
    with torch.no_grad():
        hs = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    m = mask.bool()
    out = []
    for i in range(len(hs) - 1):
        cos = torch.nn.functional.cosine_similarity(hs[i][m].double(), hs[i + 1][m].double(), dim=-1)
        out.append(1.0 - cos.mean().item())
    return torch.tensor(out, dtype=torch.float64)


def test_block_influence_equals_direct_computation_with_padding():
    model = tiny_model("llama", seed=3, num_hidden_layers=4)
    ids = torch.randint(0, 100, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, :5] = 0  # left padding: those tokens must not count
    mask[2, :2] = 0
    bi = sd.block_influence(model, ids, batch_size=2, attention_mask=mask)
    ref = _direct_block_influence(model, ids, mask)
    assert bi.shape == (4,)
    torch.testing.assert_close(bi, ref, atol=1e-5, rtol=1e-4)
    assert bool((bi > 0).all())


def test_layer_selection_removes_the_least_influential_until_the_cost_is_met():
    shape = model_shape(tiny_model("llama", num_hidden_layers=6).config)
    cm = sd.depth_cost(shape, metric="flops", seq_len=32)
    bi = torch.tensor([0.9, 0.1, 0.5, 0.05, 0.3, 0.7], dtype=torch.float64)
    # exactly two layers' cost: the two lowest-BI layers go
    assert sd.layers_to_remove(bi, cm, fraction_after(cm, 2)) == [1, 3]
    # a target between two and three layers' cost needs three
    assert sd.layers_to_remove(bi, cm, (fraction_after(cm, 2) + fraction_after(cm, 3)) / 2) == [1, 3, 4]
    assert fraction_after(cm, 0) == pytest.approx(1.0)
    # a whole layer and the fixed part, by hand from the FLOPs formula (C = 16.5 at seq_len 32)
    D, H, Hkv, d, F, V = 64, 4, 2, 16, 128, shape.vocab_size
    per_layer = 2 * D * H * d + 4 * D * Hkv * d + 4 * H * d * 16.5 + 2 * H * d * D + 6 * D * F
    assert cm.layer_cost == pytest.approx(per_layer)
    assert cm.model_floor == pytest.approx(2 * D * V)
    b = sd.depth_cost(shape, metric="decode_bytes")
    assert b.layer_cost == pytest.approx(2 * D * H * d + 2 * D * Hkv * d + 3 * D * F + 2 * D)
    assert fraction_after(b, 6) == pytest.approx((V * D + 2 * D) / (V * D + 2 * D + 6 * b.layer_cost))


def test_unreachable_cost_target_names_value_and_range():
    from wide_cli.errors import ConfigError

    shape = model_shape(tiny_model("llama", num_hidden_layers=6).config)
    cm = sd.depth_cost(shape, metric="flops", seq_len=32)
    lo = fraction_after(cm, 5)
    with pytest.raises(ConfigError) as e:
        sd.layers_to_remove(torch.zeros(6), cm, lo / 2, model_name="m")
    msg = str(e.value)
    assert f"cost target {lo / 2}" in msg and f"[{lo:.3f}, 1)" in msg and "keeping 1 of 6 layers" in msg


def test_healing_distills_from_the_source_model_not_the_layer_pruned_one():
    # Distillation's teacher is the backbone with LoRA off; for healing that must be the source
    # model with every layer, or half the loss pulls towards the unhealed pruned model.
    from wide_cli.routing import attach_routers
    from wide_cli.train.loop import _teacher_logits

    source = tiny_model("llama", seed=2, num_hidden_layers=4).eval()
    ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = source(input_ids=ids).logits
        pruned = depth.remove_layers(tiny_model("llama", seed=2, num_hidden_layers=4).eval(), [1, 2])(input_ids=ids).logits
    model = sd.healing_model(source, [1, 2])
    attach_routers(model, sd.PLAIN_ROUTING)
    assert len(model.model.layers) == 2 and len(source.model.layers) == 4  # the source is untouched
    with torch.no_grad():
        student = model(input_ids=ids).logits
        teacher = _teacher_logits(model, model, ids)
    torch.testing.assert_close(student, pruned)
    torch.testing.assert_close(teacher, want)


TINY = ["--seq-len", "32", "--batch-size", "2", "--eval-max-tokens", "1024"]


def test_static_depth_export_is_plain_transformers_and_equals_dense_with_layers_removed(tmp_path, text_file):
    from transformers import AutoModelForCausalLM

    from wide_cli.models.loader import load_model
    from wide_cli.runtime.engine import Runtime

    run = tmp_path / "run"
    args = ["prune", "tiny-llama", "--data", str(text_file), "--run-dir", str(run), "--method", "static-depth",
            "--cost-target", "0.7", *TINY, "--json"]
    r = CliRunner().invoke(app, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout.strip().splitlines()[-1])
    info = res["train"]["static_depth"]
    assert info["num_layers"] == 2 and len(info["removed"]) == 1
    # the reported cost is the layer-pruned model's against its source, not 1.0 (no routers)
    assert res["cost"]["flops"] == pytest.approx(info["cost_fraction"])
    assert res["cost"]["error"] == pytest.approx(info["cost_fraction"] - 0.7)
    assert 0 < res["cost"]["decode_bytes"] < 1
    exp = run / "export"
    assert not (exp / "routers.safetensors").exists()
    wcfg = json.loads((exp / "wide_config.json").read_text())
    assert wcfg["method"] == "static-depth" and wcfg["static_depth"]["removed"] == info["removed"]

    plain = AutoModelForCausalLM.from_pretrained(exp, local_files_only=True).eval()
    assert plain.config.num_hidden_layers == 1 and not hasattr(plain, "wide_routing")
    dense = depth.remove_layers(load_model("tiny-llama").model.eval(), info["removed"])
    ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = dense(input_ids=ids).logits
        got = plain(input_ids=ids).logits
    torch.testing.assert_close(got, want)
    # the runtime runs it too (no routers): same logits
    rt = Runtime.from_export(exp, backend="cpu")
    torch.testing.assert_close(rt.forward(ids), want, atol=1e-4, rtol=1e-4)
    # and generation with a KV cache matches HF greedy (layer_idx renumbered)
    with torch.no_grad():
        hf = plain.generate(ids[:1], max_new_tokens=6, do_sample=False)
        ref = dense.generate(ids[:1], max_new_tokens=6, do_sample=False)
    assert hf.tolist() == ref.tolist()


def test_static_depth_healing_trains_lora_and_merges(tmp_path, text_file):
    run = tmp_path / "run"
    args = ["prune", "tiny-llama", "--data", str(text_file), "--run-dir", str(run), "--method", "static-depth",
            "--cost-target", "0.7", "--lora", "--lora-steps", "2", *TINY, "--json"]
    r = CliRunner().invoke(app, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["train"]["steps"] == 2 and (run / "stage2" / "adapter.safetensors").is_file()
    wcfg = json.loads((run / "export" / "wide_config.json").read_text())
    assert wcfg["lora"]["merged"] is True and wcfg["train"]["stage2"]["steps"] == 2


@pytest.mark.parametrize("value,message", [
    ("0.05", "cost target 0.05 is below what static-depth can reach on tiny-llama"),
    ("1.5", "cost-target 1.5 is outside (0, 1)"),
    ("0", "cost-target 0.0 is outside (0, 1)"),
])
def test_bad_cost_target_one_line_exit_2_nothing_written(tmp_path, text_file, capsys, value, message):
    argv = ["prune", "tiny-llama", "--data", str(text_file), "--run-dir", str(tmp_path / "r"),
            "--method", "static-depth", "--cost-target", value, *TINY]
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    errors = [line for line in err if line.startswith("error: ")]
    assert len(errors) == 1 and err[-1] == errors[0] and message in errors[0], err
    assert not (tmp_path / "r" / "export").exists()
    assert not (tmp_path / "r" / "stage1" / "static_depth.json").exists()


def test_static_depth_stage_by_stage(tmp_path, text_file):
    from tests.cli._invoke import ok

    run = str(tmp_path / "run")
    ok(["calibrate", "tiny-llama", "--data", str(text_file), "--run-dir", run, "--method", "static-depth",
        "--cost-target", "0.7", "--seq-len", "32", "--batch-size", "2"])
    ok(["train", "--run-dir", run])
    sel = json.loads((tmp_path / "run" / "stage1" / "static_depth.json").read_text())
    assert sel["num_layers"] == 2 and len(sel["removed"]) == 1 and len(sel["influence"]) == 2
    ok(["train", "--run-dir", run, "--stage", "2", "--lora-steps", "2"])
    ok(["export", "--run-dir", run, "--out", str(tmp_path / "exp")])
    wcfg = json.loads((tmp_path / "exp" / "wide_config.json").read_text())
    assert wcfg["lora"]["merged"] and wcfg["static_depth"]["removed"] == sel["removed"]
    # --format hf: the same plain transformers checkpoint (no modeling code needed)
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ok(["export", "--run-dir", run, "--out", str(tmp_path / "hf"), "--format", "hf"])
    assert not (tmp_path / "hf" / "modeling_wide.py").exists()
    want, got = load_file(tmp_path / "exp" / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert plain.config.num_hidden_layers == 1 and type(plain).__name__ == "LlamaForCausalLM"


def test_static_depth_model_card_and_inspect_describe_the_removed_layers(tmp_path, text_file):
    from wide_cli.inspection.report import settings_of

    run = tmp_path / "run"
    r = CliRunner().invoke(app, ["prune", "tiny-llama", "--data", str(text_file), "--run-dir", str(run), "--method",
                                 "static-depth", "--cost-target", "0.7", *TINY], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    card = (run / "export" / "README.md").read_text()
    wcfg = json.loads((run / "export" / "wide_config.json").read_text())
    removed = wcfg["static_depth"]["removed"]
    assert f"| removed layers (of the source's) | {removed} (1 of 2) |" in card
    assert "loads exactly the pruned model" in card and "dense backbone only" not in card
    s = settings_of(wcfg)
    assert s["removed layers"] == f"{removed} (1 of 2)" and "sparsity target" not in s
