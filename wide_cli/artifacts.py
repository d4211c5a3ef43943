"""The files wide writes and reads back: their names, the router tensor names, and the readers.

One leaf module for the vocabulary of a run directory (DESIGN.md §2) and of an export, so that
every loader (``export.loader``, the hf-format loader, the runtime's ``weights_from_export``,
``wide inspect``, the pipeline's stages) reads the same files the same way. It imports nothing
of wide at import time but ``errors``, ``filenames`` (the file names, spelled once) and
``models.arch`` (``routing.config`` and ``models.loader`` inside the functions that need them), so
any package may import it without a cycle.

Run directory: ``run.json``, ``calibration/statistics.safetensors``,
``stage1/routers.safetensors``, ``stage2/{adapter,routers}.safetensors`` (+ ``result.json``).
Export: ``config.json``, ``model.safetensors`` (or shards + index), ``routers.safetensors``
(``wide`` format), ``wide_config.json``, ``manifest.json``; ``ExportInfo`` answers what an
export is (method, routing, formats, dropped layers) and where its files are.

Router tensors are named ``<prefix>layers.<i>.router_<module>.<rest>`` where ``module`` is one
of ``models.arch.ROUTED_MODULES`` (e.g. ``model.layers.3.router_ffn.router.weight``,
``model.layers.0.router_attention.keep``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from wide_cli.errors import CheckpointError, ConfigError
from wide_cli.filenames import (
    CONFIG_JSON,
    GENERATION_CONFIG,
    HF_MODELING_FILE,
    MANIFEST,
    ROUTERS_FILE,
    WEIGHTS_FILE,
    WEIGHTS_INDEX,
    WIDE_CONFIG,
)
from wide_cli.models.arch import ROUTED_MODULES

if TYPE_CHECKING:
    from collections.abc import Iterable

    from wide_cli.routing.config import RoutingConfig

# ----------------------------------------------------------------------------- versions
#: ``format_version`` written into an export's ``wide_config.json`` and a run's ``run.json``;
#: a reader refuses a higher one (a newer wide wrote it), and reads a lower or missing one.
EXPORT_FORMAT_VERSION = 1
RUN_FORMAT_VERSION = 1

_CORRUPT = "the export is corrupt or was edited; re-run `wide export`"
_UPGRADE = "upgrade wide: pip install -U wide-prune"



# ----------------------------------------------------------------------------- router tensor names
def is_router_tensor(name: str) -> bool:
    """True for a router tensor (``....router_attention.*`` / ``....router_ffn.*``)."""
    return any(f".router_{m}." in name for m in ROUTED_MODULES)


def split_router_tensors(tensors: dict) -> tuple[dict, dict]:
    """``(backbone, routers)``: ``tensors`` split by ``is_router_tensor``, order kept."""
    backbone, routers = {}, {}
    for k, v in tensors.items():
        (routers if is_router_tensor(k) else backbone)[k] = v
    return backbone, routers


def backbone_state_dict(model) -> dict:
    """The model's state dict without router tensors (HF names, as stored)."""
    return split_router_tensors(model.state_dict())[0]


def parse_router_name(name: str) -> tuple[int, str, str]:
    """``(layer, module, rest)`` of a router tensor name:
    ``model.layers.3.router_ffn.router.weight`` -> ``(3, "ffn", "router.weight")``.

    Raises:
        ValueError: ``name`` is not a router tensor name.
    """
    parts = name.split(".")
    for j, part in enumerate(parts):
        mod = part.removeprefix("router_")
        if part.startswith("router_") and mod in ROUTED_MODULES and j >= 1 and parts[j - 1].isdigit():
            return int(parts[j - 1]), mod, ".".join(parts[j + 1 :])
    raise ValueError(f"{name!r} is not a router tensor name (<prefix>.<layer>.router_<module>.<rest>)")


def static_keep_from_routers(routers: dict) -> dict:
    """``{(layer, module): [G] bool tensor}`` from the ``keep`` tensors of a static-width model's
    routers (every router tensor of static width is a keep mask)."""
    return {parse_router_name(name)[:2]: t for name, t in routers.items()}


# ----------------------------------------------------------------------------- reading
def read_json(path: Path, fix: str) -> dict:
    """The JSON object in ``path``.

    Raises:
        CheckpointError: missing or not JSON, naming the file, with ``fix``.
    """
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing", fix) from None
    except ValueError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e})", fix) from None


