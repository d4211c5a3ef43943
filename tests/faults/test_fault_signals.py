"""Signals to a real ``wide`` process: SIGINT and SIGKILL during training, SIGKILL during export.

Expected: Ctrl-C exits 130 after a clean checkpoint; ``--resume`` finishes with routers
bit-identical to an uninterrupted run; a killed export never leaves a directory that looks
complete, and a previous export survives it.
"""

from __future__ import annotations

import json
import os
import signal
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from wide_cli.errors import CheckpointError
from wide_cli.export import load_pruned


def _checkpoint_step(run) -> int:
    ck = run / "stage1" / "checkpoint"
    meta = json.loads((ck / "state.json").read_text())
    load_file(str(ck / "trainable.safetensors"))  # readable, complete
    torch.load(ck / "optimizer.pt", weights_only=False)
    return int(meta["step"])


def _visible_dirs(d):
    return sorted(p.name for p in d.iterdir() if not p.name.startswith("."))


def test_sigint_during_training(tmp_path, wide, calibrated_run, reference_routers, fault):
    run = wide.copy_run(calibrated_run, tmp_path / "run")
    args = ["train", "--run-dir", str(run), "--steps", str(wide.STEPS), "--checkpoint-every", str(wide.CKPT_EVERY)]
    p = wide.Process(args)
    p.wait_line(f"train step 40/{wide.STEPS}")
    p.proc.send_signal(signal.SIGINT)
    rc = p.finish()
    assert rc == 130, p.tail()
    assert p.errors() and p.lines[-1].startswith("error: "), p.tail()  # one line, last
    step = _checkpoint_step(run)
    assert 40 <= step < wide.STEPS  # the last completed step, not only the last periodic checkpoint
    assert not (run / "stage1" / "routers.safetensors").exists()  # nothing that looks finished
    assert not (run / ".lock").exists()  # the lock is released on the way out
    rc2, p2 = wide.run([*args, "--resume"])
    assert rc2 == 0, p2.tail()
    res = json.loads((run / "stage1" / "result.json").read_text())
    assert res["resumed_from"] == step and res["steps"] == wide.STEPS
    same = wide.same_tensors(load_file(str(run / "stage1" / "routers.safetensors")), reference_routers)
    fault("SIGINT during training", f"exit 130, checkpoint at step {step}, --resume bit-identical: {same}", same)
    assert same


def test_sigint_inside_optimizer_update(tmp_path, monkeypatch, fault):
    """A Ctrl-C that lands between the parameter update and the step bookkeeping must not
    checkpoint updated weights under the previous step number (resume would redo the step)."""
    from wide_cli.models.tiny import tiny_model
    from wide_cli.routing import RoutingConfig, attach_routers
    from wide_cli.routing.model import router_state_dict
    from wide_cli.train.config import TrainConfig
    from wide_cli.train.loop import train_stage

    data = torch.randint(0, 128, (24, 16), generator=torch.Generator().manual_seed(0))
    cfg = TrainConfig(steps=10, batch_size=2, seq_len=16, checkpoint_every=4, lr=1e-2)

    def train(stage_dir, resume=False):
        m = tiny_model("llama")
        for prm in m.parameters():
            prm.requires_grad_(False)
        torch.manual_seed(0)
        attach_routers(m, RoutingConfig(attn_group_size=2, ffn_group_size=32))
        res = train_stage(m, data, cfg, stage_dir=stage_dir, identity={}, resume=resume, progress=False)
        return router_state_dict(m), res

    full, _ = train(tmp_path / "full")
    real_step = torch.optim.AdamW.step
    calls = {"n": 0}

    def step_then_sigint(self, *a, **k):  # SIGINT arrives right after the weights changed
        out = real_step(self, *a, **k)
        calls["n"] += 1
        if calls["n"] == 6:
            os.kill(os.getpid(), signal.SIGINT)
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", step_then_sigint)
    with pytest.raises(KeyboardInterrupt):
        train(tmp_path / "cut")
    monkeypatch.setattr(torch.optim.AdamW, "step", real_step)
    got, res = train(tmp_path / "cut", resume=True)
    same = all(torch.equal(full[k], got[k]) for k in full)
    fault("SIGINT inside the optimizer update", f"resumed from step {res.resumed_from}, bit-identical: {same}", same)
    assert res.resumed_from == 6 and same


