"""Shipped recipes (``recipes/*.toml`` in the repository, ``wide_cli/_data/recipes`` in a wheel)."""

from __future__ import annotations

from pathlib import Path

from wide_cli.resources import shipped_dir

RECIPES_DIR = shipped_dir("recipes")


def list_recipes() -> list[Path]:
    """The shipped recipe files, sorted by name."""
    return sorted(RECIPES_DIR.glob("*.toml")) if RECIPES_DIR.is_dir() else []


def recipe_path(name: str) -> Path | None:
    """Resolve a shipped recipe by name (``smollm2-135m-cpu`` or ``smollm2-135m-cpu.toml``)."""
    stem = Path(name).name.removesuffix(".toml")
    p = RECIPES_DIR / f"{stem}.toml"
    return p if p.is_file() else None
