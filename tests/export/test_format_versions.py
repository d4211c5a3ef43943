"""Exports and run directories written by a newer wide (a higher ``format_version``) are refused
by every reader in one line naming both versions and the fix; older ones are read as before."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest

from tests._exports import tiny_export
from wide_cli.artifacts import EXPORT_FORMAT_VERSION, RUN_FORMAT_VERSION
from wide_cli.cli.app import main
from wide_cli.errors import CheckpointError
from wide_cli.version import __version__


def _rewrite_wide_config(path, change) -> None:
    """Edit ``wide_config.json`` as another wide would have written it (its manifest entry
    updated, so that the export is consistent)."""
    p = path / "wide_config.json"
    wc = json.loads(p.read_text())
    change(wc)
    p.write_text(json.dumps(wc, indent=2))
    m = json.loads((path / "manifest.json").read_text())
    m["files"]["wide_config.json"] = {"sha256": hashlib.sha256(p.read_bytes()).hexdigest(), "size": p.stat().st_size}
    (path / "manifest.json").write_text(json.dumps(m, indent=2))


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("versions")
    tiny_export(root / "current")
    newer = root / "newer"
    shutil.copytree(root / "current", newer)
    _rewrite_wide_config(newer, lambda wc: wc.update(format_version=EXPORT_FORMAT_VERSION + 1, wide_version="9.0.0"))
    older = root / "older"
    shutil.copytree(root / "current", older)
    _rewrite_wide_config(older, lambda wc: wc.pop("format_version"))
    return {"current": root / "current", "newer": newer, "older": older}


def _newer_export_message(path) -> str:
    return (f"{path / 'wide_config.json'} has format_version {EXPORT_FORMAT_VERSION + 1} (wide 9.0.0), newer than the "
            f"{EXPORT_FORMAT_VERSION} this wide ({__version__}) reads (upgrade wide: pip install -U wide-prune)")


def test_load_pruned_refuses_an_export_of_a_newer_format(exports):
    from wide_cli.export.loader import load_pruned

    with pytest.raises(CheckpointError) as e:
        load_pruned(exports["newer"])
    assert str(e.value) == _newer_export_message(exports["newer"])


def test_runtime_and_serve_refuse_an_export_of_a_newer_format(exports):
    from wide_cli.runtime.checkpoint import weights_from_export
    from wide_cli.serve.config import serve_plan

    for read in (weights_from_export, serve_plan):
        with pytest.raises(CheckpointError) as e:
            read(exports["newer"])
        assert str(e.value) == _newer_export_message(exports["newer"]), read


@pytest.mark.parametrize("argv", [
    ["generate", "{export}", "-p", "hello", "--max-new-tokens", "2"],
    ["inspect", "{export}"],
    ["eval", "{export}", "--eval-data", "{text}"],
])
def test_commands_refuse_an_export_of_a_newer_format_in_one_line(exports, text_file, capsys, argv):
    code = main([a.format(export=exports["newer"], text=text_file) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert err == ["error: " + _newer_export_message(exports["newer"])]


def test_an_export_without_format_version_is_read_as_before(exports):
    from wide_cli.export.loader import load_pruned

    assert load_pruned(exports["older"]).wide_config.get("format_version") is None
    assert load_pruned(exports["current"]).wide_config["format_version"] == EXPORT_FORMAT_VERSION


def _run_json(run, **fields) -> None:
    run.mkdir()
    doc = {"wide_version": __version__, "model": {"spec": "tiny-llama", "resolved_dir": None, "revision": None},
           "settings": {"model": {"name": "tiny-llama"}}, **fields}
    (run / "run.json").write_text(json.dumps(doc))


def test_a_run_directory_of_a_newer_format_is_refused_in_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    _run_json(run, format_version=RUN_FORMAT_VERSION + 1, wide_version="9.0.0")
    code = main(["export", "--run-dir", str(run), "--out", str(tmp_path / "exp")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert err == [(f"error: {run / 'run.json'} has format_version {RUN_FORMAT_VERSION + 1} (wide 9.0.0), newer "
                    f"than the {RUN_FORMAT_VERSION} this wide ({__version__}) reads (upgrade wide: pip install -U "
                    "wide-prune)")]
    assert not (tmp_path / "exp").exists()


def test_an_unknown_key_in_a_newer_wides_run_directory_says_so(tmp_path, capsys):
    run = tmp_path / "run"
    _run_json(run, wide_version="9.0.0")
    doc = json.loads((run / "run.json").read_text())
    doc["settings"]["train"] = {"new_knob": 1}
    (run / "run.json").write_text(json.dumps(doc))
    code = main(["export", "--run-dir", str(run), "--out", str(tmp_path / "exp")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith(f"error: {run / 'run.json'}: unknown key train.new_knob"), err
    assert f"written by wide 9.0.0, this is wide {__version__}: upgrade wide" in err[0], err


def test_run_json_records_its_format_version(tmp_path, text_file):
    from tests.cli._invoke import ok

    run = tmp_path / "run"
    ok(["calibrate", "tiny-llama", "--data", str(text_file), "--run-dir", str(run), "--seq-len", "32",
        "--batch-size", "2", "--attn-group-size", "2", "--ffn-group-size", "32"])
    doc = json.loads((run / "run.json").read_text())
    assert (doc["format_version"], doc["wide_version"]) == (RUN_FORMAT_VERSION, __version__)