def read_routers(path: Path, fix: str = "re-run `wide export`") -> dict:
    """The tensors of a ``routers.safetensors`` (of an export or a run's stage), on CPU.

    Raises:
        CheckpointError: missing or unreadable, naming the file, with ``fix``.
    """
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path} is missing", fix)
    try:
        return load_file(str(path))
    except Exception as e:  # noqa: BLE001 -- safetensors raises its own error types
        raise CheckpointError(f"{path} is unreadable ({e})", fix) from None


def read_backbone(path) -> dict:
    """The backbone tensors of an export: ``model.safetensors`` or the shards listed in
    ``model.safetensors.index.json`` (``{HF name: tensor}``, CPU, as stored; an ``hf`` export's
    router tensors are among them: ``split_router_tensors``).

    Raises:
        CheckpointError: no weights file, an unreadable file, a shard named in the index missing.
    """
    from safetensors.torch import load_file

    from wide_cli.models.consistency import safetensors_files

    try:
        files = safetensors_files(path)
    except ValueError as e:
        raise CheckpointError(f"{path}/{WEIGHTS_INDEX} is corrupt ({e})", _CORRUPT) from None
    if files is None:
        raise CheckpointError(f"{path} has no {WEIGHTS_FILE} (or index)", "is this a wide export directory?")
    out = {}
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"weight shard {f} is missing", _CORRUPT)
        try:
            out.update(load_file(str(f)))
        except Exception as e:  # noqa: BLE001 -- safetensors raises its own error types
            raise CheckpointError(f"{f} is unreadable ({e})", _CORRUPT) from None
    return out


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in ``chunk``-byte pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


# ----------------------------------------------------------------------------- exports
@dataclass
class PrunedModel:
    """A loaded export.

    Attributes:
        model: routed ``*ForCausalLM`` in eval mode, routing in deterministic ``argmax`` mode.
        tokenizer: the export's tokenizer.
        wide_config: the parsed ``wide_config.json``.
        path: the export directory.
    """

    model: object
    tokenizer: object
    wide_config: dict
    path: Path


def is_export(path) -> bool:
    """True when ``path`` is a directory holding ``wide_config.json``."""
    p = Path(path)
    return p.is_dir() and (p / WIDE_CONFIG).is_file()


def is_hf_export(path) -> bool:
    """True when ``path`` holds an hf-format export (``config.json`` with an ``auto_map`` to
    ``modeling_wide``)."""
    try:
        cfg = json.loads((Path(path) / CONFIG_JSON).read_text())
    except (OSError, ValueError):
        return False
    return HF_MODELING_FILE.removesuffix(".py") in json.dumps(cfg.get("auto_map", {}))


@dataclass(frozen=True)
class ExportInfo:
    """What an export is, answered from its ``wide_config.json`` in one place for every reader
    (loaders, runtime, inspect, eval, serve, the model card).

    Build it with ``ExportInfo.read(path)`` (reads and version-checks ``wide_config.json``) or
    ``ExportInfo(wide_config, path)`` for a dict in hand (the writer's, before the files exist).

    Attributes:
        wide_config: the parsed ``wide_config.json``.
        path: the export directory (None for a dict not yet written).
    """

    wide_config: dict
    path: Path | None = None

    @classmethod
    def read(cls, path) -> ExportInfo:
        """Read ``path``'s ``wide_config.json``.

        Raises:
            CheckpointError: see ``read_wide_config`` (missing, not JSON, a newer format).
        """
        return cls(read_wide_config(path), Path(path))

    # -- what the export is
    @property
    def routing(self) -> dict:
        """The recorded ``RoutingConfig`` fields (``{}`` when absent)."""
        return self.wide_config.get("routing") or {}

    @property
    def layout(self) -> dict:
        """Resolved group layout (``attn_group_size``, ``ffn_group_size``, ``attn_groups``,
        ``ffn_groups``, ``kv_aligned``; ``{}`` when absent)."""
        return self.wide_config.get("layout") or {}

    @property
    def method(self) -> str:
        """The pruning method the export is the result of (``wide``, ``dynamic-depth``,
        ``static-width``, ``static-depth``, ``dense``): the top-level ``method``, else the
        routing's, else ``wide`` (the first exports recorded only the routing)."""
        return self.wide_config.get("method") or self.routing.get("method") or "wide"

    @property
    def routing_method(self) -> str:
        """How its layers route at run time: the routing's method first (a static-depth export
        is a plain smaller model: ``dense``), else ``method``."""
        return self.routing.get("method") or self.method

    @property
    def routed_modules(self) -> tuple[str, ...]:
        """The modules whose groups are routed (none when ``routing_method`` is ``dense``)."""
        if self.routing_method == "dense":
            return ()
        return tuple(m for m in ROUTED_MODULES if self.routing.get(f"route_{m}", True))

    @property
    def export_format(self) -> str:
        """``wide`` or ``hf`` (recorded; exports that predate the field are told by their
        ``config.json``)."""
        fmt = self.wide_config.get("export_format")
        if fmt:
            return fmt
        return "hf" if self.path is not None and is_hf_export(self.path) else "wide"

    @property
    def weight_format(self) -> str:
        """How ``model.safetensors`` stores the projections: ``fp32`` (as saved), ``int8`` or ``int4``."""
        return (self.wide_config.get("weight_format") or {}).get("format") or "fp32"

    @property
    def dropped_layers(self) -> dict | None:
        """A hybrid's removed layers (``removed``, ``num_layers`` of the source, ...), else None."""
        return self.wide_config.get("dropped_layers") or None

    @property
    def static_depth(self) -> dict | None:
        """A static-depth export's layer selection, else None."""
        return self.wide_config.get("static_depth") or None

    @property
    def static_width(self) -> dict | None:
        """A physically narrowed static-width export's kept heads / channels, else None."""
        return self.wide_config.get("static") or None

    @property
    def lora(self) -> dict | None:
        """The merged LoRA's settings, else None."""
        return self.wide_config.get("lora") or None

    # -- its files
    def file(self, name: str) -> Path:
        """``path / name`` (one of this module's file-name constants).

        Raises:
            ValueError: the info has no path (a dict not yet written).
        """
        if self.path is None:
            raise ValueError("this ExportInfo was built from a dict and has no directory")
        return self.path / name

    @property
    def config_path(self) -> Path:
        return self.file(CONFIG_JSON)

    @property
    def weights_path(self) -> Path:
        """The single weights file (shards are listed by ``weights_index_path``)."""
        return self.file(WEIGHTS_FILE)

    @property
    def weights_index_path(self) -> Path:
        return self.file(WEIGHTS_INDEX)

    @property
    def routers_path(self) -> Path:
        return self.file(ROUTERS_FILE)

    @property
    def wide_config_path(self) -> Path:
        return self.file(WIDE_CONFIG)

    @property
    def manifest_path(self) -> Path:
        return self.file(MANIFEST)

    @property
    def generation_config_path(self) -> Path:
        return self.file(GENERATION_CONFIG)


