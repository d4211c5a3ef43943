"""`wide export --weights`: int8 and int4 exports of a trained run that `wide generate` runs in their
stored format; formats an export kind cannot store are refused in one line (exit 2) before
anything is written."""

from __future__ import annotations

import json

import pytest

from tests.cli._invoke import ok
from wide_cli.cli.app import main


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_export_generates_in_its_format(fmt, trained_run, tmp_path):
    out = tmp_path / fmt
    ok(["export", "--run-dir", str(trained_run), "--out", str(out), "--weights", fmt])
    assert json.loads((out / "wide_config.json").read_text())["weight_format"]["format"] == fmt
    r = ok(["generate", str(out), "-p", "hello", "--max-new-tokens", "3", "--ignore-eos", "--json", "--threads", "1"])
    d = json.loads(r.stdout.strip().splitlines()[-1])
    assert d["weights"] == fmt and d["dtype"] == "bfloat16" and len(d["tokens"][0]) == 3


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
