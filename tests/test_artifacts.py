"""The file and tensor-name vocabulary of run dirs and exports (``wide_cli.artifacts``)."""

from __future__ import annotations

import pytest
import torch

from wide_cli.artifacts import (
    is_router_tensor,
    parse_router_name,
    read_json,
    read_routers,
    split_router_tensors,
    static_keep_from_routers,
)
from wide_cli.atomic import atomic_save_safetensors
from wide_cli.errors import CheckpointError


def test_router_names():
    assert is_router_tensor("model.layers.3.router_ffn.router.weight")
    assert is_router_tensor("model.layers.0.router_attention.keep")
    assert not is_router_tensor("model.layers.0.self_attn.q_proj.weight")
    assert not is_router_tensor("model.layers.0.router_ffnx.weight")
    assert parse_router_name("model.layers.3.router_ffn.router.weight") == (3, "ffn", "router.weight")
    assert parse_router_name("base_model.model.model.layers.11.router_attention.keep") == (11, "attention", "keep")
    with pytest.raises(ValueError, match="not a router tensor name"):
        parse_router_name("model.layers.3.mlp.up_proj.weight")


def test_split_and_static_keep():
    t = {"a.layers.0.router_ffn.keep": torch.ones(2), "a.layers.0.mlp.weight": torch.zeros(1),
         "a.layers.1.router_attention.keep": torch.zeros(3)}
    backbone, routers = split_router_tensors(t)
    assert list(backbone) == ["a.layers.0.mlp.weight"]
    assert list(routers) == ["a.layers.0.router_ffn.keep", "a.layers.1.router_attention.keep"]
    keep = static_keep_from_routers(routers)
    assert set(keep) == {(0, "ffn"), (1, "attention")} and keep[(1, "attention")].shape == (3,)


def test_readers_name_the_file(tmp_path):
    with pytest.raises(CheckpointError, match="routers.safetensors is missing"):
        read_routers(tmp_path / "routers.safetensors")
    (tmp_path / "routers.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError, match="routers.safetensors is unreadable"):
        read_routers(tmp_path / "routers.safetensors")
    atomic_save_safetensors(tmp_path / "routers.safetensors", {"m.layers.0.router_ffn.keep": torch.ones(4)})
    assert torch.equal(read_routers(tmp_path / "routers.safetensors")["m.layers.0.router_ffn.keep"], torch.ones(4))
    (tmp_path / "x.json").write_text("{")
    with pytest.raises(CheckpointError, match=r"x.json is not valid JSON"):
        read_json(tmp_path / "x.json", "fix it")
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_export_info_answers_method_routing_and_formats():
    from wide_cli.artifacts import ExportInfo

    routed = ExportInfo({"method": "wide", "routing": {"method": "wide", "route_attention": False},
                         "layout": {"attn_group_size": 3}, "export_format": "wide",
                         "weight_format": {"format": "int8", "scheme": "q8_0"}})
    assert (routed.method, routed.routing_method, routed.routed_modules) == ("wide", "wide", ("ffn",))
    assert (routed.export_format, routed.weight_format, routed.layout) == ("wide", "int8", {"attn_group_size": 3})
    # a static-depth export is a plain smaller model: it *is* static-depth, it *routes* nothing
    depth = ExportInfo({"method": "static-depth", "routing": {"method": "dense"}, "static_depth": {"removed": [3]}})
    assert (depth.method, depth.routing_method, depth.routed_modules) == ("static-depth", "dense", ())
    assert depth.static_depth == {"removed": [3]} and depth.dropped_layers is None and depth.weight_format == "fp32"
    # the first exports recorded only the routing
    old = ExportInfo({"routing": {"method": "dynamic-depth"}})
    assert (old.method, old.routing_method, old.routed_modules) == ("dynamic-depth", "dynamic-depth", ("attention", "ffn"))
    hybrid = ExportInfo({"method": "wide", "routing": {"method": "wide"}, "dropped_layers": {"removed": [1], "num_layers": 4}})
    assert hybrid.dropped_layers == {"removed": [1], "num_layers": 4}


def test_export_info_reads_an_export_and_names_its_files(tmp_path):
    from tests._exports import tiny_export
    from wide_cli.artifacts import ExportInfo
    from wide_cli.filenames import CONFIG_JSON, MANIFEST, ROUTERS_FILE, WEIGHTS_FILE, WIDE_CONFIG

    for fmt in ("wide", "hf"):
        out = tmp_path / fmt
        tiny_export(out, fmt)
        info = ExportInfo.read(out)
        assert (info.method, info.export_format, info.path) == ("wide", fmt, out)
        assert info.config_path == out / CONFIG_JSON and info.config_path.is_file()
        assert info.weights_path == out / WEIGHTS_FILE and info.weights_path.is_file()
        assert info.wide_config_path == out / WIDE_CONFIG and info.manifest_path == out / MANIFEST
        assert info.routers_path == out / ROUTERS_FILE and info.routers_path.is_file() == (fmt == "wide")
        # an export that predates the recorded format is told by its config.json
        legacy = ExportInfo({k: v for k, v in info.wide_config.items() if k != "export_format"}, out)
        assert legacy.export_format == fmt
    with pytest.raises(ValueError, match="no directory"):
        ExportInfo({}).config_path  # noqa: B018


def test_file_names_are_spelled_once():
    """Every file name wide writes or reads is a constant of ``wide_cli.filenames``: no other
    module spells it as a string of its own (prose that mentions a file is not a path)."""
    import re
    from pathlib import Path

    import wide_cli
    from wide_cli import filenames

    names = [v for k, v in vars(filenames).items() if k.isupper() and isinstance(v, str)]
    assert {"config.json", "model.safetensors", "wide_config.json", "manifest.json"} <= set(names)
    literal = re.compile("|".join(rf"""["']{re.escape(n)}["']""" for n in names))
    root = Path(wide_cli.__file__).parent
    found = [f"{p.relative_to(root)}:{i}: {line.strip()}" for p in sorted(root.rglob("*.py")) if p.name != "filenames.py"
             for i, line in enumerate(p.read_text().splitlines(), 1) if literal.search(line)]
    assert not found, "\n".join(found)
