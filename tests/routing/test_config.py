"""Group-size validation (a group size must divide the heads / channels) and routing settings."""

import warnings

import pytest
import torch

from wide_cli.errors import ConfigError
from wide_cli.models.arch import model_shape
from wide_cli.models.tiny import tiny_config, tiny_model
from wide_cli.routing import RoutingConfig, attach_routers, resolve_groups


def b01_model():
    return tiny_model("llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                      intermediate_size=96)


def test_b01a_group_aligned_with_kv_groups_runs_without_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = attach_routers(b01_model(), RoutingConfig(attn_group_size=3, ffn_group_size=32))
    assert state.layout.attn_groups == 2 and state.layout.kv_aligned


def test_b01b_straddling_group_warns_and_matches_reference():
    model = b01_model()
    with pytest.warns(UserWarning, match="6 query heads share 2 KV heads"):
        state = attach_routers(model, RoutingConfig(attn_group_size=2, ffn_group_size=32))
    assert not state.layout.kv_aligned
    attn = model.model.layers[0].self_attn
    assert tuple(attn.k_proj.weight.shape) == (32, 96) and tuple(attn.v_proj.weight.shape) == (32, 96)
    ids = torch.randint(0, 128, (1, 7))
    dense = b01_model()
    for i in range(2):
        state.forced[(i, "attention")] = torch.ones(3, dtype=torch.bool)
        state.forced[(i, "ffn")] = torch.ones(3, dtype=torch.bool)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, dense(ids).logits, atol=1e-5, rtol=0)


def test_b01c_group_size_not_dividing_heads_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"attn-group-size 4 does not divide 6 query heads \(2 KV heads\)"):
        resolve_groups(RoutingConfig(attn_group_size=4, ffn_group_size=32), model_shape(b01_model().config))


def test_b01d_ffn_group_size_not_dividing_is_a_clear_error():
    with pytest.raises(ConfigError, match="ffn-group-size 64 does not divide intermediate size 96"):
        resolve_groups(RoutingConfig(attn_group_size=3, ffn_group_size=64), model_shape(b01_model().config))


@pytest.mark.parametrize("bad", [1.0, -0.1, 1.5])
def test_sparsity_outside_range(bad):
    with pytest.raises(ConfigError, match=f"sparsity {bad} is outside"):
        RoutingConfig(sparsity=bad)


def test_per_module_targets_both_or_neither():
    with pytest.raises(ConfigError, match="set together"):
        RoutingConfig(sparsity_attention=0.6)
    cfg = RoutingConfig(sparsity_attention=0.6, sparsity_ffn=0.3)
    assert cfg.target_for("attention") == 0.6 and cfg.target_for("ffn") == 0.3


def test_dynamic_depth_is_one_group_spanning_the_width():
    layout = resolve_groups(RoutingConfig(method="dynamic-depth"), model_shape(tiny_config()))
    assert (layout.attn_groups, layout.ffn_groups) == (1, 1)
    assert (layout.attn_group_size, layout.ffn_group_size) == (4, 128)


def test_unknown_method():
    with pytest.raises(ConfigError, match="unknown method 'sparse'"):
        RoutingConfig(method="sparse")


@pytest.mark.parametrize(("heads", "kv", "expected"), [(4, 2, 2), (9, 3, 3), (6, 6, 1), (8, 1, 8)])
def test_attention_group_size_defaults_to_heads_per_kv_head(heads, kv, expected):
    """Without --attn-group-size every GQA/MHA model gets one group per KV head (tiny-llama's
    4 heads / 2 KV heads used to fail with the fixed default 3)."""
    cfg = tiny_config("llama", num_attention_heads=heads, num_key_value_heads=kv, hidden_size=16 * heads,
                      head_dim=16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layout = resolve_groups(RoutingConfig(), model_shape(cfg))
    assert (layout.attn_group_size, layout.attn_groups, layout.kv_aligned) == (expected, heads // expected, True)
