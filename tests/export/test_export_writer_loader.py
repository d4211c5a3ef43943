"""Export -> load_pruned round-trips, manifest checks and strict loading (explicit head_dim,
tied embeddings, q/k/v biases, rope_scaling: every config detail survives the round trip)."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from wide_cli.errors import CheckpointError
from wide_cli.export import export_model, load_pruned
from wide_cli.models.tiny import char_tokenizer, tiny_model
from wide_cli.routing import RoutingConfig, attach_routers

IDS = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))


def _export(tmp_path, kind="llama", cfg=None, **over):
    model = tiny_model(kind, **over)
    cfg = cfg or RoutingConfig(attn_group_size=2, ffn_group_size=32)
    state = attach_routers(model, cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".router_" in n and n.endswith("bias"):
                p.normal_(0, 1.0)  # routers that actually skip
        ref = model(IDS).logits
    out = tmp_path / "export"
    export_model(model, char_tokenizer(), out, wide_config={"method": cfg.method, "routing": cfg.to_dict()})
    return model, state, ref, out


@pytest.mark.parametrize(
    "kind,over",
    [("llama", {}), ("llama", {"tie_word_embeddings": True}), ("qwen2", {}), ("qwen3", {"head_dim": 32}),
     ("mistral", {})],
)
def test_roundtrip_reproduces_logits_exactly(tmp_path, kind, over):
    _, _state, ref, out = _export(tmp_path, kind, **over)
    pm = load_pruned(out)
    with torch.no_grad():
        got = pm.model(IDS).logits
    assert torch.equal(got, ref)
    assert pm.model.wide_routing.mode == "argmax"
    files = sorted(json.loads((out / "manifest.json").read_text())["files"])
    assert {"config.json", "model.safetensors", "routers.safetensors", "wide_config.json"} <= set(files)


def test_b03_b26_config_keeps_head_dim_and_rope_scaling(tmp_path):
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128, "rope_theta": 500000.0}
    _, _, _ref, out = _export(tmp_path, "llama", head_dim=32, max_position_embeddings=1024, rope_parameters=rope)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["head_dim"] == 32
    saved = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    for k, v in rope.items():
        assert saved[k] == v
    from transformers import AutoModelForCausalLM

    _plain, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]


def test_b15_export_has_qkv_biases(tmp_path):
    _, _, _, out = _export(tmp_path, "qwen2")
    t = load_file(str(out / "model.safetensors"))
    assert tuple(t["model.layers.0.self_attn.q_proj.bias"].shape) == (64,)
    assert tuple(t["model.layers.0.self_attn.k_proj.bias"].shape) == (32,)
    assert tuple(t["model.layers.0.self_attn.v_proj.bias"].shape) == (32,)
    assert "model.layers.0.self_attn.o_proj.bias" not in t


def test_b13_tied_embeddings_stored_once_and_reload_identical(tmp_path):
    _model, _, _ref, out = _export(tmp_path, "llama", tie_word_embeddings=True)
    t = load_file(str(out / "model.safetensors"))
    assert "model.embed_tokens.weight" in t and "lm_head.weight" not in t
    pm = load_pruned(out)
    assert pm.model.lm_head.weight.data_ptr() == pm.model.model.embed_tokens.weight.data_ptr()


def test_b13b_untied_embeddings_saved_separately_and_bit_identical(tmp_path):
    _model, _, _, out = _export(tmp_path, "llama", tie_word_embeddings=False)
    t = load_file(str(out / "model.safetensors"))
    assert torch.equal(t["model.embed_tokens.weight"], tiny_model("llama").model.embed_tokens.weight)
    assert not torch.equal(t["lm_head.weight"], t["model.embed_tokens.weight"])


def test_flipped_byte_in_routers_is_rejected(tmp_path):
    _, _, _, out = _export(tmp_path)
    p = out / "routers.safetensors"
    data = bytearray(p.read_bytes())
    data[-3] ^= 0xFF
    p.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="routers.safetensors fails its sha256 check"):
        load_pruned(out)


def test_truncated_file_and_missing_manifest_are_rejected(tmp_path):
    _, _, _, out = _export(tmp_path)
    p = out / "model.safetensors"
    p.write_bytes(p.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="model.safetensors has .* bytes, the manifest says"):
        load_pruned(out)
    (out / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="manifest.json is missing"):
        load_pruned(out)


def test_manifest_from_another_export_is_rejected(tmp_path):
    _, _, _, a = _export(tmp_path / "a")
    _, _, _, b = _export(tmp_path / "b")
    (a / "manifest.json").write_bytes((b / "manifest.json").read_bytes())
    with pytest.raises(CheckpointError):
        load_pruned(a)


def _rewrite(path, fn):
    t = load_file(str(path))
    save_file(fn(t), str(path), metadata={"format": "pt"})


def test_b30a_renamed_embedding_fails_listing_keys(tmp_path):
    _, _, _, out = _export(tmp_path)
    _rewrite(out / "model.safetensors",
             lambda t: {("model.embed.weight" if k == "model.embed_tokens.weight" else k): v for k, v in t.items()})
    with pytest.raises(CheckpointError, match=r"missing \['model.embed_tokens.weight'\]"):
        load_pruned(out, verify=False)


def test_b30b_deleted_router_file_fails(tmp_path):
    _, _, _, out = _export(tmp_path)
    (out / "routers.safetensors").unlink()
    with pytest.raises(CheckpointError, match="routers.safetensors is listed in the manifest but missing"):
        load_pruned(out)
    with pytest.raises(CheckpointError, match="routers.safetensors is missing"):
        load_pruned(out, verify=False)


def test_b30c_extra_tensor_fails_unless_allowed(tmp_path):
    _, _, ref, out = _export(tmp_path)
    _rewrite(out / "model.safetensors", lambda t: {**t, "model.extra.weight": torch.zeros(3)})
    with pytest.raises(CheckpointError, match=r"unexpected \['model.extra.weight'\]"):
        load_pruned(out, verify=False)
    with pytest.warns(UserWarning, match="ignoring unexpected tensors"):
        pm = load_pruned(out, verify=False, allow_extra=True)
    with torch.no_grad():
        assert torch.equal(pm.model(IDS).logits, ref)


def test_b30_loaded_model_is_not_uniform(tmp_path):
    from wide_cli.export.loader import next_token_entropy

    _, _, _, out = _export(tmp_path)
    pm = load_pruned(out)
    assert next_token_entropy(pm.model, pm.tokenizer) < math.log(128) - 0.01


def test_b11_nan_router_refused_and_nothing_written(tmp_path):
    model = tiny_model("llama")
    attach_routers(model, RoutingConfig(attn_group_size=2, ffn_group_size=32))
    with torch.no_grad():
        model.model.layers[1].router_ffn.router.weight[0, 0] = float("nan")
    out = tmp_path / "export"
    with pytest.raises(CheckpointError, match=r"router tensor model.layers.1.router_ffn.router.weight contains NaN"):
        export_model(model, char_tokenizer(), out, wide_config={"method": "wide", "routing": {}})
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


def test_failed_export_leaves_previous_export_untouched(tmp_path, monkeypatch):
    _, _, _, out = _export(tmp_path)
    before = (out / "manifest.json").read_bytes()
    model = tiny_model("llama")
    attach_routers(model, RoutingConfig(attn_group_size=2, ffn_group_size=32))

    def boom(*a, **k):
        raise OSError("No space left on device")

    monkeypatch.setattr("wide_cli.export.writer.save_file", boom)
    with pytest.raises(OSError, match="No space left"):
        export_model(model, char_tokenizer(), out, wide_config={"method": "wide", "routing": {}})
    assert (out / "manifest.json").read_bytes() == before
    assert load_pruned(out) is not None
    assert [p.name for p in tmp_path.iterdir()] == ["export"]


def test_static_width_export_roundtrip(tmp_path):
    model = tiny_model("llama")
    keep = {(i, m): torch.tensor([True, False] * 2) for i in range(2)
            for m in ("attention", "ffn")}
    cfg = RoutingConfig(method="static-width", attn_group_size=1, ffn_group_size=32)
    attach_routers(model, cfg, static_keep=keep)
    with torch.no_grad():
        ref = model(IDS).logits
    out = tmp_path / "static"
    export_model(model, char_tokenizer(), out, wide_config={"method": cfg.method, "routing": cfg.to_dict()})
    pm = load_pruned(out)
    with torch.no_grad():
        assert torch.equal(pm.model(IDS).logits, ref)
    assert pm.model.model.layers[0].router_attention.keep.tolist() == [True, False, True, False]
