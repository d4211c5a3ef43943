"""``manifest.json``: sha256 and size of every file of an export; loaders verify it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from wide_cli.atomic import atomic_write_json
from wide_cli.errors import CheckpointError

MANIFEST = "manifest.json"


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST and not p.name.startswith("."))


def write_manifest(root: Path, *, export_id: str, weight_format: str | None = None) -> dict:
    """Hash every file under ``root`` (except the manifest) and write ``manifest.json``.

    Args:
        root: export directory.
        export_id: a unique id of this export (also stored in ``wide_config.json``), so that a
            manifest copied from another export is detected.
        weight_format: recorded when not None (``fp32``, ``int8``: how model.safetensors stores
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


def verify_manifest(root: Path) -> dict:
    """Check every file listed in ``manifest.json`` (size, then sha256) and that no listed file is
    missing.

    Raises:
        CheckpointError: naming the first missing, truncated or corrupt file, or a missing or
            unreadable manifest (an incomplete export).
    """
    root = Path(root)
    mpath = root / MANIFEST
    if not root.is_dir():
        raise CheckpointError(f"export directory {str(root)!r} does not exist", "check the path")
    if not mpath.is_file():
        raise CheckpointError(
            f"{mpath} is missing: {str(root)!r} is not a complete wide export",
            "re-run `wide export` (an interrupted export leaves no manifest)",
        )
    try:
        manifest = json.loads(mpath.read_text())
        files = manifest["files"]
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"{mpath} is corrupt ({e})", "re-run `wide export`") from None
    for rel, info in files.items():
        p = root / rel
        if not p.is_file():
            raise CheckpointError(f"{p} is listed in the manifest but missing", "re-run `wide export`")
        size = p.stat().st_size
        if size != info["size"]:
            raise CheckpointError(
                f"{p} has {size} bytes, the manifest says {info['size']} (truncated or replaced)",
                "re-run `wide export`",
            )
        if sha256_file(p) != info["sha256"]:
            raise CheckpointError(f"{p} fails its sha256 check (corrupt or modified)", "re-run `wide export`")
    return manifest
