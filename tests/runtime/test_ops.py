"""Each routed operator (the ``ops.py`` reference and the ``cpu`` work-skipping version) against a
naive per-token loop, over many shapes and a non-contiguous input (a fast path must never give
a different answer).

atol 1e-5, rtol 1e-5 (fp32): both sides compute the same dot products; only summation order differs.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from wide_cli.runtime import cpu_attention, cpu_plan, cpu_proj, ops

# the cpu backend's operators under the names of the ops.py contract
CPU_OPS = SimpleNamespace(
    gemm_mn=cpu_proj.gemm_mn, gemm_k=cpu_proj.gemm_k, gemm_mn_swiglu=cpu_proj.gemm_mn_swiglu,
    attention_prefill=cpu_attention.attention_prefill, attention_decode=cpu_attention.attention_decode,
)  # fmt: skip
IMPLS = {"reference": ops, "cpu": CPU_OPS}
SHAPES_M = [1, 7, 16, 17, 129]  # decode, odd prefill, both sides of cpu_plan.SMALL_M, long prefill
ATOL = 1e-5
RTOL = 1e-5  # fp32 rounding of dot products of length 24 with values up to ~40


def _mask(M, G, p, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(M, G, generator=g) < p


def _noncontig(x):
    """The same values as a transposed-back (non-contiguous) view."""
    y = x.t().contiguous().t()
    assert not y.is_contiguous() or y.shape[0] == 1
    return y


def naive_gemm_mn(a, w, mask, g, bias):
    M, N = a.shape[0], w.shape[0]
    out = torch.zeros(M, N, dtype=torch.float64)
    for m in range(M):
        for j in range(N // g):
            if mask is None or mask[m, j]:
                cols = slice(j * g, (j + 1) * g)
                out[m, cols] = a[m].double() @ w[cols].double().t() + (0 if bias is None else bias[cols].double())
    return out


def naive_gemm_k(a, w, mask, g, bias):
    M, K = a.shape
    out = torch.zeros(M, w.shape[0], dtype=torch.float64)
    for m in range(M):
        for j in range(K // g):
            if mask is None or mask[m, j]:
                cols = slice(j * g, (j + 1) * g)
                out[m] += a[m, cols].double() @ w[:, cols].double().t()
        if bias is not None:
            out[m] += bias.double()
    return out


def naive_swiglu(a, wg, wu, mask, g):
    gate = naive_gemm_mn(a, wg, mask, g, None)
    up = naive_gemm_mn(a, wu, mask, g, None)
    return torch.nn.functional.silu(gate) * up


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("M", SHAPES_M)
@pytest.mark.parametrize("p", [0.0, 0.5, 0.9, 1.0])  # 0.9: a prefill dense enough to run dense, then mask
@pytest.mark.parametrize("noncontig", [False, True])
def test_gemms_match_naive(impl, M, p, noncontig):
    mod = IMPLS[impl]
    torch.manual_seed(M)
    K, N, g = 24, 32, 8
    a = torch.randn(M, K)
    if noncontig:
        a = _noncontig(a)
    w = torch.randn(N, K)
    bias = torch.randn(N)
    mask = _mask(M, N // g, p, seed=M)
    torch.testing.assert_close(mod.gemm_mn(a, w, mask, g, bias).double(), naive_gemm_mn(a, w, mask, g, bias), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(mod.gemm_mn(a, w, None, g).double(), naive_gemm_mn(a, w, None, g, None), atol=ATOL, rtol=RTOL)
    wk = torch.randn(N, K)
    mk = _mask(M, K // g, p, seed=M + 1)
    torch.testing.assert_close(mod.gemm_k(a, wk, mk, g, bias).double(), naive_gemm_k(a, wk, mk, g, bias), atol=ATOL, rtol=RTOL)
    wu = torch.randn(N, K)
    torch.testing.assert_close(
        mod.gemm_mn_swiglu(a, w, wu, mask, g).double(), naive_swiglu(a, w, wu, mask, g), atol=ATOL, rtol=RTOL
    )


def test_prefill_plan_runs_dense_then_masks_only_above_the_executed_fraction():
    G, M = 12, 40  # more tokens than cpu_plan.SMALL_M
    mask = torch.zeros(M, G, dtype=torch.bool)
    k = int(cpu_plan.DENSE_MASKED_FRACTION * M * G)
    mask.view(-1)[:k] = True
    assert cpu_plan.skip_plan(mask) == ("sparse", [(0, G)], False)
    mask.view(-1)[k - 1] = False
    assert cpu_plan.skip_plan(mask) == ("sparse", [], False)
    assert cpu_plan.skip_plan(torch.ones(M, G, dtype=torch.bool))[0] == "dense"
    assert cpu_plan.skip_plan(torch.zeros(M, G, dtype=torch.bool))[0] == "none"


def test_group_counts_are_the_executing_tokens_of_each_group_over_every_leading_axis():
    mask = torch.tensor([[[True, False, True], [True, False, False]], [[False, False, True], [True, False, True]]])
    assert cpu_plan.group_counts(mask) == [3, 0, 3]  # [B, T, H] as a head mask
    assert cpu_plan.mask_state(mask, cpu_plan.group_counts(mask)) == cpu_plan.mask_state(mask) == "sparse"
    # a group that no token executes: never dense-then-mask, always gathered by the native kernels
    assert not cpu_plan.dense_then_mask(mask) and cpu_plan.gather_pays(mask.reshape(-1, 3))


def test_tiles_gather_below_their_own_executed_fraction_or_when_a_group_is_unused():
    G, M = 10, 40
    mask = torch.zeros(M, G, dtype=torch.bool)
    k = int(cpu_plan.AMX_DENSE_MASKED_FRACTION * M * G)
    mask.view(-1)[:k] = True  # every group used by some token
    assert not cpu_plan.gather_pays(mask)
    mask.view(-1)[k - 1] = False
    assert cpu_plan.gather_pays(mask)
    full_but_one = torch.ones(M, G, dtype=torch.bool)
    full_but_one[:, 3] = False  # 0.9 of the pairs, but group 3 runs for no token
    assert cpu_plan.gather_pays(full_but_one)


@pytest.mark.parametrize("p", [0.5, 0.9])  # 0.9 on 129 tokens: the dense GEMMs, then the mask
def test_grouped_ffn_matches_naive(p):
    M, D, F, g = 129, 24, 32, 8
    torch.manual_seed(3)
    x, wg, wu, wd = torch.randn(M, D), torch.randn(F, D), torch.randn(F, D), torch.randn(D, F)
    mask = _mask(M, F // g, p, seed=4)
    mask[0] = True  # every group executed by some token
    gu = cpu_proj.float_proj(cpu_proj.grouped_gate_up(wg, wu, g), "n")
    down = cpu_proj.float_proj(wd, "k", g)
    dense_plan = cpu_plan.skip_plan(mask)[1] == [(0, F // g)]
    assert dense_plan == (p == 0.9)
    want = naive_swiglu(x, wg, wu, mask, g) @ wd.double().t()
    torch.testing.assert_close(cpu_proj.ffn_proj(x, gu, down, mask).double(), want, atol=1e-4, rtol=1e-5)


def test_prefill_plan_gathers_when_some_group_has_no_token():
    mask = torch.ones(40, 8, dtype=torch.bool)
    mask[:, 3] = False  # 7/8 executed, group 3 by nobody (a static keep mask)
    assert cpu_plan.skip_plan(mask) == ("sparse", [], False)


def test_skipped_outputs_are_exact_zeros_bias_included():
    """A skipped group's bias must not leak into its outputs (they stay exactly zero)."""
    a, w, b = torch.randn(5, 8), torch.randn(8, 8), torch.full((8,), 3.0)
    mask = torch.tensor([[True, False]] * 5)
    for mod in IMPLS.values():
        out = mod.gemm_mn(a, w, mask, 4, b)
        assert torch.equal(out[:, 4:], torch.zeros(5, 4))


