"""The native elementwise ops of bf16 prefill (``runtime/cpu_prefill.py``,
``kernels/cpu_prefill_ops.c``) against the engine's PyTorch formulas, on the library this machine
builds and on its portable C twin. The sums (norm statistics, stand-ins) run in another order, so
a value on a bf16 rounding boundary may land one step away (two after Llama's norm multiplies the
rounded normalised value by a weight above 1): at most a few elements."""

from __future__ import annotations

import pytest
import torch

from wide_cli.routing.router import apply_standin
from wide_cli.runtime import cpu_native, cpu_prefill
from wide_cli.runtime.engine import apply_rope, rms_norm


@pytest.fixture(params=["native", "portable"])
def lib(request, monkeypatch):
    try:
        built = cpu_native.load(cpu_native.build(portable=request.param == "portable"))
    except (RuntimeError, OSError) as e:
        pytest.skip(f"the native library does not build here: {e}")
    monkeypatch.setattr(cpu_prefill, "_lib", lambda: built)
    return built


def _close_in_bf16(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal, except for a few elements at most two bf16 steps apart."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    diff = (got.float() - want.float()).abs()
    step = torch.maximum(got.float().abs(), want.float().abs()).clamp_min(1e-30) * 2.0**-6  # two bf16 steps
    assert bool((diff <= step).all()), float((diff / step).max())
    assert int((diff > 0).sum()) <= max(3, want.numel() // 500)


@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("D", [64, 67, 576])
def test_rms_norm_matches_the_engine(lib, gemma, D):
    g = torch.Generator().manual_seed(D)
    x = (torch.randn(40, D, generator=g) * 3).bfloat16()
    w = 1 + torch.randn(D, generator=g) if gemma else torch.randn(D, generator=g).bfloat16()  # Gemma: fp32 1 + w
    _close_in_bf16(cpu_prefill.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6))
    # a strided view (q / k norms read heads of a projection's output)
    xs = torch.randn(40, 2 * D, generator=g).bfloat16()[:, :D]
    _close_in_bf16(cpu_prefill.rms_norm(xs, w, 1e-6), rms_norm(xs, w, 1e-6))


@pytest.mark.parametrize("d", [32, 64, 40])
def test_rope_matches_the_engine_in_place(lib, d):
    from wide_cli.runtime.engine import rope_tables_for

    B, T, H = 2, 30, 3
    g = torch.Generator().manual_seed(d)
    qkv = torch.randn(B, T, H * d + 16, generator=g).bfloat16()  # q rows inside a wider projection output
    x = qkv[..., : H * d].view(B, T, H, d)
    pos = torch.arange(T).expand(B, T) + torch.tensor([[0], [5]])
    cos, sin = rope_tables_for(pos, 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d), 1.0, torch.bfloat16)
    want = apply_rope(x.clone(), cos, sin)
    rest = qkv[..., H * d :].clone()
    got = cpu_prefill.rope_(x, cos, sin)
    assert got is x
    _close_in_bf16(x.contiguous(), want)
    assert torch.equal(qkv[..., H * d :], rest)  # nothing outside the rotated rows moves


@pytest.mark.parametrize("standins", [False, True])
def test_residual_adds_the_standins_of_the_skipped_groups(lib, standins):
    B, T, D, G = 2, 25, 96, 4
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(B, T, D, generator=g).bfloat16(), torch.randn(B, T, D, generator=g).bfloat16()
    ex = torch.rand(B, T, G, generator=g) < 0.5 if standins else None
    st = torch.randn(G, D, generator=g) if standins else None
    want = apply_standin(x + y, ex, st) if standins else x + y
    got = cpu_prefill.residual(x, y.clone(), ex, st)
    _close_in_bf16(got, want)


def test_ops_decline_what_they_do_not_take(lib):
    x = torch.randn(20, 64)  # fp32: the engine's fp32 path runs
    assert cpu_prefill.rms_norm(x, torch.ones(64), 1e-6) is None
    assert cpu_prefill.residual(x, x.clone(), None, None) is None
    q = torch.randn(1, 20, 2, 64).bfloat16().transpose(1, 2).transpose(1, 2).contiguous().transpose(2, 3)
    assert cpu_prefill.rope_(q, torch.ones(1, 20, 1, 64).bfloat16(), torch.ones(1, 20, 1, 64).bfloat16()) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("D, G", [(64, 3), (67, 12), (576, 5)])
def test_router_decisions_match_the_fp32_affine_map(lib, dtype, D, G):
    # logits computed in float64 are the definition; the kernel's fp32 sums may flip only a logit
    # within fp32 rounding of zero, which these well-separated values never are
    B, T = 2, 23  # not a multiple of the kernel's 4-token blocks
    g = torch.Generator().manual_seed(D + G)
    x = torch.randn(B, T, D, generator=g).to(dtype)
    w, b = torch.randn(G, D, generator=g), torch.randn(G, generator=g)
    logits = x.double() @ w.double().t() + b.double()
    got = cpu_prefill.router(x, w, b)
    assert got is not None and got.shape == (B, T, G) and got.dtype == torch.bool
    sure = logits.abs() > 1e-3 * (x.double().abs() @ w.double().abs().t())
    assert torch.equal(got[sure], (logits >= 0)[sure])


def test_router_rows_follow_their_strides(lib):
    # a [M, D] view into wider rows (the residual stream is contiguous, but a view must not be
    # read as if it were)
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(30, 80, generator=g).bfloat16()
    x = wide[:, :64]
    w, b = torch.randn(4, 64, generator=g), torch.randn(4, generator=g)
    assert torch.equal(cpu_prefill.router(x, w, b), cpu_prefill.router(x.contiguous(), w, b))
    assert cpu_prefill.router(x.t(), torch.randn(4, 30), b) is None  # columns, not rows
