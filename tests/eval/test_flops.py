"""FLOPs and the decode bound from the model shape (DESIGN.md §3 numbers)."""

from __future__ import annotations

import pytest

from wide_cli.eval.flops import decode_speedup_bound, layer_flops, routed_flops
from wide_cli.models.arch import ModelShape

SMOLLM2 = ModelShape(num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64,
                     intermediate_size=1536, vocab_size=49152, model_type="llama")
LLAMA31_8B = ModelShape(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                        intermediate_size=14336, vocab_size=128256, model_type="llama")


def test_decode_bound_matches_design():
    assert decode_speedup_bound(SMOLLM2, s_attention=0.5, s_ffn=0.5)["bound"] == pytest.approx(1.59, abs=0.005)
    assert decode_speedup_bound(LLAMA31_8B, s_attention=0.5, s_ffn=0.5)["bound"] == pytest.approx(1.81, abs=0.005)
    assert decode_speedup_bound(SMOLLM2, s_attention=0.0, s_ffn=0.0)["bound"] == pytest.approx(1.0)


def test_routed_flops_limits():
    dense = routed_flops(SMOLLM2, None, seq_len=2048)
    assert dense["relative"] == 1.0
    zero = {"attention": 0.0, "ffn": 0.0, "per_layer": {"attention": [0.0] * 30, "ffn": [0.0] * 30}}
    assert routed_flops(SMOLLM2, zero, seq_len=2048)["relative"] == pytest.approx(1.0)
    full = {"attention": 1.0, "ffn": 1.0, "per_layer": {}}
    r = routed_flops(SMOLLM2, full, seq_len=2048)
    lf = layer_flops(SMOLLM2, context_len=1024.5)
    expected = (30 * lf["kv_proj"] + 2 * 576 * 49152) / r["dense_flops_per_token"]
    assert r["relative"] == pytest.approx(expected)
    # router overhead is counted when the router sizes are known
    with_routers = routed_flops(SMOLLM2, zero, seq_len=2048, router_rank=32, attn_groups=3, ffn_groups=12)
    assert with_routers["relative"] > 1.0
    assert with_routers["router_flops_per_token"] == 30 * 2 * ((576 * 32 + 32 * 6) + (576 * 32 + 32 * 24))


def test_per_layer_sparsity_is_used():
    half = {"attention": 0.5, "ffn": 0.5, "per_layer": {"attention": [1.0] * 15 + [0.0] * 15,
                                                         "ffn": [0.0] * 15 + [1.0] * 15}}
    mean = {"attention": 0.5, "ffn": 0.5, "per_layer": {}}
    a = routed_flops(SMOLLM2, half, seq_len=128)["relative"]
    b = routed_flops(SMOLLM2, mean, seq_len=128)["relative"]
    assert a == pytest.approx(b)  # FLOPs are linear in the per-layer execute fractions
    assert 0.0 < a < 1.0
