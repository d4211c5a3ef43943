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


def test_lowrank_standin_maps_of_the_wrong_shape_are_refused(tmp_path):
    """The export's ``standin_in`` / ``standin_out`` must be ``[G, R, D]`` both, with ``standin``:
    anything else is one error naming the layer and the tensors, before any step runs."""
    from safetensors.torch import load_file, save_file

    from tests._exports import feature_model
    from wide_cli.export import export_model
    from wide_cli.models.tiny import char_tokenizer

    model, wc = feature_model(standin="lowrank:4")
    export_model(model, char_tokenizer(), tmp_path / "exp", wide_config=wc)
    Runtime.from_export(tmp_path / "exp")  # as written: loads
    key = "model.layers.1.router_ffn.standin_out"
    for change, needle in ((lambda t: t.pop(key), "standin_in and standin_out come together"),
                           (lambda t: t.__setitem__(key, t[key][:, :3].contiguous()),
                            r"router_ffn.standin_in \(4, 4, 64\) / standin_out \(4, 3, 64\)")):
        t = load_file(str(tmp_path / "exp" / "routers.safetensors"))
        change(t)
        save_file(t, str(tmp_path / "exp" / "routers.safetensors"))
        with pytest.raises(CheckpointError, match=needle):
            Runtime.from_export(tmp_path / "exp", verify=False)
        export_model(model, char_tokenizer(), tmp_path / "exp", wide_config=wc)
