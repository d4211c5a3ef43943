"""`--threads` on the CPU-heavy commands, and a default that counts only the free cores (OpenMP
threads spinning against other processes' cores slowed a shared machine about tenfold)."""

from __future__ import annotations

import inspect

import pytest
import torch

from wide_cli.cli import threads as th
from wide_cli.cli.app import main
from wide_cli.cli.commands import eval as eval_mod
from wide_cli.cli.commands import generate, prune, stages


@pytest.fixture
def machine(monkeypatch):
    """A fake machine: ``set(cpus, load)``; no OMP_NUM_THREADS, not under torchrun."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    torch_threads = torch.get_num_threads()

    def set_(cpus, load):
        monkeypatch.setattr(th, "_cpus", lambda: cpus)
        monkeypatch.setattr(th.os, "getloadavg", lambda: (load, load, load))

    yield set_
    torch.set_num_threads(torch_threads)


@pytest.mark.parametrize(("cpus", "load", "expected"), [(2, 0.2, 2), (2, 3.4, 1), (16, 5.9, 11), (8, 0.0, 8)])
def test_default_threads_are_the_free_cores(machine, cpus, load, expected):
    machine(cpus, load)
    assert th.resolve_threads(None) == expected


def test_default_threads_split_among_torchrun_processes(machine, monkeypatch):
    machine(8, 0.0)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert th.resolve_threads(None) == 4


def test_explicit_threads_and_omp_num_threads_win(machine, monkeypatch):
    machine(2, 9.0)
    assert th.resolve_threads(3) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert th.resolve_threads(None) == 2


def test_apply_threads_sizes_torch_and_the_environment_of_child_processes(machine):
    machine(4, 1.2)
    assert th.apply_threads(None) == 3
    assert torch.get_num_threads() == 3
    import os

    assert os.environ["OMP_NUM_THREADS"] == "3" and os.environ["MKL_NUM_THREADS"] == "3"


@pytest.mark.parametrize("cmd", [prune.prune_cmd, stages.calibrate_cmd, stages.train_cmd, stages.export_cmd,
                                 eval_mod.eval_cmd, generate.generate_cmd])
def test_cpu_heavy_commands_take_threads(cmd):
    assert "threads" in inspect.signature(cmd).parameters


def test_threads_below_one_is_a_one_line_error(tiny_export_dir, capsys):
    assert main(["generate", str(tiny_export_dir), "-p", "x", "--threads", "0"]) == 2
    assert capsys.readouterr().err.startswith("error: --threads 0 must be >= 1")


def test_nproc_relaunch_gives_each_process_its_share_of_threads(machine, monkeypatch):
    machine(8, 0.0)
    seen = {}
    monkeypatch.setattr("subprocess.call", lambda cmd, env=None: seen.update(cmd=cmd, env=env) or 0)
    argv = ["prune", "tiny-llama", "--nproc", "2", "--threads", "6", "--attn-group-size", "2"]
    monkeypatch.setattr("sys.argv", ["wide", *argv])
    assert main(argv) == 0
    assert seen["env"]["OMP_NUM_THREADS"] == "3" and "--threads" not in seen["cmd"]


@pytest.fixture
def tiny_export_dir(tmp_path):
    from tests._exports import tiny_export

    tiny_export(tmp_path / "exp")
    return tmp_path / "exp"
