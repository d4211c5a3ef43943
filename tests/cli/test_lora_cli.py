"""Stage 2 through the CLI: `wide prune --lora` and `wide train --stage 2` give the same merged
export; the export records LoRA, equals the unmerged adapter model, and stage 2 runs at tau_end."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from tests.cli._invoke import ok as _ok

COMMON = ["--seq-len", "32", "--batch-size", "2", "--attn-group-size", "2", "--ffn-group-size", "32",
          "--steps", "3", "--eval-max-tokens", "1024"]
LORA = ["--lora-steps", "3", "--lora-lr", "1e-2"]


def test_prune_lora_equals_staged_stage2_and_merges(tmp_path, text_file):
    whole = tmp_path / "whole"
    _ok(["prune", "tiny-llama", "--data", str(text_file), "--run-dir", str(whole), *COMMON, "--lora", *LORA])
    s2 = json.loads((whole / "stage2" / "result.json").read_text())
    assert s2["steps"] == 3 and {h["tau"] for h in s2["history"]} == {0.5}  # held at tau_end
    wcfg = json.loads((whole / "export" / "wide_config.json").read_text())
    assert wcfg["lora"] == {"merged": True, "rank": 16, "alpha": 32.0,
                            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}

    staged = tmp_path / "staged"
    _ok(["calibrate", "tiny-llama", "--data", str(text_file), "--run-dir", str(staged), *COMMON[:8]])
    _ok(["train", "--run-dir", str(staged), "--steps", "3"])
    _ok(["train", "--run-dir", str(staged), "--stage", "2", *LORA])
    _ok(["export", "--run-dir", str(staged), "--out", str(tmp_path / "exp")])
    assert json.loads((tmp_path / "exp" / "wide_config.json").read_text())["lora"] == wcfg["lora"]
    a = load_file(str(whole / "export" / "model.safetensors"))
    b = load_file(str(tmp_path / "exp" / "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)

    # the merged export computes what the unmerged adapter model computes
    from wide_cli.export import load_pruned
    from wide_cli.pipeline.common import load_backbone
    from wide_cli.pipeline.routers import routed_model_from_run
    from wide_cli.pipeline.rundir import RunDir
    from wide_cli.pipeline.settings import settings_from_dict

    run = RunDir(staged)
    settings = settings_from_dict(json.loads((staged / "run.json").read_text())["settings"])
    _, unmerged = routed_model_from_run(settings, run, loaded=load_backbone(settings))
    merged = load_pruned(tmp_path / "exp").model
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, unmerged(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


def test_export_refuses_stale_stage2_and_no_lora_exports_stage1(tmp_path, text_file, capsys):
    import os

    from wide_cli.cli.app import main

    run = tmp_path / "r"
    _ok(["prune", "tiny-llama", "--data", str(text_file), "--run-dir", str(run), *COMMON, "--lora", *LORA])
    r1 = run / "stage1" / "routers.safetensors"
    os.utime(r1)  # touching (or copying) the routers is harmless: the check is by content
    _ok(["export", "--run-dir", str(run), "--out", str(tmp_path / "e0"), "--lora"])
    _ok(["train", "--run-dir", str(run), "--steps", "4"])  # stage 1 retrained after stage 2
    code = main(["export", "--run-dir", str(run), "--out", str(tmp_path / "e")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "trained on other stage-1 routers" in err[-1] and "--stage 2" in err[-1], err
    # resuming stage 2 on the retrained routers is refused too (its identity holds their sha256)
    code = main(["train", "--run-dir", str(run), "--stage", "2", *LORA, "--lora-steps", "5", "--resume"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "stage1_routers_sha256" in err[-1], err
    assert not (tmp_path / "e").exists()
    _ok(["export", "--run-dir", str(run), "--out", str(tmp_path / "e"), "--no-lora"])
    assert json.loads((tmp_path / "e" / "wide_config.json").read_text())["lora"] is None


def test_export_lora_without_adapter_is_an_error(tmp_path, text_file, capsys):
    from wide_cli.cli.app import main

    run = tmp_path / "r"
    _ok(["prune", "tiny-llama", "--data", str(text_file), "--run-dir", str(run), *COMMON])
    code = main(["export", "--run-dir", str(run), "--out", str(tmp_path / "e"), "--lora"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "holds no trained adapter" in err[-1] and not (tmp_path / "e").exists()
