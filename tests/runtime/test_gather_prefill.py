"""The gather prefill kernels (``runtime/cpu_gather.py``, ``kernels/cpu_prefill_gather.c``): the
tile packing against its definition (everywhere), the kernels against fp32 products of the same
bf16 operands, and the cpu backend's prefill on them against the reference backend, once per ISA
(AMX tiles, AVX512-BF16; each skips with the reason on a CPU without it).

Tolerances: bf16 operands are exact in fp32 and both ISAs accumulate in fp32, so a kernel's fp32
output differs from the fp32 product by summation order (1e-5 of the output range); the FFN rounds
its gated activations to bf16 as the reference does, where a different exp can round the other
way (2 ** -7 of the range).
"""

from __future__ import annotations

import pytest
import torch

from wide_cli.runtime import cpu_gather, cpu_proj
from wide_cli.runtime.engine import Runtime


@pytest.fixture(params=["amx", "avx512"])
def gather_isa(request, monkeypatch):
    """Each ISA of the kernels in turn (``WIDE_CPU_GATHER``), skipped where this CPU lacks it."""
    monkeypatch.setenv("WIDE_CPU_GATHER", request.param)
    cpu_gather.isa.cache_clear()
    if not cpu_gather.ready():
        cpu_gather.isa.cache_clear()
        pytest.skip(f"this CPU (or OS) does not run the {request.param} kernels: the cpu backend's prefill runs other paths")
    yield request.param
    cpu_gather.isa.cache_clear()


def test_pack_rows_is_the_tile_layout():
    N, K = 32, 64
    w = (torch.arange(N * K, dtype=torch.float32).reshape(N, K) % 251).to(torch.bfloat16)  # exact in bf16
    P = cpu_gather.pack_rows(w)
    assert P.shape == (2, 2, 16, 16, 2) and P.dtype == torch.bfloat16 and P.is_contiguous()
    for nb, kb, kp, c, p in [(0, 0, 0, 0, 0), (1, 1, 15, 15, 1), (0, 1, 3, 7, 1), (1, 0, 9, 2, 0)]:
        assert P[nb, kb, kp, c, p] == w[16 * nb + c, 32 * kb + 2 * kp + p]


def test_pack_groups_packs_each_reduction_group_as_rows():
    K, N, g = 96, 16, 32
    w_t = (torch.arange(K * N, dtype=torch.float32).reshape(K, N) % 241).to(torch.bfloat16)
    P = cpu_gather.pack_groups(w_t, g)
    assert P.shape == (3, 1, 1, 16, 16, 2)
    for j in range(3):
        assert torch.equal(P[j], cpu_gather.pack_rows(w_t[j * g : (j + 1) * g].t().contiguous()))


@pytest.mark.parametrize("shape", [(24, 64), (32, 48)])
def test_packing_refuses_widths_off_the_tiles(shape):
    with pytest.raises(ValueError, match="tile packing needs"):
        cpu_gather.pack_rows(torch.zeros(shape))
    with pytest.raises(ValueError, match="tile packing needs"):
        cpu_gather.pack_groups(torch.zeros(shape[1], shape[0]), 32)


def _mask(M, G, p, seed):
    if p is None:
        return None
    return torch.rand(M, G, generator=torch.Generator().manual_seed(seed)) < p


def _expand(mask, M, G, g):
    return torch.ones(M, G * g) if mask is None else mask.repeat_interleave(g, 1).float()


