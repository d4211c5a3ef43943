"""Where the files shipped next to the package are: kernel sources (``kernels/``: CUDA, and the C
decode step of the cpu backend) and recipes
(``recipes/``).

In the repository they are top-level folders beside ``wide_cli/`` (DESIGN.md §5). A wheel
carries them inside the package as ``wide_cli/_data/<name>/`` (``setup.py`` copies them there at
build time), because a wheel can only install files under its packages. The wheel's copy wins;
a checkout or an editable install reads the repository's folders.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent
SHIPPED = ("kernels", "recipes")


def shipped_dir(name: str) -> Path:
    """The folder of shipped files ``name`` (``"kernels"`` or ``"recipes"``).

    Returns the installed copy ``wide_cli/_data/<name>`` when it exists, else ``<repo>/<name>``
    (which may not exist, e.g. a bare copy of the package; callers report that).

    Raises:
        ValueError: ``name`` is not one of ``SHIPPED``.
    """
    if name not in SHIPPED:
        raise ValueError(f"no shipped folder {name!r}; known: {list(SHIPPED)}")
    installed = _PACKAGE / "_data" / name
    return installed if installed.is_dir() else _PACKAGE.parent / name
