"""Build hook: ship the top-level ``kernels/`` and ``recipes/`` inside the wheel.

A wheel installs files only under its packages, and DESIGN.md §5 keeps these folders beside
``wide_cli/``. So ``build_py`` copies them to ``wide_cli/_data/<folder>/`` in the build tree,
where ``wide_cli.resources.shipped_dir`` finds them after a regular install. An editable install
skips the copy and reads the checkout's folders. Everything else is in ``pyproject.toml``.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
SHIPPED = {"kernels": ("*.cu", "*.cuh", "*.c"), "recipes": ("*.toml",)}


class BuildPyWithShippedFiles(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        for folder, patterns in SHIPPED.items():
            files = sorted(p for pattern in patterns for p in (ROOT / folder).glob(pattern))
            if not files:
                raise SystemExit(f"error: no {patterns} files in {ROOT / folder}; the wheel would ship none")
            dest = Path(self.build_lib) / "wide_cli" / "_data" / folder
            self.mkpath(str(dest))
            for src in files:
                self.copy_file(str(src), str(dest / src.name))


setup(cmdclass={"build_py": BuildPyWithShippedFiles})
