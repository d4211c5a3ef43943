"""The GPU backend's dense paths compute exactly the routed operators: cuBLAS plus the mask for
GEMMs where the kernels lose, PyTorch's fused attention with skipped heads zeroed for long
prefills. They are pure PyTorch, so they are checked here on a CPU against ``runtime/ops.py``."""

from __future__ import annotations

import pytest
import torch

from wide_cli.runtime import ops
from wide_cli.runtime.cupy_ops import masked_dense_k, masked_dense_mn, sdpa_attention_prefill


def _close(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all()
    assert (out.float() - ref.float()).abs().max().item() <= tol * max(1.0, ref.float().abs().max().item())


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("H,Hkv", [(4, 4), (6, 2)])
@pytest.mark.parametrize("setting", ["causal", "padding", "window", "chunk"])
def test_sdpa_prefill_equals_the_reference(dtype, tol, H, Hkv, setting):
    g = torch.Generator().manual_seed(0)
    B, T, d = 3, 7, 16
    q_offset = 5 if setting == "chunk" else 0
    S = q_offset + T
    q = torch.randn(B, T, H, d, generator=g).to(dtype)
    k = torch.randn(B, S, Hkv, d, generator=g).to(dtype)
    v = torch.randn(B, S, Hkv, d, generator=g).to(dtype)
    head_mask = torch.rand(B, T, H, generator=g) > 0.4
    key_valid = None
    if setting == "padding":  # left padding: row 2's first queries see no key at all
        key_valid = torch.ones(B, S, dtype=torch.bool)
        key_valid[1, :2] = False
        key_valid[2, :4] = False
    window = 3 if setting == "window" else None
    kw = {"key_valid": key_valid, "q_offset": q_offset, "scale": d**-0.5, "window": window}
    out = sdpa_attention_prefill(q, k, v, head_mask, **kw)
    ref = ops.attention_prefill(q, k, v, head_mask, **kw)
    _close(out, ref, tol)
    assert (out[~head_mask] == 0).all()
    if setting == "padding":
        assert (out[2, :4] == 0).all()  # padding queries: exact zeros, not NaN
    _close(sdpa_attention_prefill(q, k, v, None, **kw), ops.attention_prefill(q, k, v, None, **kw), tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("M", [1, 3, 9])
def test_masked_dense_gemms_equal_the_reference(dtype, tol, M):
    g = torch.Generator().manual_seed(2)
    K, N, gs = 48, 64, 16
    a = torch.randn(M, K, generator=g).to(dtype)
    w, w2 = (torch.randn(N, K, generator=g).to(dtype) for _ in range(2))
    wk = torch.randn(N, N, generator=g).to(dtype)
    bias = torch.randn(N, generator=g).to(dtype)
    mask = torch.rand(M, N // gs, generator=g) > 0.5
    _close(masked_dense_mn(a, w, None, mask, gs, bias), ops.gemm_mn(a, w, mask, gs, bias), tol)
    _close(masked_dense_mn(a, w, w2, mask, gs), ops.gemm_mn_swiglu(a, w, w2, mask, gs), tol)
    h = torch.randn(M, N, generator=g).to(dtype)
    ref = ops.gemm_k(h, wk, mask, gs, bias)
    h[~ops.expand_mask(mask, gs)] = float("nan")  # skipped channels are never read
    _close(masked_dense_k(h, wk, mask, gs, bias), ref, tol)