def read_wide_config(path: Path) -> dict:
    """The export's ``wide_config.json`` as a dict, checked to be a format this wide reads.

    Raises:
        CheckpointError: missing (not a wide export), not JSON, or written by a newer wide
            (``check_format_version``).
    """
    p = Path(path) / WIDE_CONFIG
    try:
        wcfg = json.loads(p.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{p} is missing: not a wide export", "export one with `wide export`") from None
    except ValueError as e:
        raise CheckpointError(f"{p} is not valid JSON ({e})", "re-run `wide export`") from None
    if not isinstance(wcfg, dict):
        raise CheckpointError(f"{p} is not a JSON object", "re-run `wide export`")
    check_format_version(wcfg, EXPORT_FORMAT_VERSION, p)
    return wcfg


def check_format_version(doc: dict, supported: int, path: Path) -> None:
    """Refuse a file (``wide_config.json``, ``run.json``) whose ``format_version`` is higher than
    ``supported``: a newer wide wrote it, and this one would misread what it does not know. A
    missing version (the first files wide wrote) or a lower one is read as it is.

    Raises:
        CheckpointError: naming the file, both versions (and the wide that wrote it, when
            recorded), and the fix.
    """
    from wide_cli.version import __version__

    found = doc.get("format_version")
    if found is None:
        return
    if not isinstance(found, int) or isinstance(found, bool):
        raise CheckpointError(f"{path} has format_version {found!r}, not a whole number", "the file was edited")
    if found > supported:
        by = f" (wide {doc['wide_version']})" if doc.get("wide_version") else ""
        raise CheckpointError(f"{path} has format_version {found}{by}, newer than the {supported} this wide "
                              f"({__version__}) reads", _UPGRADE)


def check_export_target(out, *, protected: Iterable[tuple[str, Path | None]] = (),
                        inside: tuple[Path, Path] | None = None) -> None:
    """Refuse an export destination whose replacement would destroy what wide did not write.

    Accepted: a path that does not exist, an empty directory, and a complete wide export whose
    files are exactly those its ``manifest.json`` lists (the writer replaces it atomically).
    Refused: a symbolic link (even to an export: the rename would act on the link, not on what it
    points at), a file, a directory holding anything else, a path in ``protected`` (``(what, path)``
    pairs, e.g. ``("the run directory", run_root)``, ``("the model source", source_dir)``; None
    is skipped; a path need not exist yet) and a directory holding one of them. ``inside``
    (``(run_root, default_export)``): any other path inside ``run_root`` is refused, existing or not.

    Raises:
        ConfigError: naming ``out``, what it is and the fix; nothing is touched.
    """
    out = Path(out)
    fix = "choose a new path, an empty directory or an existing wide export for --out"
    if out.is_symlink():
        raise ConfigError(f"--out {out} is a symbolic link (to {out.readlink()})",
                          "give the directory itself, or a new path, for --out")
    target = out.resolve()
    for what, p in protected:
        if p is None:
            continue
        p = Path(p).resolve()
        if p == target:
            raise ConfigError(f"--out {out} is {what}", fix)
        if p.is_relative_to(target):
            raise ConfigError(f"--out {out} holds {what} {p}", fix)
    if inside is not None:
        root, allowed = (Path(q).resolve() for q in inside)
        if target.is_relative_to(root) and target != allowed:
            raise ConfigError(f"--out {out} is inside the run directory {inside[0]}",
                              f"choose a path outside it, or omit --out to write {inside[1]}")
    if not out.exists():
        return
    if not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not an export directory", fix)
    first = min(out.iterdir(), default=None)  # one level: a large foreign folder is never walked
    if first is None:
        return
    listed = _export_files(out)
    if listed is None:
        raise ConfigError(f"--out {out} exists and is not a wide export (it holds {first.name})", fix)
    present = sorted(str(q.relative_to(out)) for q in out.rglob("*") if not q.is_dir() or q.is_symlink())
    foreign = [f for f in present if f not in listed and f != MANIFEST]
    if foreign:
        raise ConfigError(f"--out {out} is a wide export but also holds {foreign[0]}, which is not in its manifest",
                          f"move {foreign[0]} out of {out}, or {fix}")


def _export_files(path: Path) -> set[str] | None:
    """The files ``manifest.json`` lists when ``path`` holds a wide export (a ``wide_config.json``
    and a manifest that parse), else None."""
    try:
        wcfg = json.loads((path / WIDE_CONFIG).read_text())
        files = json.loads((path / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(wcfg, dict) or not isinstance(files, dict):
        return None
    return set(files)


def check_manifest_owner(path: Path) -> None:
    """Refuse an export of a newer format (``check_format_version``), then a ``manifest.json``
    copied from another export, naming the manifest: both checked before the files, whose hashes
    would otherwise point at an innocent file.

    Raises:
        CheckpointError: ``wide_config.json`` has a newer ``format_version``, or the manifest's
            ``export_id`` differs from ``wide_config.json``'s.
    """
    path = Path(path)
    try:
        wcfg = json.loads((path / WIDE_CONFIG).read_text())
        if isinstance(wcfg, dict):
            check_format_version(wcfg, EXPORT_FORMAT_VERSION, path / WIDE_CONFIG)
        mid = json.loads((path / MANIFEST).read_text()).get("export_id")
        wid = wcfg.get("export_id")
    except (OSError, ValueError, AttributeError):
        return  # missing / unreadable: verify_manifest and read_wide_config name the file
    if mid != wid:
        raise CheckpointError(
            f"{path / MANIFEST} belongs to another export ({mid} != {wid})", "re-run `wide export`"
        )


def unreadable_weights(path: Path) -> str | None:
    """Name of the first ``*.safetensors`` file in ``path`` whose header cannot be read, or None."""
    from safetensors import SafetensorError, safe_open

    for f in sorted(Path(path).glob("*.safetensors")):
        try:
            with safe_open(str(f), "pt"):
                pass
        except (SafetensorError, OSError):  # either way this is the file to name
            return f.name
    return None


def routing_config_from(wide_config: dict) -> RoutingConfig:
    """The ``RoutingConfig`` recorded in ``wide_config["routing"]`` (keys this wide does not
    know, e.g. from a newer version, are ignored)."""
    from wide_cli.routing.config import RoutingConfig

    fields = RoutingConfig.__dataclass_fields__
    return RoutingConfig(**{k: v for k, v in wide_config["routing"].items() if k in fields})


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


def open_export(path, *, verify: bool = True):
    """Check an export (manifest owner and hashes when ``verify``) and read its
    ``wide_config.json`` and tokenizer. Returns ``(path, wide_config, tokenizer)``.

    Raises:
        CheckpointError: naming the missing, corrupt or foreign file.
    """
    from wide_cli.models.loader import load_tokenizer

    path = Path(path)
    if verify:
        check_manifest_owner(path)
        verify_manifest(path)
    wcfg = read_wide_config(path)
    try:
        tokenizer = load_tokenizer(path)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot load the tokenizer of {path}: {e}", "re-run `wide export`") from None
    return path, wcfg, tokenizer