@pytest.mark.parametrize("M", [17, 32, 100, 300])
@pytest.mark.parametrize("p", [None, 0.0, 0.4, 1.0])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_routed_rows_match_the_masked_product(M, p, out_dtype, gather_isa):
    G, g, K = 3, 48, 96  # a group of 48 rows: one 32-column block and a 16-column tail
    gen = torch.Generator().manual_seed(M)
    x = torch.randn(M, K, generator=gen).bfloat16()
    w = torch.randn(G * g, K, generator=gen).bfloat16()
    bias = torch.randn(G * g, generator=gen)
    mask = _mask(M, G, p, M + 1)
    out = torch.full((M, G * g), 7.0, dtype=out_dtype)
    assert cpu_gather.rows(cpu_gather.pack_rows(w), x, out, mask, g, bias)
    e = _expand(mask, M, G, g).bool()
    want = x.float() @ w.float().t() + bias
    tol = (2.0**-8 if out_dtype == torch.bfloat16 else 1e-5) * float(want.abs().max())
    torch.testing.assert_close(out.float()[e], want[e], atol=tol, rtol=0)
    assert torch.equal(out.float()[~e], torch.full_like(out.float()[~e], 7.0))  # skipped pairs untouched


@pytest.mark.parametrize("M", [17, 100, 300])
@pytest.mark.parametrize("p", [None, 0.0, 0.3, 1.0])
def test_routed_reduction_groups_accumulate_the_masked_product(M, p, gather_isa):
    G, g, N = 4, 32, 48
    gen = torch.Generator().manual_seed(M + 7)
    a = torch.randn(M, G * g, generator=gen).bfloat16()
    w_t = torch.randn(G * g, N, generator=gen).bfloat16()
    mask = _mask(M, G, p, M)
    out = torch.randn(M, N, generator=gen)
    want = out + (a.float() * _expand(mask, M, G, g)) @ w_t.float()
    assert cpu_gather.acc(cpu_gather.pack_groups(w_t, g), a, out, mask)
    torch.testing.assert_close(out, want, atol=1e-5 * float(want.abs().max()), rtol=0)


def _ffn_weights(G, g, D, seed):
    gen = torch.Generator().manual_seed(seed)
    wg, wu = (torch.randn(G * g, D, generator=gen) * 0.2).bfloat16(), (torch.randn(G * g, D, generator=gen) * 0.2).bfloat16()
    wd = (torch.randn(D, G * g, generator=gen) * 0.2).bfloat16()
    return wg, wu, wd


@pytest.mark.parametrize("M", [17, 64, 257, 600])  # one, several and partial windows of 256 tokens
@pytest.mark.parametrize("p", [None, 0.0, 0.5, 1.0])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_routed_ffn_matches_the_masked_gated_product(M, p, act, gather_isa):
    from wide_cli.runtime import ops

    G, g, D = 3, 64, 96
    wg, wu, wd = _ffn_weights(G, g, D, M)
    x = torch.randn(M, D, generator=torch.Generator().manual_seed(M + 3)).bfloat16()
    mask = _mask(M, G, p, M + 5)
    out = torch.full((M, D), float("nan"))
    macs = cpu_gather.ffn(cpu_gather.pack_rows(cpu_proj.grouped_gate_up(wg, wu, g)),
                       cpu_gather.pack_groups(wd.t().contiguous(), g), x, out, mask, act)  # fmt: skip
    assert macs is not None
    h = ops.gate_act(x.float() @ wg.float().t(), act) * (x.float() @ wu.float().t()) * _expand(mask, M, G, g)
    want = h.bfloat16().float() @ wd.float().t()
    torch.testing.assert_close(out, want, atol=2.0**-7 * float(want.abs().max()), rtol=0)
    executed = M * G if mask is None else int(mask.sum())
    if mask is None or p == 1.0:
        assert macs == 3 * executed * g * D  # every pair of every block: no padding counted
    if p == 0.0:
        assert macs == 0 and torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_down_product_groups_tokens_that_skip_the_same_groups(dtype, gather_isa):
    # every other token skips group 0: in token order every block of rows runs group 0's down
    # product for half its tokens on zeros; sorted by skipped groups (kernels/cpu_prefill_gather.c,
    # ffn_window_order) the 32 skipping tokens share their blocks, and the down product executes
    # exactly the executed pairs
    if dtype == torch.float32 and not cpu_gather.f32_ready():
        pytest.skip("the fp32 kernels run only where the bf16 ones run on AVX512-BF16")
    from wide_cli.runtime import ops

    M, G, g, D = 64, 2, 32, 64
    wg, wu, wd = _ffn_weights(G, g, D, 7)
    x = torch.randn(M, D, generator=torch.Generator().manual_seed(8)).bfloat16()
    mask = torch.ones(M, G, dtype=torch.bool)
    mask[::2, 0] = False
    out = torch.full((M, D), float("nan"))
    macs = cpu_gather.ffn(cpu_gather.pack_rows(cpu_proj.grouped_gate_up(wg, wu, g), dtype),
                          cpu_gather.pack_groups(wd.t().contiguous(), g, dtype), x.to(dtype), out, mask)
    executed = int(mask.sum())
    assert macs == 3 * executed * g * D
    h = ops.gate_act(x.float() @ wg.float().t(), "silu") * (x.float() @ wu.float().t()) * _expand(mask, M, G, g)
    want = (h.bfloat16().float() if dtype == torch.bfloat16 else h) @ wd.float().t()
    torch.testing.assert_close(out, want, atol=2.0**-7 * float(want.abs().max()), rtol=0)


