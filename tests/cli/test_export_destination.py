"""`wide export --out` and `wide prune --out` never destroy what wide did not write: an existing
export is replaced atomically; the run directory, anything else that exists at the destination
and the model source are refused in one line (exit 2) before any work is done."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest

from tests.cli._invoke import ok as _ok
from tests.cli.conftest import COMMON
from wide_cli.cli.app import main


def _snapshot(path) -> dict:
    """``{relative path: sha256 or link target}`` of everything under (or at) ``path``."""
    out = {}
    if path.is_symlink():
        return {".": "-> " + str(path.readlink())}
    if path.is_file():
        return {".": hashlib.sha256(path.read_bytes()).hexdigest()}
    for p in sorted(path.rglob("*")):
        rel = str(p.relative_to(path))
        if p.is_symlink():
            out[rel] = "-> " + str(p.readlink())
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[rel] = "dir"
    return out


def _refused(capsys, argv, *phrases):
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith("error: "), err
    for ph in phrases:
        assert ph in err[0], err[0]
    return err[0]


def test_export_refuses_to_replace_the_run_directory(trained_run, capsys):
    before = _snapshot(trained_run)
    _refused(capsys, ["export", "--run-dir", str(trained_run), "--out", str(trained_run)],
             f"--out {trained_run} is the run directory")
    assert _snapshot(trained_run) == before


def test_export_refuses_a_folder_inside_the_run_directory(trained_run, capsys):
    before = _snapshot(trained_run)
    _refused(capsys, ["export", "--run-dir", str(trained_run), "--out", str(trained_run / "stage1")],
             f"--out {trained_run / 'stage1'} is inside the run directory {trained_run}")
    _refused(capsys, ["export", "--run-dir", str(trained_run), "--out", str(trained_run / "new")],
             f"--out {trained_run / 'new'} is inside the run directory {trained_run}")
    assert _snapshot(trained_run) == before


def test_export_refuses_a_folder_that_holds_the_run_directory(trained_run, tmp_path, capsys):
    before = _snapshot(trained_run)
    _refused(capsys, ["export", "--run-dir", str(trained_run), "--out", str(trained_run.parent)],
             f"--out {trained_run.parent} holds the run directory {trained_run}")
    assert _snapshot(trained_run) == before


def _folder_of_files(tmp_path):
    d = tmp_path / "mine"
    (d / "sub").mkdir(parents=True)
    (d / "notes.txt").write_text("my notes")
    (d / "sub" / "data.bin").write_bytes(b"\x00\x01")
    return d


def _regular_file(tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(b"weights")
    return f


def _symlink_to_folder(tmp_path):
    target = _folder_of_files(tmp_path)
    link = tmp_path / "link"
    link.symlink_to(target, target_is_directory=True)
    return link


def _dangling_symlink(tmp_path):
    link = tmp_path / "dangling"
    link.symlink_to(tmp_path / "nowhere")
    return link


@pytest.mark.parametrize("make,phrase", [
    (_folder_of_files, "is not a wide export"),
    (_regular_file, "is a file"),
    (_symlink_to_folder, "is a symbolic link"),
    (_dangling_symlink, "is a symbolic link"),
])
def test_export_refuses_a_destination_wide_did_not_write(trained_run, tmp_path, capsys, make, phrase):
    dest = make(tmp_path)
    before = _snapshot(tmp_path)
    _refused(capsys, ["export", "--run-dir", str(trained_run), "--out", str(dest)], f"--out {dest}", phrase)
    assert _snapshot(tmp_path) == before


def test_export_replaces_an_existing_export_and_fills_an_empty_folder(trained_run, tmp_path):
    out = tmp_path / "exp"
    _ok(["export", "--run-dir", str(trained_run), "--out", str(out)])
    first = json.loads((out / "wide_config.json").read_text())["export_id"]
    _ok(["export", "--run-dir", str(trained_run), "--out", str(out)])
    assert json.loads((out / "wide_config.json").read_text())["export_id"] != first
    empty = tmp_path / "empty"
    empty.mkdir()
    _ok(["export", "--run-dir", str(trained_run), "--out", str(empty)])
    assert (empty / "manifest.json").is_file()


def test_export_refuses_an_export_holding_a_file_wide_did_not_write(trained_run, tmp_path, capsys):
    out = tmp_path / "exp"
    _ok(["export", "--run-dir", str(trained_run), "--out", str(out)])
    (out / "my-eval.md").write_text("results I wrote")
    before = _snapshot(out)
    _refused(capsys, ["export", "--run-dir", str(trained_run), "--out", str(out)],
             f"--out {out}", "my-eval.md", "not in its manifest")
    assert _snapshot(out) == before


def test_prune_refuses_its_model_source_as_out_before_calibrating(trained_run, tmp_path, capsys):
    """An export is a loadable model source; pruning it into itself would replace the source (and a
    later re-export from the run would merge its changes twice)."""
    src = tmp_path / "src"
    shutil.copytree(trained_run.parent / "exp", src)
    before = _snapshot(src)
    run = tmp_path / "run2"
    _refused(capsys, ["prune", str(src), "--out", str(src), "--run-dir", str(run), *COMMON, "--steps", "1"],
             f"--out {src} is the model source")
    assert _snapshot(src) == before
    assert not run.exists()  # refused before calibrating


def test_prune_refuses_a_folder_of_files_as_out_before_calibrating(tmp_path, text_file, capsys):
    dest = _folder_of_files(tmp_path)
    before = _snapshot(dest)
    run = tmp_path / "run"
    _refused(capsys, ["prune", "tiny-llama", "--data", str(text_file), "--out", str(dest), "--run-dir", str(run),
                      *COMMON, "--steps", "1"], f"--out {dest}", "is not a wide export")
    assert _snapshot(dest) == before and not run.exists()


def test_prune_refuses_its_run_directory_as_out_before_creating_it(tmp_path, text_file, capsys):
    run = tmp_path / "run"
    _refused(capsys, ["prune", "tiny-llama", "--data", str(text_file), "--out", str(run), "--run-dir", str(run),
                      *COMMON, "--steps", "1"], f"--out {run} is the run directory")
    assert not run.exists()
