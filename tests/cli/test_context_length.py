"""Every stage applies the same context-length rule as `wide eval`: a sequence longer than the
model's positions (tiny-llama: 512) is one line `error: ...` naming both numbers, exit 2, before
any work is written."""

from __future__ import annotations

import json

import pytest

from tests.cli._invoke import ok as _ok
from wide_cli.cli.app import main

GROUPS = ["--attn-group-size", "2", "--ffn-group-size", "32", "--batch-size", "2"]


def _refused(capsys, args, *numbers):
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert "context length 512" in err and all(str(n) in err for n in numbers), err


def test_calibrate_refuses_seq_len_beyond_the_context(tmp_path, text_file, capsys):
    run = tmp_path / "r"
    _refused(capsys, ["calibrate", "tiny-llama", "--data", str(text_file), "--run-dir", str(run),
                      "--seq-len", "1024", *GROUPS], 1024)
    assert not (run / "run.json").exists()


@pytest.mark.parametrize("flag", ["--seq-len", "--eval-seq-len"])
def test_prune_refuses_seq_len_beyond_the_context(tmp_path, text_file, capsys, flag):
    run = tmp_path / "r"
    _refused(capsys, ["prune", "tiny-llama", "--data", str(text_file), "--run-dir", str(run), "--steps", "2",
                      *GROUPS, flag, "1024"], 1024)
    assert not (run / "stage1").exists()


def test_train_refuses_a_run_whose_seq_len_exceeds_the_context(tmp_path, text_file, capsys):
    run = tmp_path / "r"
    _ok(["calibrate", "tiny-llama", "--data", str(text_file), "--run-dir", str(run), "--seq-len", "32", *GROUPS])
    doc = json.loads((run / "run.json").read_text())
    doc["settings"]["train"]["seq_len"] = 1024  # e.g. a run calibrated by an older wide
    (run / "run.json").write_text(json.dumps(doc))
    _refused(capsys, ["train", "--run-dir", str(run), "--steps", "2"], 1024)
    assert not (run / "stage1" / "routers.safetensors").exists()
