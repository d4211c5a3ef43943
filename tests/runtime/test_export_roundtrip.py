"""Runtime loaded from an export directory == ``load_pruned``'s routed HF model (tied embeddings
included: the same logits from both readers of one export)."""

from __future__ import annotations

import warnings

import pytest
import torch

from wide_cli.errors import CheckpointError
from wide_cli.export import load_pruned
from wide_cli.models.tiny import tiny_model
from wide_cli.routing import RoutingConfig, attach_routers
from wide_cli.runtime.engine import Runtime


@pytest.mark.parametrize("tied", [False, True])
def test_export_roundtrip_matches_load_pruned(tmp_path, tied, routed_model, write_export):
    model = routed_model("llama", tie_word_embeddings=tied)
    write_export(model, tmp_path / "exp")
    if tied:  # HF drops the tied lm_head on save, so it must be re-tied on load
        from safetensors import safe_open

        with safe_open(str(tmp_path / "exp" / "model.safetensors"), "pt") as f:
            assert "lm_head.weight" not in f.keys()  # noqa: SIM118 -- safe_open is not a dict
    pm = load_pruned(tmp_path / "exp", smoke_check=False)
    ids = torch.tensor([[40, 41, 50, 60, 70, 33, 34]])
    with torch.no_grad():
        want = pm.model(input_ids=ids).logits
    for backend in ("cpu", "reference"):
        rt = Runtime.from_export(tmp_path / "exp", backend=backend)
        torch.testing.assert_close(rt.forward(ids), want, atol=1e-4, rtol=0)
        assert (rt.lm_head is rt.embed) == tied
    res = rt.generate(["hello", "the quick brown fox"], max_new_tokens=5, ignore_eos=True)
    assert len(res.texts) == 2 and all(len(t) == 5 for t in res.tokens)
    assert res.sparsity["total"] > 0.0


def test_corrupt_or_incomplete_export_is_refused(tmp_path, routed_model, write_export):
    model = routed_model("llama")
    write_export(model, tmp_path / "exp")
    (tmp_path / "exp" / "routers.safetensors").unlink()
    with pytest.raises(CheckpointError, match="routers.safetensors"):
        Runtime.from_export(tmp_path / "exp")
    with pytest.raises(CheckpointError, match="routers.safetensors is missing"):
        Runtime.from_export(tmp_path / "exp", verify=False)
    write_export(model, tmp_path / "exp2")
    p = tmp_path / "exp2" / "model.safetensors"
    data = bytearray(p.read_bytes())
    data[-1] ^= 0xFF
    p.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256"):
        Runtime.from_export(tmp_path / "exp2")


def test_static_width_export_uses_keep_masks(tmp_path, write_export):
    model = tiny_model("llama")
    keep = {(i, m): torch.tensor([True, False]) if m == "attention" else torch.tensor([True, False, True, True])
            for i in range(2) for m in ("attention", "ffn")}  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        attach_routers(model, RoutingConfig(method="static-width", attn_group_size=2, ffn_group_size=32), static_keep=keep)
    write_export(model, tmp_path / "exp", method="static-width")
    ids = torch.tensor([[40, 41, 50, 60, 70]])
    with torch.no_grad():
        want = model(input_ids=ids).logits
    rt = Runtime.from_export(tmp_path / "exp", backend="cpu")
    torch.testing.assert_close(rt.forward(ids), want, atol=1e-4, rtol=0)
    s = rt.stats.summary()
    assert s["attention"] == pytest.approx(0.5) and s["ffn"] == pytest.approx(0.25)
