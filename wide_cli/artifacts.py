"""The files wide writes and reads back: their names, the router tensor names, and the readers.

One leaf module for the vocabulary of a run directory (DESIGN.md §2) and of an export, so that
every loader (``export.loader``, the hf-format loader, the runtime's ``weights_from_export``,
``wide inspect``, the pipeline's stages) reads the same files the same way. It imports nothing
of wide but ``errors`` and ``routing.config`` (so any package may import it without a cycle).

Run directory: ``run.json``, ``calibration/statistics.safetensors``,
``stage1/routers.safetensors``, ``stage2/{adapter,routers}.safetensors`` (+ ``result.json``).
Export: ``config.json``, ``model.safetensors`` (or shards + index), ``routers.safetensors``
(``wide`` format), ``wide_config.json``, ``manifest.json``.

Router tensors are named ``<prefix>layers.<i>.router_<module>.<rest>`` where ``module`` is one
of ``ROUTER_MODULES`` (e.g. ``model.layers.3.router_ffn.router.weight``,
``model.layers.0.router_attention.keep``).
"""

from __future__ import annotations

import json
from pathlib import Path

from wide_cli.errors import CheckpointError

# ----------------------------------------------------------------------------- file names
WIDE_CONFIG = "wide_config.json"
ROUTERS_FILE = "routers.safetensors"
ADAPTER_FILE = "adapter.safetensors"
STATS_FILE = "statistics.safetensors"
MANIFEST = "manifest.json"
CONFIG_JSON = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
RESULT_JSON = "result.json"

#: the routed modules of a decoder layer, in the order every table and file lists them
ROUTER_MODULES = ("attention", "ffn")


# ----------------------------------------------------------------------------- router tensor names
def is_router_tensor(name: str) -> bool:
    """True for a router tensor (``....router_attention.*`` / ``....router_ffn.*``)."""
    return any(f".router_{m}." in name for m in ROUTER_MODULES)


def split_router_tensors(tensors: dict) -> tuple[dict, dict]:
    """``(backbone, routers)``: ``tensors`` split by ``is_router_tensor``, order kept."""
    backbone, routers = {}, {}
    for k, v in tensors.items():
        (routers if is_router_tensor(k) else backbone)[k] = v
    return backbone, routers


def parse_router_name(name: str) -> tuple[int, str, str]:
    """``(layer, module, rest)`` of a router tensor name:
    ``model.layers.3.router_ffn.router.weight`` -> ``(3, "ffn", "router.weight")``.

    Raises:
        ValueError: ``name`` is not a router tensor name.
    """
    parts = name.split(".")
    for j, part in enumerate(parts):
        mod = part.removeprefix("router_")
        if part.startswith("router_") and mod in ROUTER_MODULES and j >= 1 and parts[j - 1].isdigit():
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

