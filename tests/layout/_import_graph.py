"""The import graph of ``wide_cli``, read from the source with ``ast`` (nothing is imported).

Shared by the layout tests. A node is a dotted module name (``wide_cli.runtime.ops``; a package
is its ``__init__``). An edge ``a -> b`` means ``a`` imports ``b``: ``import wide_cli.b``,
``from wide_cli import b`` (``b`` a module) or ``from wide_cli.b import name`` (``name`` not a
module). Importing ``wide_cli.x.y`` also runs ``wide_cli.x``'s ``__init__``; that implicit edge is
left out, as import linters do, because a package's ``__init__`` importing its own submodules
is the normal way to build a public surface, not a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "wide_cli"


def module_files(root: Path = PACKAGE_ROOT) -> dict[str, Path]:
    """``dotted name -> file`` for every ``.py`` file under ``root`` (a package directory)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(body: list[ast.stmt], module_level: bool):
    """Import statements of ``body``: only those that run at import time when ``module_level``
    (not in functions, classes' methods or ``if TYPE_CHECKING:``), else every one."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if not module_level:
                yield from _walk(node.body, module_level)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            if not module_level:
                yield from _walk(node.body, module_level)
            yield from _walk(node.orelse, module_level)
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):
                sub = getattr(node, field, None)
                if isinstance(sub, list) and sub and isinstance(sub[0], (ast.stmt, ast.excepthandler)):
                    yield from _walk(sub, module_level)


def import_graph(module_level: bool = True, root: Path = PACKAGE_ROOT) -> dict[str, set[str]]:
    """``module -> modules of the package it imports`` (see the module docstring for the edges).

    Args:
        module_level: True counts only imports that run when the module is imported; False also
            counts imports inside functions and ``if TYPE_CHECKING:`` blocks.
    """
    files = module_files(root)
    pkg = root.name
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in _walk(tree.body, module_level):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for target in targets:
                while target and target not in files:  # `import wide_cli.a.b.c` where c is a name
                    target = target.rpartition(".")[0]
                if target.split(".")[0] == pkg and target in files and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components with more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(frozenset(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found, key=sorted)
