"""`wide export --weights`: int8 and int4 exports of a trained run that `wide generate` runs in their
stored format; formats an export kind cannot store are refused in one line (exit 2) before
anything is written."""

from __future__ import annotations

import json

import pytest
import torch

from tests.cli._invoke import ok
from wide_cli.cli.app import main


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_export_generates_in_its_format(fmt, trained_run, tmp_path):
    out = tmp_path / fmt
    ok(["export", "--run-dir", str(trained_run), "--out", str(out), "--weights", fmt])
    wf = json.loads((out / "wide_config.json").read_text())["weight_format"]
    assert wf["format"] == fmt
    # int4 scales are chosen with the importance of the run's training data by default
    assert ("importance" in wf) == (fmt == "int4")
    if fmt == "int4":
        assert wf["importance"]["tokens"] > 0 and wf["importance"]["data"].startswith("training split of ")
    r = ok(["generate", str(out), "-p", "hello", "--max-new-tokens", "3", "--ignore-eos", "--json", "--threads", "1"])
    d = json.loads(r.stdout.strip().splitlines()[-1])
    assert d["weights"] == fmt and d["dtype"] == "bfloat16" and len(d["tokens"][0]) == 3


def test_int4_export_without_importance_keeps_the_plain_rule(trained_run, tmp_path):
    from safetensors.torch import load_file

    plain, imp = tmp_path / "plain", tmp_path / "imp"
    ok(["export", "--run-dir", str(trained_run), "--out", str(plain), "--weights", "int4", "--no-importance"])
    ok(["export", "--run-dir", str(trained_run), "--out", str(imp), "--weights", "int4"])
    assert "importance" not in json.loads((plain / "wide_config.json").read_text())["weight_format"]
    a, b = load_file(str(plain / "model.safetensors")), load_file(str(imp / "model.safetensors"))
    assert a.keys() == b.keys() and all(a[k].shape == b[k].shape and a[k].dtype == b[k].dtype for k in a)
    assert any(not torch.equal(a[k], b[k]) for k in a if k.endswith("_scale"))


@pytest.mark.parametrize("argv,phrase", [
    (["--weights", "int4", "--format", "hf"], "--weights int4 is stored only in --format wide exports"),
    (["--weights", "int2"], "--weights 'int2' unknown for an export"),
])  # fmt: skip
def test_export_refuses_a_weight_format_it_cannot_store(argv, phrase, trained_run, tmp_path, capsys):
    out = tmp_path / "x"
    assert main(["export", "--run-dir", str(trained_run), "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and phrase in err[0], err
    assert not out.exists()
