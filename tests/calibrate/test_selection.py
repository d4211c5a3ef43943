"""Static-width selection and router initialisation from group importance: hand-checked values."""

from __future__ import annotations

import math

import pytest
import torch

from wide_cli.calibrate.selection import router_init_bias, static_width_keep


def test_static_width_drops_the_least_important_groups_per_layer():
    imp = torch.tensor([[4.0, 1.0, 3.0, 2.0], [1.0, 2.0, 3.0, 4.0]])
    keep = static_width_keep(imp, 0.5)  # 4 of 8 groups: 2 per layer
    assert keep.dtype == torch.bool and keep.shape == (2, 4)
    assert keep.tolist() == [[True, False, True, False], [False, False, True, True]]


def test_static_width_spreads_the_remainder_to_the_least_important_next_group():
    # target 0.375 of 8 groups = 3 drops: 1 per layer, the third where the next-lowest group
    # is least important *relative to its layer's total* (layer 1: 1/10 < layer 0: 30/100)
    imp = torch.tensor([[10.0, 30.0, 30.0, 30.0], [0.5, 1.0, 4.0, 4.5]])
    keep = static_width_keep(imp, 0.375)
    assert (~keep).sum().item() == 3
    assert keep.tolist() == [[False, True, True, True], [False, False, True, True]]


@pytest.mark.parametrize("target", [0.0, 0.1, 0.25, 0.5, 0.9, 1.0])
def test_static_width_meets_the_target_as_closely_as_groups_allow(target):
    imp = torch.rand(5, 8, generator=torch.Generator().manual_seed(0)) + 0.1
    dropped = (~static_width_keep(imp, target)).sum().item()
    assert dropped == round(target * 5 * 8)


def test_router_init_bias_layout_and_offset():
    imp = torch.tensor([[1.0, 1.0, 1.0]])  # equal importance: z = 0, only the offset
    b = router_init_bias(imp, 0.25)
    assert b.shape == (1, 6) and b.dtype == torch.float32
    d = math.log(0.75 / 0.25)  # execute - skip = logit(1 - skip_rate)
    assert torch.allclose(b, torch.tensor([[d / 2, -d / 2] * 3]))


def test_router_init_bias_prefers_skipping_unimportant_groups():
    imp = torch.tensor([[1.0, math.e, math.e**2]])  # log-importance 0, 1, 2: z = -1, 0, 1
    b = router_init_bias(imp, 0.5, strength=2.0).reshape(1, 3, 2)
    d = b[..., 0] - b[..., 1]  # execute - skip per group
    assert torch.allclose(d, torch.tensor([[-2.0, 0.0, 2.0]]), atol=1e-6)


def test_router_init_bias_one_group_and_clamped_rate():
    b = router_init_bias(torch.tensor([[3.0], [0.5]]), 1.0)  # clamped to 1 - 1e-3
    d = math.log(1e-3 / (1 - 1e-3))
    assert torch.allclose(b, torch.tensor([[d / 2, -d / 2]] * 2), atol=1e-5)


def test_pipeline_glue_uses_each_modules_target_and_keeps_unrouted_modules_whole():
    from wide_cli.calibrate.statistics import GroupStatistics
    from wide_cli.pipeline.routers import static_keep_from_statistics
    from wide_cli.pipeline.settings import Settings
    from wide_cli.routing.config import GroupLayout

    g = torch.Generator().manual_seed(0)
    stats = GroupStatistics(torch.rand(3, 8, generator=g) + 0.1, torch.rand(3, 64, generator=g) + 0.1, 10)
    layout = GroupLayout(attn_group_size=2, ffn_group_size=8, attn_groups=4, ffn_groups=8, kv_aligned=True)
    s = Settings().replace("routing", method="static-width", sparsity=0.5, route_attention=False)
    keep = static_keep_from_statistics(stats, s, layout)
    assert all(keep[(i, "attention")].all() for i in range(3))
    ffn = torch.stack([keep[(i, "ffn")] for i in range(3)])
    assert torch.equal(ffn, static_width_keep(stats.group_importance("ffn", 8), 0.5))
