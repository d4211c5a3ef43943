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
