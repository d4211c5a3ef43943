"""An export is meant to be shared: no file in it names a path of the machine that built it
(the model cache, the data file, the run directory, the home directory). The model is recorded
by id, package and version, and hashes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.cli._invoke import ok as _ok

TINY = ["--steps", "2", "--seq-len", "32", "--batch-size", "2", "--attn-group-size", "2", "--ffn-group-size", "32",
        "--eval-max-tokens", "512"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("share")
    data = root / "my-private-notes.txt"
    import pydoc_data.topics as t

    data.write_text("\n\n".join(v[:2000] for _, v in sorted(t.topics.items())[:3]))
    run = root / "run"
    _ok(["prune", "tiny-llama", "--data", str(data), "--run-dir", str(run), *TINY])
    _ok(["export", "--run-dir", str(run), "--out", str(root / "hf"), "--format", "hf"])
    return root, run


def _local_paths():
    return [p for p in {os.environ["WIDE_CACHE"], str(Path.home())} if p and p != "/"]


@pytest.mark.parametrize("sub", ["run/export", "hf"])
def test_export_files_name_no_local_path(built, sub):
    root, _ = built
    out = root / sub
    needles = [str(root), *_local_paths()]
    for f in sorted(out.rglob("*")):
        if f.suffix not in (".json", ".md", ".py", ".txt") or not f.is_file():
            continue
        text = f.read_text()
        for n in needles:
            assert n not in text, f"{f.name} names the local path {n}"


def test_export_records_the_model_by_id_and_hash(built):
    _, run = built
    src = json.loads((run / "export" / "wide_config.json").read_text())["source_model"]
    assert src["spec"] == "tiny-llama"
    assert src["id"] == "tiny-llama" and len(src["fingerprint"]) == 16
    card = (run / "export" / "README.md").read_text()
    assert "cached at" not in card and "tiny-llama" in card
    settings = json.loads((run / "export" / "wide_config.json").read_text())["settings"]
    assert settings["data"]["train"] == "my-private-notes.txt"