@pytest.mark.parametrize("M", [40, 300])
def test_two_threads_give_the_same_ffn_as_one(M, gather_isa):
    G, g, D = 4, 32, 64
    wg, wu, wd = _ffn_weights(G, g, D, 1)
    Pgu, Pd = cpu_gather.pack_rows(cpu_proj.grouped_gate_up(wg, wu, g)), cpu_gather.pack_groups(wd.t().contiguous(), g)
    x = torch.randn(M, D, generator=torch.Generator().manual_seed(2)).bfloat16()
    mask = _mask(M, G, 0.5, 3)
    n = torch.get_num_threads()
    outs = []
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            out = torch.empty(M, D)
            assert cpu_gather.ffn(Pgu, Pd, x, out, mask) is not None
            outs.append(out)
    finally:
        torch.set_num_threads(n)
    assert torch.equal(outs[0], outs[1])  # a block's skipped pairs add exact zeros, whatever the split


def test_the_kernels_check_their_operands(gather_isa):
    P = cpu_gather.pack_rows(torch.zeros(32, 64))
    with pytest.raises(ValueError, match="activations"):
        cpu_gather.rows(P, torch.zeros(20, 64), torch.zeros(20, 32), None, 16)  # fp32 activations
    with pytest.raises(ValueError, match="out"):
        cpu_gather.rows(P, torch.zeros(20, 64).bfloat16(), torch.zeros(20, 31), None, 16)
    with pytest.raises(ValueError, match="mask"):
        cpu_gather.rows(P, torch.zeros(20, 64).bfloat16(), torch.zeros(20, 32), torch.ones(20, 3, dtype=torch.bool), 16)


def test_amx_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("WIDE_CPU_GATHER", "off")
    cpu_gather.isa.cache_clear()
    try:
        assert not cpu_gather.ready()
    finally:
        monkeypatch.delenv("WIDE_CPU_GATHER")
        cpu_gather.isa.cache_clear()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "gemma3"])