def test_gemm_k_ignores_values_on_skipped_channels():
    a, w = torch.randn(3, 8), torch.randn(4, 8)
    mask = torch.tensor([[True, False]] * 3)
    a2 = a.clone()
    a2[:, 4:] = 1e6
    for mod in IMPLS.values():
        torch.testing.assert_close(mod.gemm_k(a, w, mask, 4), mod.gemm_k(a2, w, mask, 4))


def test_group_size_must_divide():
    with pytest.raises(ValueError, match="multiple of group_size"):
        ops.gemm_mn(torch.randn(2, 4), torch.randn(6, 4), None, 4)


# ----------------------------------------------------------------------------------------------
# attention


def naive_attention(q, k, v, head_mask, key_valid, q_offset, scale, window):
    """q [B,T,H,d], k/v [B,S,Hkv,d]: per (b, t, h) softmax over visible keys."""
    B, T, H, d = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    out = torch.zeros(B, T, H, d, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            slot = q_offset + t
            keys = [
                j
                for j in range(S)
                if j <= slot and (key_valid is None or key_valid[b, j]) and (window is None or slot - j < window)
            ]
            if not keys:
                continue
            for h in range(H):
                if head_mask is not None and not head_mask[b, t, h]:
                    continue
                kv = h // (H // Hkv)
                kk = k[b, keys, kv].double()
                s = (kk @ q[b, t, h].double()) * scale
                out[b, t, h] = torch.softmax(s, 0) @ v[b, keys, kv].double()
    return out


ATTN_CASES = [
    # B, T, H, Hkv, q_offset, extra keys beyond the block, pad, window
    (1, 1, 4, 2, 0, 0, 0, None),
    (1, 7, 4, 2, 0, 0, 0, None),
    (3, 1, 4, 4, 5, 0, 2, None),
    (2, 5, 6, 2, 3, 0, 2, None),
    (1, 129, 4, 1, 0, 0, 0, None),
    (2, 9, 4, 2, 0, 0, 3, 4),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", ATTN_CASES, ids=lambda c: f"B{c[0]}T{c[1]}H{c[2]}kv{c[3]}off{c[4]}")
@pytest.mark.parametrize("p", [0.5, 0.9, 1.0, 0.0])  # 0.9: causal blocks run dense, then mask
def test_attention_prefill_matches_naive(impl, case, p):
    mod = IMPLS[impl]
    B, T, H, Hkv, off, _, pad, window = case
    d = 8
    S = off + T
    torch.manual_seed(T * 7 + H)
    q = torch.randn(B, T, H, d)
    cache_k = torch.randn(B, Hkv, S + 3, d)  # the cache layout; k is a strided view of it
    cache_v = torch.randn(B, Hkv, S + 3, d)
    k, v = cache_k[:, :, :S].transpose(1, 2), cache_v[:, :, :S].transpose(1, 2)
    key_valid = torch.ones(B, S, dtype=torch.bool)
    key_valid[0, :pad] = False  # left padding of row 0
    # group-level routing expanded to heads (groups of 2 heads where possible)
    gs = 2 if H % 2 == 0 else 1
    hm = _mask(B * T, H // gs, p, seed=T).view(B, T, H // gs).repeat_interleave(gs, -1)
    scale = 1 / math.sqrt(d)
    got = mod.attention_prefill(q, k, v, hm, key_valid=key_valid, q_offset=off, scale=scale, window=window)
    want = naive_attention(q, k, v, hm, key_valid, off, scale, window)
    torch.testing.assert_close(got.double(), want, atol=ATOL, rtol=RTOL)
    # noncontiguous queries
    got2 = mod.attention_prefill(
        _noncontig(q.reshape(B * T, H * d)).view(B, T, H, d), k, v, hm, key_valid=key_valid, q_offset=off,
        scale=scale, window=window,
    )
    torch.testing.assert_close(got2, got, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("B,H,Hkv,S,gs", [(1, 4, 2, 1, 2), (1, 9, 3, 17, 3), (3, 4, 2, 9, 1), (8, 6, 2, 5, 2), (2, 6, 2, 7, 2)])
@pytest.mark.parametrize("p", [0.5, 1.0, 0.0])
def test_attention_decode_matches_naive(impl, B, H, Hkv, S, gs, p):
    """gs=1 with H/Hkv=2 straddles nothing; gs=2 with 6 heads/2 KV heads (3 per KV) straddles."""
    mod = IMPLS[impl]
    d = 8
    torch.manual_seed(S + B)
    q = torch.randn(B, H, d)
    kc, vc = torch.randn(B, Hkv, S + 4, d), torch.randn(B, Hkv, S + 4, d)
    key_valid = torch.ones(B, S, dtype=torch.bool)
    if B > 1:
        key_valid[1, : S // 2] = False
    hm = _mask(B, H // gs, p, seed=S).repeat_interleave(gs, -1)
    scale = 1 / math.sqrt(d)
    got = mod.attention_decode(q, kc, vc, hm, key_valid, scale=scale)
    want = naive_attention(
        q[:, None], kc[:, :, :S].transpose(1, 2), vc[:, :, :S].transpose(1, 2), hm[:, None], key_valid, S - 1, scale, None
    )[:, 0]
    torch.testing.assert_close(got.double(), want, atol=ATOL, rtol=RTOL)


def test_decode_reads_no_cache_for_fully_skipped_kv_heads():
    """A KV head whose query heads all skip is never read: poisoning it changes nothing."""
    B, H, Hkv, S, d = 1, 4, 2, 6, 8
    q = torch.randn(B, H, d)
    kc, vc = torch.randn(B, Hkv, S, d), torch.randn(B, Hkv, S, d)
    hm = torch.tensor([[True, True, False, False]])
    valid = torch.ones(B, S, dtype=torch.bool)
    base = cpu_attention.attention_decode(q, kc, vc, hm, valid, scale=0.3)
    kc[:, 1] = float("nan")
    vc[:, 1] = float("nan")
    torch.testing.assert_close(cpu_attention.attention_decode(q, kc, vc, hm, valid, scale=0.3), base)


def test_group_token_lists_is_a_stable_partition():
    mask = _mask(13, 3, 0.5, seed=1)
    order, counts = ops.group_token_lists(mask)
    for j in range(3):
        ex = order[j, : counts[j]].tolist()
        assert ex == mask[:, j].nonzero().flatten().tolist()
        assert sorted(order[j].tolist()) == list(range(13))
