"""``manifest.json``: sha256 and size of every file of an export; loaders verify it
(``wide_cli.artifacts.verify_manifest``)."""

from __future__ import annotations

from pathlib import Path

from wide_cli.artifacts import sha256_file
from wide_cli.atomic import atomic_write_json
from wide_cli.filenames import MANIFEST


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST and not p.name.startswith("."))


def write_manifest(root: Path, *, export_id: str, weight_format: str | None = None) -> dict:
    """Hash every file under ``root`` (except the manifest) and write ``manifest.json``.

    Args:
        root: export directory.
        export_id: a unique id of this export (also stored in ``wide_config.json``), so that a
            manifest copied from another export is detected.
        weight_format: recorded when not None (``fp32``, ``int8``, ``int4``: how model.safetensors stores
            the weights).
    Returns:
        The manifest dict ``{format, export_id, files: {relpath: {sha256, size}}}``.
    """
    files = {
        str(p.relative_to(root)): {"sha256": sha256_file(p), "size": p.stat().st_size} for p in _files(root)
    }
    manifest = {"format": "wide-manifest", "version": 1, "export_id": export_id, "files": files}
    if weight_format is not None:
        manifest["weight_format"] = weight_format
    atomic_write_json(root / MANIFEST, manifest)
    return manifest
