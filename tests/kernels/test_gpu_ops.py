"""GPU: every CuPy kernel against its PyTorch reference (``runtime/ops.py``).

Shapes: ``(B, T)`` in {(1,1), (1,7), (3,1), (2,5), (1,129)} (decode, odd prefill, batched, one
past a tile) on a tiny Llama (intermediate 96, FFN groups of 32, head groups of 2), larger SmolLM2/Llama-like tiles, and
non-contiguous inputs (a transposed activation, a row-sliced one, a transposed KV-cache view).

Tolerances, relative Frobenius error against the reference computed in fp32 on the same inputs:
fp16 1e-3 (one fp16 rounding of an fp32-accumulated result), bf16 8e-3 (bf16 has 3 fewer
mantissa bits). Attention rounds the softmax weights to the input dtype before P.V (as
FlashAttention does), so its bounds are 2e-3 / 1.5e-2. Skipped outputs must be exact zeros.

``WIDE_CUPY_VERIFY=0`` here: the first-use check must not quietly swap a wrong kernel for the
reference; ``WIDE_CUPY_DENSE_ABOVE=1.0``: large-M calls run the kernels, not cuBLAS. Each test also asserts that no call was routed to the reference unless it expects so.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

from wide_cli.runtime import cupy_ops, ops
from wide_cli.runtime.cuda import schedule
from wide_cli.runtime.cuda.launch import cuda_status
from wide_cli.runtime.cuda.registry import REGISTRY

pytestmark = pytest.mark.gpu

DEV = "cuda"
DTYPES = [torch.float16, torch.bfloat16]
TOL = {torch.float16: 1e-3, torch.bfloat16: 8e-3}
ATOL = {torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
B08_BT = [(1, 1), (1, 7), (3, 1), (2, 5), (1, 129)]


@pytest.fixture(autouse=True)
def _kernels(monkeypatch):
    why = cuda_status()
    if why is not None:
        pytest.skip(why)
    monkeypatch.setenv("WIDE_CUPY_VERIFY", "0")
    monkeypatch.setenv("WIDE_CUPY_DENSE_ABOVE", "1.0")  # always the kernels, even where cuBLAS would win


@contextlib.contextmanager
def kernels_only():
    """Fail if anything inside was routed to the PyTorch reference instead of a kernel."""
    before = dict(REGISTRY.fallback_counts())
    yield
    new = {k: v for k, v in REGISTRY.fallback_counts().items() if v != before.get(k)}
    assert not new, f"routed to the reference instead of a kernel: {new}"


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    o, r = out.float(), ref.float()
    assert torch.isfinite(o).all(), "non-finite values in the kernel output"
    return float((o - r).norm() / r.norm().clamp_min(1e-6))


def rand(*shape, dtype, seed=0) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (0.5 * torch.randn(*shape, device=DEV, generator=g)).to(dtype)


def rmask(*shape, p=0.5, seed=0) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed + 12345)
    return torch.rand(*shape, device=DEV, generator=g) < p


# ---------------------------------------------------------------------------------------------
# mask reordering kernels vs the schedule module


@pytest.mark.parametrize("M,G,p", [(1, 4, 0.5), (7, 3, 0.5), (129, 5, 0.3), (64, 8, 0.0), (5000, 12, 0.5)])
def test_reorder_kernel_matches_schedule(M, G, p):
    mask = rmask(M, G, p=p, seed=M)
    order, counts = cupy_ops.reorder(mask)
    ref_o, ref_c = schedule.reorder_mask(mask.cpu())
    assert torch.equal(order.cpu(), ref_o) and torch.equal(counts.cpu(), ref_c)
    t_mask = rmask(G, M, p=p, seed=M + 1).t()  # non-contiguous [M, G]
    order, counts = cupy_ops.reorder(t_mask)
    ref_o, ref_c = schedule.reorder_mask(t_mask.cpu())
    assert torch.equal(order.cpu(), ref_o) and torch.equal(counts.cpu(), ref_c)


def test_reorder_kernel_batched():
    mask = rmask(3, 129, 9, seed=4)  # [B, T, H]
    order, counts = cupy_ops.reorder(mask)
    ref_o, ref_c = schedule.reorder_mask(mask.cpu())
    assert torch.equal(order.cpu(), ref_o) and torch.equal(counts.cpu(), ref_c)


@pytest.mark.parametrize("M,G", [(1, 3), (33, 5), (129, 112), (1000, 7)])
def test_pack_mask_kernel(M, G):
    mask = rmask(M, G, seed=M)
    got = cupy_ops.pack_mask(mask).cpu().long() & 0xFFFFFFFF
    assert torch.equal(got, schedule.pack_mask(mask.cpu()))


# ---------------------------------------------------------------------------------------------
# GEMMs

GEMM_MN_SHAPES = {  # name: (K, N, group_size)
    "tiny_q": (64, 64, 32),
    "tiny_ffn": (64, 96, 32),
    "smol_q": (576, 576, 192),
    "llama_like": (512, 1024, 128),
}
GEMM_K_SHAPES = {
    "tiny_o": (64, 64, 32),
    "tiny_down": (96, 64, 32),
    "smol_o": (576, 576, 192),
    "llama_like": (1024, 512, 128),
}
MS = [B * T for B, T in B08_BT] + [300, 1030]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", MS)
@pytest.mark.parametrize("shape", list(GEMM_MN_SHAPES))
def test_gemm_mn(shape, M, dtype):
    K, N, g = GEMM_MN_SHAPES[shape]
    a, w, bias = (
        rand(M, K, dtype=dtype, seed=1),
        rand(N, K, dtype=dtype, seed=2),
        rand(N, dtype=dtype, seed=3),
    )
    mask = rmask(M, N // g, seed=M)
    with kernels_only():
        out = cupy_ops.gemm_mn(a, w, mask, g, bias)
    ref = ops.gemm_mn(a.float(), w.float(), mask, g, bias.float())
    assert out.shape == (M, N) and out.dtype == dtype
    assert rel(out, ref) <= TOL[dtype]
    assert (out[~ops.expand_mask(mask, g)] == 0).all(), "skipped outputs (bias included) must be exact zeros"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", MS)
@pytest.mark.parametrize("shape", ["tiny_ffn", "llama_like"])
def test_gemm_mn_swiglu(shape, M, dtype):
    K, N, g = GEMM_MN_SHAPES[shape]
    a, wg, wu = (
        rand(M, K, dtype=dtype, seed=1),
        rand(N, K, dtype=dtype, seed=2),
        rand(N, K, dtype=dtype, seed=3),
    )
    mask = rmask(M, N // g, seed=M + 5)
    with kernels_only():
        out = cupy_ops.gemm_mn_swiglu(a, wg, wu, mask, g)
    ref = ops.gemm_mn_swiglu(a.float(), wg.float(), wu.float(), mask, g)
    assert rel(out, ref) <= 2 * TOL[dtype]  # two products and the SiLU before one rounding
    assert (out[~ops.expand_mask(mask, g)] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", MS)
@pytest.mark.parametrize("shape", list(GEMM_K_SHAPES))
def test_gemm_k_ignores_skipped_channels(shape, M, dtype):
    K, N, g = GEMM_K_SHAPES[shape]
    a, w, bias = (
        rand(M, K, dtype=dtype, seed=4),
        rand(N, K, dtype=dtype, seed=5),
        rand(N, dtype=dtype, seed=6),
    )
    mask = rmask(M, K // g, seed=M + 9)
    em = ops.expand_mask(mask, g)
    a_clean = torch.where(em, a, torch.zeros((), dtype=dtype, device=DEV))
    a_poison = torch.where(em, a, torch.full((), float("nan"), dtype=dtype, device=DEV))  # never read
    with kernels_only():
        out = cupy_ops.gemm_k(a_poison, w, mask, g, bias)
    ref = ops.gemm_k(a_clean.float(), w.float(), mask, g, bias.float())
    assert rel(out, ref) <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 5, 129])
def test_all_and_no_groups(M, dtype):
    K, N, g = 512, 1024, 128
    a, w, bias = (
        rand(M, K, dtype=dtype, seed=7),
        rand(N, K, dtype=dtype, seed=8),
        rand(N, dtype=dtype, seed=9),
    )
    for p in (0.0, 1.0):
        mask = rmask(M, N // g, p=p)
        with kernels_only():
            out = cupy_ops.gemm_mn(a, w, mask, g, bias)
            outk = cupy_ops.gemm_k(a, w, mask[:, : K // g], g, bias)
        ref = ops.gemm_mn(a.float(), w.float(), mask, g, bias.float())
        if p == 0.0:
            assert (out == 0).all()
            assert torch.equal(outk, bias.expand(M, N))  # nothing executes: bias only
        else:
            assert rel(out, ref) <= TOL[dtype]
            assert (
                rel(outk, ops.gemm_k(a.float(), w.float(), mask[:, : K // g], g, bias.float())) <= TOL[dtype]
            )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [3, 129])
def test_noncontiguous_inputs(M, dtype):
    K, N, g = 512, 1024, 128
    a_t = rand(K, M, dtype=dtype, seed=10).t()  # transposed view [M, K]
    big = rand(M, K + 8, dtype=dtype, seed=11)
    a_sl = big[:, :K]  # row stride K + 8
    w_t = rand(K, N, dtype=dtype, seed=12).t()  # transposed weight view [N, K]
    mask = rmask(M, N // g, seed=13)
    for a in (a_t, a_sl):
        with kernels_only():
            out = cupy_ops.gemm_mn(a, w_t, mask, g)
            outk = cupy_ops.gemm_k(a, w_t[:, :K], mask[:, : K // g], g)
        assert rel(out, ops.gemm_mn(a.float(), w_t.float(), mask, g)) <= TOL[dtype]
        assert rel(outk, ops.gemm_k(a.float(), w_t[:, :K].float(), mask[:, : K // g], g)) <= TOL[dtype]


@pytest.mark.parametrize("M", [1, 8, 300])
def test_skipped_weights_are_not_read(M):
    """Weights of groups that no token executes are never loaded (NaN there cannot leak)."""
    dtype = torch.bfloat16
    K, N, g = 512, 1024, 128
    a, w = rand(M, K, dtype=dtype, seed=14), rand(N, K, dtype=dtype, seed=15)
    mask = rmask(M, N // g, seed=16)
    mask[:, 3] = False
    w_poison = w.clone()
    w_poison[3 * g : 4 * g] = float("nan")
    with kernels_only():
        out = cupy_ops.gemm_mn(a, w_poison, mask, g)
    assert rel(out, ops.gemm_mn(a.float(), w.float(), mask, g)) <= TOL[dtype]
    # gemm_k: reduction columns of group 2 unused by every token
    wk = rand(N, K, dtype=dtype, seed=17)
    mk = rmask(M, K // g, seed=18)
    mk[:, 2] = False
    wk_poison = wk.clone()
    wk_poison[:, 2 * g : 3 * g] = float("nan")
    with kernels_only():
        outk = cupy_ops.gemm_k(a, wk_poison, mk, g)
    assert rel(outk, ops.gemm_k(a.float(), wk.float(), mk, g)) <= TOL[dtype]


def test_auto_dispatch_picks_cublas_for_dense_masks(monkeypatch):
    """At large M a mask that skips little goes to cuBLAS on the masked input: same result."""
    monkeypatch.setenv("WIDE_CUPY_DENSE_ABOVE", "0.6")
    M, K, N, g = 1024, 512, 1024, 128
    a, w = rand(M, K, dtype=torch.bfloat16, seed=50), rand(N, K, dtype=torch.bfloat16, seed=51)
    for p, path in ((0.9, "cuBLAS on the masked input"), (0.2, "kernel")):
        mask = rmask(M, N // g, p=p, seed=52)
        before = REGISTRY.dispatch_counts().get(f"gemm_mn: {path}", 0)
        out = cupy_ops.gemm_mn(a, w, mask, g)
        assert REGISTRY.dispatch_counts()[f"gemm_mn: {path}"] == before + 1
        assert rel(out, ops.gemm_mn(a.float(), w.float(), mask, g)) <= TOL[torch.bfloat16]
        assert (out[~ops.expand_mask(mask, g)] == 0).all()
    mk = rmask(M, K // g, p=0.5, seed=53)  # random: every 16-row fragment is live -> cuBLAS
    a_nan = torch.where(ops.expand_mask(mk, g), a, torch.full((), float("nan"), dtype=a.dtype, device=DEV))
    out = cupy_ops.gemm_k(a_nan, w[:, :K], mk, g)
    assert REGISTRY.dispatch_counts()["gemm_k: cuBLAS on the masked input"] >= 1
    assert rel(out, ops.gemm_k(a.float(), w[:, :K].float(), mk, g)) <= TOL[torch.bfloat16]


def test_unsupported_shapes_fall_back_to_the_reference():
    a, w = rand(20, 64, dtype=torch.float16), rand(48, 64, dtype=torch.float16)
    mask = rmask(20, 6)  # group size 8: no tensor-core tile for it
    before = sum(REGISTRY.fallback_counts().values())
    out = cupy_ops.gemm_mn(a, w, mask, 8)
    assert sum(REGISTRY.fallback_counts().values()) == before + 1
    assert torch.equal(out, ops.gemm_mn(a, w, mask, 8))
    a32, w32 = a.float(), w.float()  # fp32 has no kernel
    assert torch.equal(cupy_ops.gemm_mn(a32, w32, mask, 8), ops.gemm_mn(a32, w32, mask, 8))


# ---------------------------------------------------------------------------------------------
# attention

ATTN = {"tiny": (4, 2, 16, 2), "smol": (9, 3, 64, 3), "llama": (8, 2, 128, 4)}  # H, Hkv, d, heads/group


def _head_mask(B, T, H, hg, seed):
    return rmask(B, T, H // hg, seed=seed).repeat_interleave(hg, dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T", B08_BT)
@pytest.mark.parametrize("cfg", list(ATTN))
@pytest.mark.parametrize("q_offset,window,pad", [(0, None, False), (3, None, True), (2, 4, True)])
def test_attention_prefill(cfg, B, T, dtype, q_offset, window, pad):
    H, Hkv, d, hg = ATTN[cfg]
    S = q_offset + T
    k_cache = rand(B, Hkv, S + 4, d, dtype=dtype, seed=20)
    v_cache = rand(B, Hkv, S + 4, d, dtype=dtype, seed=21)
    k, v = k_cache[:, :, :S].transpose(1, 2), v_cache[:, :, :S].transpose(1, 2)  # [B, S, Hkv, d] views
    q = rand(B, T, H, d, dtype=dtype, seed=22)
    hm = _head_mask(B, T, H, hg, seed=B * 100 + T)
    kv = torch.ones(B, S, dtype=torch.bool, device=DEV)
    if pad:
        kv[-1, : min(2, S)] = False  # left padding of the last row (its first queries see nothing)
    scale = d**-0.5
    with kernels_only():
        out = cupy_ops.attention_prefill(
            q, k, v, hm, key_valid=kv, q_offset=q_offset, scale=scale, window=window
        )
    ref = ops.attention_prefill(
        q.float(), k.float(), v.float(), hm, key_valid=kv, q_offset=q_offset, scale=scale, window=window
    )
    assert out.shape == (B, T, H, d) and out.dtype == dtype
    assert rel(out, ref) <= ATOL[dtype]
    assert (out[~hm] == 0).all(), "skipped (token, head) pairs must be exact zeros"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cfg", list(ATTN))
def test_attention_prefill_dense_mask_none(cfg, dtype):
    H, Hkv, d, _ = ATTN[cfg]
    B, T = 2, 200
    q, k, v = (
        rand(B, T, H, d, dtype=dtype, seed=1),
        rand(B, T, Hkv, d, dtype=dtype, seed=2),
        rand(B, T, Hkv, d, dtype=dtype, seed=3),
    )
    with kernels_only():
        out = cupy_ops.attention_prefill(q, k, v, None, scale=d**-0.5)
    ref = ops.attention_prefill(q.float(), k.float(), v.float(), None, scale=d**-0.5)
    assert rel(out, ref) <= ATOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("S", [1, 7, 129, 1500])
@pytest.mark.parametrize("cfg", list(ATTN))
@pytest.mark.parametrize("window", [None, 64])
def test_attention_decode(cfg, B, S, dtype, window):
    H, Hkv, d, hg = ATTN[cfg]
    k_cache, v_cache = (
        rand(B, Hkv, S + 3, d, dtype=dtype, seed=30),
        rand(B, Hkv, S + 3, d, dtype=dtype, seed=31),
    )
    q = rand(B, H, d, dtype=dtype, seed=32)
    hm = _head_mask(B, 1, H, hg, seed=S + B)[:, 0]
    hm[0, : H // Hkv] = False  # row 0 skips every query head of KV head 0
    kv = torch.ones(B, S, dtype=torch.bool, device=DEV)
    if B > 1 and S > 2:
        kv[1, :2] = False
    # KV-head skipping: poison the cache of (row 0, KV head 0); it must never be read
    k_poison, v_poison = k_cache.clone(), v_cache.clone()
    k_poison[0, 0], v_poison[0, 0] = float("nan"), float("nan")
    with kernels_only():
        out = cupy_ops.attention_decode(q, k_poison, v_poison, hm, kv, scale=d**-0.5, window=window)
    ref = ops.attention_decode(
        q.float(), k_cache.float(), v_cache.float(), hm, kv, scale=d**-0.5, window=window
    )
    assert out.shape == (B, H, d)
    assert rel(out, ref) <= ATOL[dtype]
    assert (out[~hm] == 0).all()


def test_attention_decode_long_context():
    """32k keys, Llama-3.1-8B head shape, half the KV heads skipped."""
    H, Hkv, d = 32, 8, 128
    B, S = 1, 32768
    k_cache, v_cache = (
        rand(B, Hkv, S, d, dtype=torch.bfloat16, seed=40),
        rand(B, Hkv, S, d, dtype=torch.bfloat16, seed=41),
    )
    q = rand(B, H, d, dtype=torch.bfloat16, seed=42)
    hm = rmask(B, Hkv, seed=43).repeat_interleave(H // Hkv, dim=-1)
    kv = torch.ones(B, S, dtype=torch.bool, device=DEV)
    with kernels_only():
        out = cupy_ops.attention_decode(q, k_cache, v_cache, hm, kv, scale=d**-0.5)
    ref = ops.attention_decode(q.float(), k_cache.float(), v_cache.float(), hm, kv, scale=d**-0.5)
    assert rel(out, ref) <= ATOL[torch.bfloat16]


# ---------------------------------------------------------------------------------------------
# the backend end to end (runtime with the CuPy kernels vs the reference backend: same answers)


def _tiny_routed(seed=0):
    from wide_cli.models.tiny import tiny_model
    from wide_cli.routing import RoutingConfig, attach_routers

    model = tiny_model("llama", seed=seed, intermediate_size=96)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = attach_routers(model, RoutingConfig(attn_group_size=2, ffn_group_size=32))
    state.set_mode("argmax")
    return model


@pytest.mark.parametrize("B,T", B08_BT)
def test_runtime_cupy_matches_reference_backend(B, T):
    from wide_cli.runtime.cupy_backend import CupyBackend
    from wide_cli.runtime.engine import Runtime
    from wide_cli.runtime.reference import ReferenceBackend

    model = _tiny_routed()
    st = model.wide_routing
    steps = 3
    g = torch.Generator().manual_seed(B * 1000 + T)
    forced = {
        (i, m): torch.rand(B, T + steps, st.groups(m), generator=g) >= 0.5
        for i in range(st.shape.num_layers)
        for m in ("attention", "ffn")
    }
    ids = torch.randint(5, 100, (B, T + steps), generator=g)

    def run(backend) -> torch.Tensor:
        rt = Runtime.from_model(model, backend=backend, dtype=torch.float16)
        rt.forced = dict(forced)
        cache = rt.new_cache(B, T + steps)
        outs = [rt.step(ids[:, :T], None, cache, logits="all")]  # prefill (T = 1: a decode step)
        for s in range(steps):
            outs.append(rt.step(ids[:, T + s : T + s + 1], None, cache, logits="all"))
        return torch.cat(outs, dim=1)

    ref = run(ReferenceBackend(device=DEV))
    with kernels_only():
        got = run(CupyBackend(device=DEV))
    assert rel(got, ref) <= 1e-2  # fp16 through two routed layers and the LM head
