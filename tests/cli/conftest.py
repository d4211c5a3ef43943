"""Fixtures of the CLI tests."""

from __future__ import annotations

import pytest

from tests.cli._invoke import ok

COMMON = ["--seq-len", "32", "--batch-size", "2", "--attn-group-size", "2", "--ffn-group-size", "32"]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A run directory with stage-1 routers (tiny-llama, one step), and its export beside it
    (``run.parent / "exp"``); one per test module."""
    import pydoc_data.topics as t

    root = tmp_path_factory.mktemp("run")
    text = root / "train.txt"
    text.write_text("\n\n".join(v[:2000] for _, v in sorted(t.topics.items())[:3]))
    run = root / "run"
    ok(["calibrate", "tiny-llama", "--data", str(text), "--run-dir", str(run), *COMMON])
    ok(["train", "--run-dir", str(run), "--steps", "1"])
    ok(["export", "--run-dir", str(run), "--out", str(root / "exp")])
    return run
