"""`wide calibrate` -> `wide train` -> `wide export` -> `wide eval --run-dir`, stage by stage,
equals `wide prune` with the same settings; `wide recipes`."""

import json

import torch
from safetensors.torch import load_file

from tests.cli._invoke import ok as _ok

COMMON = ["--seq-len", "32", "--batch-size", "2", "--attn-group-size", "2", "--ffn-group-size", "32"]


def test_stages_equal_prune(tmp_path, text_file):
    run = tmp_path / "staged"
    _ok(["calibrate", "tiny-llama", "--data", str(text_file), "--run-dir", str(run), *COMMON])
    assert (run / "calibration" / "statistics.safetensors").is_file()
    _ok(["train", "--run-dir", str(run), "--steps", "3"])
    _ok(["export", "--run-dir", str(run), "--out", str(tmp_path / "exp")])
    r = _ok(["eval", "--run-dir", str(run), "--json"])
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    assert rep["unit"] == "token-level perplexity" and rep["pruned"]["perplexity"] > 1

    _ok(["prune", "tiny-llama", "--data", str(text_file), "--run-dir", str(tmp_path / "whole"), *COMMON,
         "--steps", "3"])
    a = load_file(str(tmp_path / "exp" / "routers.safetensors"))
    b = load_file(str(tmp_path / "whole" / "export" / "routers.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_train_without_calibration_is_a_clear_error(tmp_path, capsys):
    from wide_cli.cli.app import main

    assert main(["train", "--run-dir", str(tmp_path / "nothing")]) == 2
    assert "holds no run (run.json missing)" in capsys.readouterr().err


def test_recipes_list_and_show():
    r = _ok(["recipes", "--json"])
    names = {x["name"] for x in json.loads(r.stdout)["recipes"]}
    assert {"smollm2-135m-cpu", "llama-3.1-8b-paper", "llama-2-7b", "qwen3-8b", "mistral-7b"} <= names
    r = _ok(["recipes", "llama-3.1-8b-paper", "--json"])
    s = json.loads(r.stdout)
    assert s["routing"]["attn_group_size"] == 4 and s["train"]["seq_len"] == 4096
    assert s["train"]["batch_size"] * s["train"]["grad_accum"] == 16