def test_sigkill_during_training(tmp_path, wide, calibrated_run, reference_routers, fault):
    run = wide.copy_run(calibrated_run, tmp_path / "run")
    args = ["train", "--run-dir", str(run), "--steps", str(wide.STEPS), "--checkpoint-every", str(wide.CKPT_EVERY)]
    p = wide.Process(args)
    p.wait_line(f"train step 100/{wide.STEPS}")
    p.proc.kill()
    assert p.finish() == -signal.SIGKILL
    step = _checkpoint_step(run)  # the last periodic checkpoint is whole
    assert step % wide.CKPT_EVERY == 0 and 100 - wide.CKPT_EVERY <= step < wide.STEPS  # bar prints, then saves
    assert _visible_dirs(run / "stage1") == ["checkpoint"]  # temp dirs are hidden; no routers file
    assert not (run / "stage1" / "routers.safetensors").exists()
    assert (run / ".lock").exists()  # left by the dead process; the next run takes it over
    rc, p2 = wide.run([*args, "--resume"])
    assert rc == 0, p2.tail()
    same = wide.same_tensors(load_file(str(run / "stage1" / "routers.safetensors")), reference_routers)
    fault("SIGKILL during training", f"checkpoint at step {step} whole, stale lock taken over, --resume "
          f"bit-identical: {same}", same)
    assert same


# A child that runs `wide export` and stops for good just before the manifest is written (the
# last file of an export), so that SIGKILL lands on an export with every other file in place.
_HOLD_BEFORE_MANIFEST = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import wide_cli.export.writer as w
    marker = Path(sys.argv[1])
    def hold(root, **kw):
        marker.write_text(str(root))
        time.sleep(600)
    w.write_manifest = hold
    sys.argv = ["wide"] + sys.argv[2:]
    from wide_cli.cli.app import run
    run()
""")


def _killed_export(wide, run, out, fmt, marker):
    p = wide.Process([str(marker), "export", "--run-dir", str(run), "--out", str(out), "--format", fmt],
                     code=_HOLD_BEFORE_MANIFEST)
    p.wait_for(marker.exists)
    partial = marker.read_text()
    p.proc.kill()
    assert p.finish() == -signal.SIGKILL
    return partial


@pytest.mark.parametrize("fmt", ["wide", "hf"])
def test_sigkill_during_export(tmp_path, wide, trained_run, fault, fmt):
    run = wide.copy_run(trained_run, tmp_path / "run")
    out = tmp_path / "exports" / f"out_{fmt}"
    partial = _killed_export(wide, run, out, fmt, tmp_path / "m1")
    assert os.path.basename(partial).startswith(f".{out.name}.partial-")  # the work was hidden
    assert not out.exists() and _visible_dirs(out.parent) == []
    with pytest.raises(CheckpointError, match="does not exist"):
        load_pruned(out)
    assert os.path.isdir(partial)  # SIGKILL leaves the hidden temp dir behind ...
    rc, p = wide.run(["export", "--run-dir", str(run), "--out", str(out), "--format", fmt])  # recovers
    assert rc == 0, p.tail()
    assert not os.path.exists(partial)  # ... and the next export removes it (its pid is gone)
    first = json.loads((out / "wide_config.json").read_text())["export_id"]
    outcome = "no export dir appears; re-export completes"
    intact = True
    if fmt == "wide":  # a second kill over a complete export leaves that export as it was
        _killed_export(wide, run, out, fmt, tmp_path / "m2")
        pm = load_pruned(out)
        intact = pm.wide_config["export_id"] == first and _visible_dirs(out.parent) == [out.name]
        outcome += "; killed re-export leaves the previous export valid"
    else:
        from wide_cli.export.hf_format import load_hf_export

        load_hf_export(out)
    fault(f"SIGKILL during export ({fmt})", outcome, intact)
    assert intact


def test_ctrl_c_in_any_command_exits_130(tmp_path, wide, trained_run, monkeypatch, capsys, fault):
    """The CLI's exit code for Ctrl-C is 130 with one error line, whatever the command."""
    from wide_cli.cli.app import main

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr("wide_cli.pipeline.stages.export", interrupted)
    code = main(["export", "--run-dir", str(wide.copy_run(trained_run, tmp_path / "run"))])
    err = capsys.readouterr().err.strip().splitlines()
    fault("Ctrl-C in a command (in process)", f"exit {code}, last line {err[-1] if err else ''!r}", True)
    assert code == 130 and err and err[-1] == "error: interrupted"
