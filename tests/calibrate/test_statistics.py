"""Per-unit activation statistics: hand-checked values, shapes, batching, save/load."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from wide_cli.calibrate.statistics import GroupStatistics, collect_statistics
from wide_cli.errors import CheckpointError, ConfigError
from wide_cli.models.tiny import tiny_model

KINDS = {"llama": {}, "qwen2": {}, "qwen3": {"head_dim": 32}, "mistral": {}}


def _ids(n=5, t=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 105, (n, t), generator=g)


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", seed=0)


def _layer_inputs(model, ids, layer):
    """Inputs of ``layer``'s attention (after input_layernorm) and MLP (after post-attention norm)."""
    got = {}
    lyr = model.model.layers[layer]

    def attn_in(module, args, kwargs):
        got["attn"] = kwargs["hidden_states"]

    def mlp_in(module, args):
        got["mlp"] = args[0]

    hs = [lyr.self_attn.register_forward_pre_hook(attn_in, with_kwargs=True),
          lyr.mlp.register_forward_pre_hook(mlp_in)]
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        for h in hs:
            h.remove()
    return got["attn"], got["mlp"]


def test_ffn_channel_norm_matches_direct_computation(llama):
    ids = _ids()
    stats = collect_statistics(llama, ids, batch_size=2)
    _, x = _layer_inputs(llama, ids, 1)
    mlp = llama.model.layers[1].mlp
    act = F.silu(x @ mlp.gate_proj.weight.T) * (x @ mlp.up_proj.weight.T)  # [B, T, F]
    expected = act.abs().mean(dim=(0, 1))
    torch.testing.assert_close(stats.ffn_channel_norm[1], expected, rtol=1e-5, atol=1e-6)
    assert stats.tokens == ids.numel() and stats.ffn_channel_norm.dtype == torch.float32


def test_attn_head_norm_matches_direct_computation(llama):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    ids = _ids()
    stats = collect_statistics(llama, ids, batch_size=5)
    x, _ = _layer_inputs(llama, ids, 0)
    attn = llama.model.layers[0].self_attn
    B, T, _ = x.shape
    H, Hkv, d = 4, 2, 16
    q = (x @ attn.q_proj.weight.T).view(B, T, H, d).transpose(1, 2)
    k = (x @ attn.k_proj.weight.T).view(B, T, Hkv, d).transpose(1, 2)
    v = (x @ attn.v_proj.weight.T).view(B, T, Hkv, d).transpose(1, 2)
    cos, sin = llama.model.rotary_emb(x, torch.arange(T).unsqueeze(0))
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
    scores = (q @ k.transpose(-1, -2)) / d**0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    out = scores.softmax(dim=-1) @ v  # [B, H, T, d]
    expected = out.norm(dim=-1).mean(dim=(0, 2))  # [H]
    torch.testing.assert_close(stats.attn_head_norm[0], expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", list(KINDS))
def test_shapes_for_every_architecture(kind):
    model = tiny_model(kind, seed=0, **KINDS[kind])
    calls = []
    stats = collect_statistics(model, _ids(), batch_size=2, progress=lambda done, total: calls.append((done, total)))
    assert stats.attn_head_norm.shape == (2, 4) and stats.ffn_channel_norm.shape == (2, 128)
    assert torch.isfinite(stats.attn_head_norm).all() and (stats.attn_head_norm > 0).all()
    assert (stats.ffn_channel_norm > 0).all()
    assert calls == [(1, 3), (2, 3), (3, 3)]
    assert stats.group_importance("attention", 2).shape == (2, 2)
    assert stats.group_importance("attention", 1).shape == (2, 4)
    assert stats.group_importance("ffn", 32).shape == (2, 4)
    assert not model.training


def test_batching_weights_by_tokens(llama):
    ids = _ids(n=5)
    whole = collect_statistics(llama, ids, batch_size=5)
    uneven = collect_statistics(llama, ids, batch_size=2)  # 2 + 2 + 1 sequences
    torch.testing.assert_close(uneven.attn_head_norm, whole.attn_head_norm, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(uneven.ffn_channel_norm, whole.ffn_channel_norm, rtol=1e-5, atol=1e-6)
    first = collect_statistics(llama, ids, batch_size=2, max_batches=1)
    assert first.tokens == 2 * 12
    torch.testing.assert_close(first.ffn_channel_norm, collect_statistics(llama, ids[:2]).ffn_channel_norm)


def test_hooks_are_removed(llama):
    collect_statistics(llama, _ids(n=1))
    for layer in llama.model.layers:
        assert not layer.self_attn.o_proj._forward_pre_hooks and not layer.mlp.down_proj._forward_pre_hooks


def test_group_importance_sums_contiguous_units():
    stats = GroupStatistics(torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.0, 1.0, 0.0, 1.0]]),
                            torch.arange(12, dtype=torch.float32).view(2, 6), tokens=7)
    assert stats.group_importance("attention", 2).tolist() == [[3.0, 7.0], [1.0, 1.0]]
    assert stats.group_importance("ffn", 3).tolist() == [[3.0, 12.0], [21.0, 30.0]]
    with pytest.raises(ConfigError, match="attn-group-size 3 does not divide 4 query heads"):
        stats.group_importance("attention", 3)
    with pytest.raises(ConfigError, match="ffn-group-size 4 does not divide 6 FFN channels"):
        stats.group_importance("ffn", 4)
    with pytest.raises(ConfigError, match="unknown module 'mlp'"):
        stats.group_importance("mlp", 1)


def test_save_load_round_trip(tmp_path):
    stats = GroupStatistics(torch.rand(3, 4), torch.rand(3, 8), tokens=123)
    path = tmp_path / "sub" / "statistics.safetensors"
    stats.save(path)
    back = GroupStatistics.load(path)
    assert back.tokens == 123
    assert torch.equal(back.attn_head_norm, stats.attn_head_norm)
    assert torch.equal(back.ffn_channel_norm, stats.ffn_channel_norm)
    assert [p.name for p in path.parent.iterdir()] == ["statistics.safetensors"]


def test_load_errors(tmp_path):
    with pytest.raises(CheckpointError, match="cannot read calibration statistics"):
        GroupStatistics.load(tmp_path / "missing.safetensors")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="re-run `wide calibrate`"):
        GroupStatistics.load(bad)
    from safetensors.torch import save_file

    other = tmp_path / "other.safetensors"
    save_file({"x": torch.zeros(1)}, str(other))
    with pytest.raises(CheckpointError, match="not a wide statistics file"):
        GroupStatistics.load(other)
