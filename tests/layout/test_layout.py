"""Guard rails on the package's shape: no import cycles, no oversized modules.

Both read the source with ``ast``/line counts (nothing is imported), so they are fast and run
everywhere. Each has an allow-list of today's known exceptions that may only shrink: an entry
that no longer applies fails the test, so fixing a cycle or splitting a module also removes it
from here, and a new cycle or a new oversized module fails until it is fixed.
"""

from __future__ import annotations

import re

from tests.layout._import_graph import PACKAGE_ROOT, cycles, import_graph, module_files

MAX_LINES = 600

# Cycles through imports inside functions (held together by deferring the import to call time).
# None are left; an entry here would name a known one while it is being removed.
ALLOWED_CALL_TIME_CYCLES: tuple[frozenset[str], ...] = ()

# Modules over MAX_LINES while another change is splitting them. None are left; an entry here would
# name one until it is split.
ALLOWED_LONG_MODULES: frozenset[str] = frozenset()


def _fmt(comps) -> str:
    return "; ".join(" <-> ".join(sorted(c)) for c in comps)


def test_no_import_cycle_at_import_time():
    found = cycles(import_graph(module_level=True))
    assert not found, f"import cycles between modules: {_fmt(found)} (move the shared code to a leaf module)"


def test_call_time_import_cycles_only_shrink():
    found = cycles(import_graph(module_level=False))
    new = [c for c in found if not any(c <= allowed for allowed in ALLOWED_CALL_TIME_CYCLES)]
    assert not new, f"new import cycle (through function-local imports): {_fmt(new)}"
    stale = [a for a in ALLOWED_CALL_TIME_CYCLES if a not in found]
    assert not stale, (
        f"allow-listed cycles are gone or smaller: {_fmt(stale)}; now found: {_fmt(found) or 'none'}. "
        "Shrink ALLOWED_CALL_TIME_CYCLES to what is found."
    )


def _line_counts() -> dict[str, int]:
    root = PACKAGE_ROOT.parent
    return {
        path.relative_to(root).as_posix(): len(path.read_text().splitlines())
        for path in module_files().values()
    }


def test_no_module_over_the_line_limit():
    counts = _line_counts()
    long = {p: n for p, n in counts.items() if n > MAX_LINES and p not in ALLOWED_LONG_MODULES}
    assert not long, f"modules over {MAX_LINES} lines (split them by concern): {long}"
    stale = sorted(p for p in ALLOWED_LONG_MODULES if counts.get(p, 0) <= MAX_LINES)
    assert not stale, (
        f"{stale} are now at most {MAX_LINES} lines (or gone): remove them from ALLOWED_LONG_MODULES"
    )


def test_graph_reader_sees_real_edges():
    """The checks above are only as good as the graph: spot-check edges that exist today."""
    eager, lazy = import_graph(module_level=True), import_graph(module_level=False)
    assert "wide_cli.runtime.ops" in eager["wide_cli.runtime.cupy_ops"]  # from wide_cli.runtime import ops
    assert "wide_cli.inspection.report" in eager["wide_cli.inspection"]  # package __init__ re-export
    assert eager["wide_cli.errors"] <= lazy["wide_cli.errors"]
    assert sum(map(len, lazy.values())) > sum(map(len, eager.values()))  # function-local imports counted
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]


def test_readme_layout_matches_the_tree():
    """Every path in the README's layout block exists, and every subpackage of wide_cli is listed."""
    root = PACKAGE_ROOT.parent
    text = (root / "README.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    listed = [line.split()[0] for line in block.splitlines() if line.strip()]
    missing = [p for p in listed if not (root / p).exists()]
    assert not missing, f"README layout names paths that do not exist: {missing}"
    packages = {f"wide_cli/{p.name}/" for p in PACKAGE_ROOT.iterdir() if (p / "__init__.py").is_file()}
    unlisted = sorted(packages - set(listed))
    assert not unlisted, f"README layout does not list {unlisted}"


def test_relative_links_in_the_readme_and_docs_resolve():
    """Every relative Markdown link ``[text](path)`` in README.md and docs/ names a file or folder
    that exists (results pages move; their links must move with them)."""
    root = PACKAGE_ROOT.parent
    pages = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(root)} -> {target}")
    assert len(pages) > 5
    assert not broken, f"broken relative links: {broken}"


def test_layers_point_one_way():
    """``train/`` is a library (no run dirs, no pipeline); ``artifacts`` is a leaf every loader may
    import (at import time only ``errors`` and ``models.arch``); nothing below the CLI imports it."""
    lazy, eager = import_graph(module_level=False), import_graph(module_level=True)
    train_up = {(m, t) for m, ts in lazy.items() if m.startswith("wide_cli.train") for t in ts
                if t.startswith(("wide_cli.pipeline", "wide_cli.cli", "wide_cli.export"))}
    assert not train_up, f"train/ must not import the pipeline, export or CLI: {sorted(train_up)}"
    assert eager["wide_cli.artifacts"] <= {"wide_cli.errors", "wide_cli.models.arch"}, eager["wide_cli.artifacts"]
    into_cli = sorted(m for m, ts in lazy.items() if not m.startswith(("wide_cli.cli", "wide_cli.__main__"))
                      and any(t.startswith("wide_cli.cli") for t in ts))
    assert not into_cli, f"only the CLI may import wide_cli.cli: {into_cli}"
