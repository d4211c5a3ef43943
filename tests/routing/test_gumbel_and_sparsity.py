"""Gumbel STE, temperature schedule, deterministic inference, measured sparsity and its loss."""

import pytest
import torch

from wide_cli.models.tiny import tiny_model
from wide_cli.routing import RoutingConfig, attach_routers
from wide_cli.routing.gumbel import (
    argmax_execute,
    hard_gumbel_execute,
    skip_fraction,
    sparsity_loss,
    temperature_at,
)
from wide_cli.routing.model import router_parameters


def test_hard_gumbel_values_are_exactly_binary_with_gradients():
    logits = torch.randn(3, 5, 7, 2, requires_grad=True)
    ex = hard_gumbel_execute(logits, tau=2.0, generator=torch.Generator().manual_seed(0))
    assert ex.shape == (3, 5, 7)
    assert set(ex.detach().unique().tolist()) <= {0.0, 1.0}
    (ex * torch.arange(7.0)).sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_hard_gumbel_frequency_follows_logits():
    """P(execute) = sigmoid(l0 - l1) for the hard sample, whatever the temperature."""
    l0 = torch.tensor([1.0, -1.0, 0.0])
    logits = torch.stack([l0, torch.zeros(3)], -1).expand(20000, 3, 2)
    ex = hard_gumbel_execute(logits, tau=0.5, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(ex.mean(0), torch.sigmoid(l0), atol=0.015, rtol=0)


def test_temperature_schedule_endpoints():
    assert temperature_at(0, 100, 5.0, 0.5) == 5.0
    assert temperature_at(99, 100, 5.0, 0.5) == 0.5
    assert temperature_at(49, 99, 5.0, 0.5) == pytest.approx(2.75)
    assert temperature_at(0, 1, 5.0, 0.5) == 0.5


def test_argmax_ties_execute():
    logits = torch.tensor([[1.0, 1.0], [0.0, 2.0], [3.0, -1.0]])
    assert argmax_execute(logits).tolist() == [True, False, True]


def test_gradients_reach_router_parameters_and_backbone_frozen():
    model = tiny_model("llama")
    state = attach_routers(model, RoutingConfig(attn_group_size=2, ffn_group_size=32))
    for n, p in model.named_parameters():
        p.requires_grad_(".router_" in n)
    state.set_mode("gumbel")
    ids = torch.randint(0, 128, (2, 8))
    out = model(input_ids=ids, labels=ids)
    s = state.measured_s_hat()
    (out.loss + 20 * sparsity_loss(s, {"attention": 0.5, "ffn": 0.5}, False)).backward()
    params = router_parameters(model)
    assert len(params) == 2 * 2 * 4  # layers x modules x (2 weights + 2 biases)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in params)
    assert all(p.grad is None for n, p in model.named_parameters() if ".router_" not in n)


def test_inference_is_deterministic():
    model = tiny_model("llama")
    attach_routers(model, RoutingConfig(attn_group_size=2, ffn_group_size=32))
    ids = torch.randint(0, 128, (2, 8))
    with torch.no_grad():
        a, b = model(ids).logits, model(ids).logits
    assert torch.equal(a, b)


def test_measured_sparsity_counts_skips_over_valid_tokens_only():
    model = tiny_model("llama")
    state = attach_routers(model, RoutingConfig(attn_group_size=2, ffn_group_size=32))
    ids = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :4] = 0  # left padding of row 1
    state.trace = []
    counter = state.start_counting()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    trace, state.trace = state.trace, None
    valid = mask.bool()
    per = {"attention": [], "ffn": []}
    for _layer, module, ex in trace:
        skipped = ((~ex) & valid.unsqueeze(-1)).sum().item()
        per[module].append(skipped / (valid.sum().item() * ex.shape[-1]))
    s = counter.summary()
    assert s["per_layer"]["attention"] == pytest.approx(per["attention"])
    assert s["per_layer"]["ffn"] == pytest.approx(per["ffn"])
    assert s["attention"] == pytest.approx(sum(per["attention"]) / 2)
    assert s["total"] == pytest.approx((s["attention"] + s["ffn"]) / 2)


def test_padding_does_not_change_real_tokens():
    """Padding for the routed model: left padding leaves real tokens' logits unchanged."""
    model = tiny_model("llama")
    attach_routers(model, RoutingConfig(attn_group_size=2, ffn_group_size=32))
    short = torch.randint(3, 128, (1, 4), generator=torch.Generator().manual_seed(6))
    padded = torch.cat([torch.full((1, 5), 2), short], 1)
    mask = torch.cat([torch.zeros(1, 5, dtype=torch.long), torch.ones(1, 4, dtype=torch.long)], 1)
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        a = model(short).logits
        b = model(input_ids=padded, attention_mask=mask, position_ids=pos).logits[:, 5:]
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_skip_fraction_and_loss_forms():
    ex = torch.tensor([[[1.0, 0.0], [0.0, 0.0]]])  # [1, 2, 2]
    assert skip_fraction(ex, None).item() == pytest.approx(0.75)
    assert skip_fraction(ex, torch.tensor([[True, False]])).item() == pytest.approx(0.5)
    s = {"attention": torch.tensor(0.6), "ffn": torch.tensor(0.2)}
    assert sparsity_loss(s, {"attention": 0.5, "ffn": 0.5}, False).item() == pytest.approx(0.1)
    assert sparsity_loss(s, {"attention": 0.7, "ffn": 0.3}, True).item() == pytest.approx(0.1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gumbel_noise_is_drawn_in_fp32_for_half_precision_logits(dtype):
    """Router logits are fp16/bf16 under autocast; the uniform noise must still be fp32 (the
    same draws as for fp32 logits), or fp16 rounds ``clamp_min(1e-20)`` to 0 and makes NaN."""
    router = torch.nn.Linear(16, 2 * 64)
    hidden = torch.randn(4, 32, 16)
    with torch.autocast("cpu", dtype=dtype):
        logits = router(hidden).view(4, 32, 64, 2)
    assert logits.dtype == dtype
    ex = hard_gumbel_execute(logits, tau=0.5, generator=torch.Generator().manual_seed(3))
    u = torch.rand(logits.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float32)
    gumbels = -torch.log((-torch.log(u.clamp_min(1e-20))).clamp_min(1e-20))
    ref = ((logits.float() + gumbels)[..., 0] >= (logits.float() + gumbels)[..., 1]).to(dtype)
    assert ex.dtype == dtype
    assert torch.equal(ex, ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gumbel_decisions_stay_finite_when_the_uniform_draw_is_exactly_zero(dtype, monkeypatch):
    """A uniform draw of exactly 0 on both logits of a decision (14 times in 1000 fp16 draws of
    262k decisions) must not make a NaN decision or gradient."""
    real_rand = torch.rand
    monkeypatch.setattr(torch, "rand", lambda *a, **k: real_rand(*a, **k).zero_())
    logits = torch.zeros(2, 3, 4, 2, dtype=dtype, requires_grad=True)
    ex = hard_gumbel_execute(logits, tau=0.5, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(ex).all() and set(ex.detach().float().unique().tolist()) <= {0.0, 1.0}
    ex.sum().backward()
    assert torch.isfinite(logits.grad).all()