@pytest.mark.parametrize("weights", ["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("p_skip", [0.0, 0.5, 1.0])
def test_prefill_on_the_tiles_matches_reference(kind, weights, p_skip, routed_model, random_masks, monkeypatch, gather_isa):
    calls = []

    def spy(name, real):
        def run(*a, **k):
            r = real(*a, **k)
            if r is not None and r is not False:
                calls.append(name)  # the kernel took the call
            return r

        return run

    for name in ("rows", "acc", "ffn"):
        monkeypatch.setattr(cpu_gather, name, spy(name, getattr(cpu_gather, name)))
    model = routed_model(kind)
    T = 70
    ids = torch.randint(5, 100, (2, T), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, T, dtype=torch.bool)
    mask[1, :9] = False  # left padding
    forced = random_masks(model, 2, T, p_skip, seed=2)
    ref = Runtime.from_model(model, backend="reference", weight_format=weights)
    cpu = Runtime.from_model(model, backend="cpu", weight_format=weights)
    ref.forced = cpu.forced = forced
    want, got = ref.forward(ids, mask), cpu.forward(ids, mask)
    if p_skip == 0.5 and (weights != "fp32" or cpu_gather.f32_ready()):
        assert {"rows", "acc", "ffn"} <= set(calls)
    # bf16: both compute in bf16 and differ in summation order and where partial sums round;
    # fp32: in summation order only
    rel = 1e-5 if weights == "fp32" else 0.02
    torch.testing.assert_close(got[mask], want[mask], atol=rel * float(want.abs().max()), rtol=0)
    assert cpu.stats.summary() == ref.stats.summary()


def test_prefill_counts_what_the_tiles_execute(routed_model, random_masks, gather_isa):
    model = routed_model("llama")
    T = 64
    ids = torch.randint(5, 100, (1, T), generator=torch.Generator().manual_seed(1))
    counts = {}
    for name, p in (("amx", 0.5), ("dense", 0.0)):
        rt = Runtime.from_model(model, backend="cpu", weight_format="bf16")
        rt.forced = random_masks(model, 1, T, p, seed=3)
        rt.counter.macs = 0
        rt.forward(ids)
        counts[name] = rt.counter.macs
    # half the groups skipped: the gathered products count half; the FFN's down product counts
    # the blocks' live groups in full (every group is live in a block of 32 random tokens)
    assert 0.5 * counts["dense"] < counts["amx"] < 0.9 * counts["dense"]


@pytest.mark.parametrize("case", [
    # B, T, H, H_kv, d, q_offset, window, p (None: every head), left padding of row 1
    (1, 100, 9, 3, 64, 0, None, None, 0),
    (2, 70, 4, 2, 32, 0, None, 0.5, 5),
    (1, 64, 4, 1, 64, 30, None, 0.3, 0),  # a prefill chunk after 30 cached slots
    (1, 90, 4, 4, 64, 0, 16, 0.7, 0),  # sliding window
    (2, 300, 6, 2, 128, 0, None, 0.5, 3),
])  # fmt: skip
def test_routed_attention_on_the_tiles_matches_the_reference(case, gather_isa):
    from wide_cli.runtime import ops

    B, T, H, Hkv, d, off, window, p, pad = case
    S = off + T
    gen = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(B, n, h, d, generator=gen).bfloat16() for n, h in ((T, H), (S, Hkv), (S, Hkv)))
    hm = None if p is None else torch.rand(B, T, H, generator=gen) < p
    kv = None
    if pad:
        kv = torch.ones(B, S, dtype=torch.bool)
        kv[1, :pad] = False
    out, pairs = cpu_gather.attention(q, k, v, hm, key_valid=kv, q_offset=off, scale=d**-0.5, window=window)
    want = ops.attention_prefill(q.float(), k.float(), v.float(), hm, key_valid=kv, q_offset=off, scale=d**-0.5,
                                 window=window)  # fmt: skip
    # the probabilities are rounded to bf16 for the P V product (and for their normaliser)
    torch.testing.assert_close(out.float(), want, atol=0.02, rtol=0)
    if hm is not None:
        assert torch.equal(out[~hm], torch.zeros_like(out[~hm]))  # skipped heads are exact zeros
    # (query, key) pairs: each executing query sees its causal (windowed, valid) keys
    vis = ops.key_visibility(B, T, S, off, kv, window, torch.device("cpu"))  # [B, T, S]
    ex = torch.ones(B, T, H, dtype=torch.bool) if hm is None else hm
    assert pairs == int((vis[:, :, None, :] & ex[..., None]).sum())


def test_attention_declines_what_it_does_not_take(gather_isa):
    q = torch.zeros(1, 20, 2, 48).bfloat16()  # head dim off the tile multiple
    k = torch.zeros(1, 20, 1, 48).bfloat16()
    assert cpu_gather.attention(q, k, k, None, key_valid=None, q_offset=0, scale=1.0, window=None) is None
    assert cpu_gather.attention(q.float(), k.float(), k.float(), None, key_valid=None, q_offset=0, scale=1.0,
                             window=None) is None  # fmt: skip


def test_an_unknown_isa_choice_is_named(monkeypatch):
    monkeypatch.setenv("WIDE_CPU_GATHER", "tiles")
    cpu_gather.isa.cache_clear()
    try:
        with pytest.raises(ValueError, match="WIDE_CPU_GATHER='tiles': expected auto, amx, avx512 or off"):
            cpu_gather.isa()
    finally:
        monkeypatch.delenv("WIDE_CPU_GATHER")
        cpu_gather.isa.cache_clear()


@pytest.mark.parametrize("M", [17, 100, 300])
@pytest.mark.parametrize("p", [None, 0.0, 0.5, 1.0])
def test_fp32_kernels_match_the_fp32_products(M, p, gather_isa):
    if not cpu_gather.f32_ready():
        pytest.skip("the fp32 gather kernels run where the bf16 ones run on AVX512-BF16 only")
    G, g, D = 3, 64, 96
    gen = torch.Generator().manual_seed(M)
    x = torch.randn(M, D, generator=gen)
    mask = _mask(M, G, p, M + 2)
    e = _expand(mask, M, G, g)
    w = torch.randn(G * g, D, generator=gen)
    out = torch.full((M, G * g), 7.0)
    assert cpu_gather.rows(cpu_gather.pack_rows(w, torch.float32), x, out, mask, g)
    want = x @ w.t()
    torch.testing.assert_close(out[e.bool()], want[e.bool()], atol=1e-5 * float(want.abs().max()), rtol=0)
    assert bool((out[~e.bool()] == 7.0).all())
    a = torch.randn(M, G * g, generator=gen)
    w_t = torch.randn(G * g, D, generator=gen)
    acc = torch.zeros(M, D)
    assert cpu_gather.acc(cpu_gather.pack_groups(w_t, g, torch.float32), a, acc, mask)
    want = (a * e) @ w_t
    torch.testing.assert_close(acc, want, atol=1e-5 * float(want.abs().max()), rtol=0)
    wg, wu, wd = (torch.randn(G * g, D, generator=gen) / 8 for _ in range(3))
    gu = cpu_proj.grouped_gate_up(wg, wu, g)
    y = torch.empty(M, D)
    P, Pd = cpu_gather.pack_rows(gu, torch.float32), cpu_gather.pack_groups(wd, g, torch.float32)  # wd: [G g, D]
    assert cpu_gather.ffn(P, Pd, x, y, mask, "silu") is not None
    want = (torch.nn.functional.silu(x @ wg.t()) * (x @ wu.t()) * e) @ wd
    torch.testing.assert_close(y, want, atol=1e-5 * float(want.abs().max()) + 1e-6, rtol=0)


def test_fp32_packing_is_its_tile_layout():
    w = torch.arange(32 * 64, dtype=torch.float32).reshape(32, 64)
    P = cpu_gather.pack_rows(w, torch.float32)
    assert P.shape == (2, 4, 16, 16) and P.dtype == torch.float32
    for nb, kb, k, c in [(0, 0, 0, 0), (1, 3, 15, 15), (0, 2, 5, 9)]:
        assert P[nb, kb, k, c] == w[16 * nb + c, 16 * kb + k]
    w_t = torch.arange(64 * 16, dtype=torch.float32).reshape(64, 16)
    Pg = cpu_gather.pack_groups(w_t, 32, torch.float32)
    assert Pg.shape == (2, 1, 2, 16, 16)
    for j in range(2):
        assert torch.equal(Pg[j], cpu_gather.pack_rows(w_t[j * 32 : (j + 1) * 32].t().contiguous(), torch.float32))
