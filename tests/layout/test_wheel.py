"""The wheel ships the top-level ``kernels/`` and ``recipes/``, and the installed package finds them.

Builds a wheel from a copy of the source files (so the checkout gets no ``build/`` folder),
checks its file list, then imports the package from the unpacked wheel (not the checkout) and
runs ``wide recipes`` and the kernel-source loader there. A fresh-venv ``pip install .`` is the
same thing plus dependency resolution; it is too slow for the suite.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD_FILES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md")
BUILD_DIRS = ("wide_cli", "kernels", "recipes")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    pytest.importorskip("setuptools")
    src = tmp_path_factory.mktemp("src")
    for name in BUILD_FILES:
        shutil.copy2(ROOT / name, src / name)
    for name in BUILD_DIRS:
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "_data"))
    out = tmp_path_factory.mktemp("dist")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        str(out),
        str(src),
    ]
    res = subprocess.run(cmd, check=False, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    (whl,) = out.glob("wide_prune-*.whl")
    return whl


def test_wheel_ships_kernels_and_recipes(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    kernels = {Path(n).name for n in names if n.startswith("wide_cli/_data/kernels/")}
    recipes = {Path(n).name for n in names if n.startswith("wide_cli/_data/recipes/")}
    on_disk_kernels = {p.name for p in (ROOT / "kernels").iterdir() if p.suffix in (".cu", ".cuh", ".c")}
    assert kernels == on_disk_kernels and {"common.cuh", "cpu_decode.c"} <= kernels
    assert recipes == {p.name for p in (ROOT / "recipes").glob("*.toml")} and recipes
    assert "wide_cli/runtime/cuda/sources.py" in names and "wide_cli/resources.py" in names
    assert not any(n.startswith(("tests/", "kernels/", "recipes/")) for n in names)  # only under the package


def test_installed_package_reads_its_own_copies(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = f"""
import sys
sys.path.insert(0, {str(site)!r})
import wide_cli
from wide_cli.pipeline.recipes import RECIPES_DIR, recipe_path
from wide_cli.runtime.cuda import sources
assert wide_cli.__file__.startswith({str(site)!r}), wide_cli.__file__
print(RECIPES_DIR)
print(sources.kernel_dir())
print(recipe_path("smollm2-135m-cpu"))
print(len(sources.load_source("gemm_mn.cu")) > len((sources.kernel_dir() / "gemm_mn.cu").read_text()))
sys.argv = ["wide", "recipes", "--json"]
from wide_cli.cli.app import run
run()
"""
    res = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    data = site / "wide_cli" / "_data"
    assert lines[:4] == [str(data / "recipes"), str(data / "kernels"), str(data / "recipes" / "smollm2-135m-cpu.toml"),
                         "True"]  # fmt: skip
    listed = json.loads("\n".join(lines[4:]))["recipes"]  # `wide recipes --json`
    assert sorted(r["name"] for r in listed) == sorted(p.stem for p in (ROOT / "recipes").glob("*.toml"))
    assert all(Path(r["path"]).parent == data / "recipes" for r in listed)
