"""Two-process CPU data parallelism (torchrun, gloo) equals one process with twice the batch."""

import json
import os
import subprocess
import sys

import torch
from safetensors.torch import load_file

ARGS = ["prune", "tiny-llama", "--steps", "3", "--seq-len", "32", "--attn-group-size", "2",
        "--ffn-group-size", "32", "--eval-max-tokens", "1024", "--checkpoint-every", "0", "--json"]


def _run(cmd, env):
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def test_two_processes_match_one_process_with_double_batch(tmp_path, text_file):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = tmp_path / "one"
    r1 = _run([sys.executable, "-m", "wide_cli", *ARGS, "--data", str(text_file), "--batch-size", "4",
               "--run-dir", str(one)], env)
    two = tmp_path / "two"
    r2 = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "-m", "wide_cli", *ARGS, "--data", str(text_file), "--batch-size", "2", "--run-dir", str(two)], env)
    a = load_file(str(one / "stage1" / "routers.safetensors"))
    b = load_file(str(two / "stage1" / "routers.safetensors"))
    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=0)
    # one export, written by rank 0; one JSON summary
    assert (two / "export" / "manifest.json").is_file()
    assert len([ln for ln in r2.stdout.splitlines() if ln.startswith("{")]) == 1
    res = json.loads(next(ln for ln in r2.stdout.splitlines() if ln.startswith("{")))
    assert res["train"]["tokens"] == 3 * 4 * 32
    assert json.loads(r1.stdout.strip().splitlines()[-1])["train"]["tokens"] == 3 * 4 * 32
