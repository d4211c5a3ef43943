"""Writes that fail part-way through an export (disk full, file-size limit): one clear error
line naming the export, and a previous export at the same path stays exactly as it was."""

from __future__ import annotations

import errno
import os
import resource

import pytest

from wide_cli.cli.app import main


def _snapshot(d):
    return {p.relative_to(d): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _load(out, fmt):
    if fmt == "hf":
        from wide_cli.export.hf_format import load_hf_export

        return load_hf_export(out)
    from wide_cli.export import load_pruned

    return load_pruned(out)


@pytest.mark.parametrize("fmt", ["wide", "hf"])
def test_disk_full_while_writing_export(tmp_path, wide, trained_run, monkeypatch, capsys, fault, fmt):
    run = wide.copy_run(trained_run, tmp_path / "run")
    out = tmp_path / "exports" / "out"
    assert main(["export", "--run-dir", str(run), "--out", str(out), "--format", fmt]) == 0
    before = _snapshot(out)
    capsys.readouterr()

    def disk_full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    # the router file (wide) / the weights (hf): after other files of the new export were written
    target = "wide_cli.export.writer.save_file" if fmt == "wide" else "safetensors.torch.save_file"
    monkeypatch.setattr(target, disk_full)
    code = main(["export", "--run-dir", str(run), "--out", str(out), "--format", fmt])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    errors = [line for line in err if line.startswith("error: ")]
    intact = _snapshot(out) == before and sorted(p.name for p in out.parent.iterdir()) == ["out"]
    shown = (errors[-1] if errors else str(err[-1:])).replace(str(out), "<export>")
    fault(f"disk full while writing an export ({fmt})", f"exit {code}: {shown}", intact)
    assert code == 2 and len(errors) == 1 and errors[0] == err[-1]
    assert "No space left on device" in errors[0] and str(out) in errors[0]
    assert intact
    _load(out, fmt)


def test_file_size_limit_while_writing_export(tmp_path, wide, trained_run, fault):
    """A real failing write (RLIMIT_FSIZE: the kernel refuses bytes past 64 KiB with EFBIG) in a
    real `wide export`: the weights file (~400 KiB) cannot be written."""
    run = wide.copy_run(trained_run, tmp_path / "run")
    out = tmp_path / "exports" / "out"
    rc, p = wide.run(["export", "--run-dir", str(run), "--out", str(out)])
    assert rc == 0, p.tail()
    before = _snapshot(out)
    p = wide.Process(["export", "--run-dir", str(run), "--out", str(out)])
    # set on the running child (seconds before its first write; Python ignores SIGXFSZ, so the
    # write fails with EFBIG instead of killing it)
    resource.prlimit(p.proc.pid, resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
    rc = p.finish()
    errors = p.errors()
    intact = _snapshot(out) == before and sorted(q.name for q in out.parent.iterdir()) == ["out"]
    shown = (errors[-1] if errors else p.tail(2)).replace(str(out), "<export>")
    fault("file-size limit (EFBIG) in a real export", f"exit {rc}: {shown}", intact)
    assert rc == 2 and len(errors) == 1 and p.lines[-1] == errors[0], p.tail()
    assert "File too large" in errors[0] and str(out) in errors[0]
    assert intact
    _load(out, "wide")
