"""`wide train` under torchrun (2 CPU processes, gloo): stage 1 equals one process with twice
the batch, stage 2 runs, and `--resume` with another number of processes is refused naming both
(the global batch and the data each step sees would change)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.cli._invoke import ok as _ok
from wide_cli.cli.app import main

H4 = ["--attn-group-size", "2", "--ffn-group-size", "32", "--seq-len", "64", "--batch-size", "2"]


def _torchrun(*args):
    # the environment as of the call: the session fixture has set WIDE_CACHE by then, so the ranks
    # build tiny-llama in the test's cache, not the user's
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           "-m", "wide_cli", *args], check=False, capture_output=True, text=True, env=env, timeout=600)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A calibrated run trained by 2 processes (batch 2 each) and a copy trained by one (batch 4)."""
    import pydoc_data.topics as t

    root = tmp_path_factory.mktemp("ddp")
    data = root / "train.txt"
    data.write_text("\n\n".join(v[:2000] for _, v in sorted(t.topics.items())[:3]))
    two, one = root / "two", root / "one"
    _ok(["calibrate", "tiny-llama", "--data", str(data), "--run-dir", str(two), *H4])
    shutil.copytree(two, one)
    r = _torchrun("train", "--run-dir", str(two), "--steps", "4", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    _ok(["train", "--run-dir", str(one), "--steps", "4", "--batch-size", "4"])
    return two, one, r


def test_train_under_torchrun_equals_one_process_with_double_batch(runs):
    two, one, r = runs
    a = load_file(str(two / "stage1" / "routers.safetensors"))
    b = load_file(str(one / "stage1" / "routers.safetensors"))
    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=0)
    assert len([ln for ln in r.stdout.splitlines() if ln.startswith("{")]) == 1  # rank 0 alone reports


def test_stage_2_trains_under_torchrun(runs):
    two, _, _ = runs
    r = _torchrun("train", "--run-dir", str(two), "--stage", "2", "--lora-steps", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert (two / "stage2" / "adapter.safetensors").is_file()


def test_resume_on_another_number_of_processes_is_refused_naming_both(runs, capsys):
    two, one, _ = runs
    # written by 2 processes, resumed by 1
    code = main(["train", "--run-dir", str(two), "--steps", "4", "--resume"])
    err = capsys.readouterr().err
    errors = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and err.strip().splitlines()[-1] == errors[0], err
    assert "written by 2 processes, this run has 1 process" in errors[0], err
    # written by 1 process, resumed by 2
    r = _torchrun("train", "--run-dir", str(one), "--steps", "4", "--batch-size", "4", "--resume")
    assert r.returncode != 0
    assert "written by 1 process, this run has 2 processes" in r.stderr, r.stderr[-3000:]
