"""Weight formats of the cpu backend (fp32, bf16, int8 and int4 weight-only) against the reference
backend, the quantizers' error bounds, the bytes a routed step reads, and quantized exports.

Tolerances: both sides of a bf16/int8 comparison compute with bf16 activations (8 significant
bits: every rounding is off by up to 2^-9 relative), in a different order (fused QKV, per-group
GEMMs, the int8 kernel's per-group bf16 outputs summed in fp32 vs one bf16 GEMM). On these 2-layer
tiny models that reaches ~1 % of the logit range (HF's own bf16 model is 1.6 % off its fp32
logits on the same models); atol is 3 % of the range for bf16. The int8 reference runs the very
same int8 values (``fake_quantize``: dequantized weights), so the tolerance covers only activation
rounding, not quantization error; int8 and int4 get 4 %: where a decode step runs natively, its
int8 / int4 x int8 kernels round the activations to int8 per block of 32, which on these 2-layer
random models reached 3.1 % (int8) and 3.3 % (int4) of the largest logit, with the prefill's
projections on PyTorch or on the gather kernels alike.
"""

from __future__ import annotations

import json

import pytest
import torch

from wide_cli.errors import CheckpointError, ConfigError
from wide_cli.quant import (
    dequantize_int4,
    dequantize_int8,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)
from wide_cli.runtime.engine import Runtime

REL_ATOL = 0.03
INT_REL_ATOL = 0.04  # int8 and int4 (see above)


def rel_atol(fmt: str) -> float:
    """The relative logit tolerance of a low-precision format (see the module docstring)."""
    return INT_REL_ATOL if fmt in ("int8", "int4") else REL_ATOL


def _prompts(lengths, seed=7):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 100, (n,), generator=g).tolist() for n in lengths]


# ----------------------------------------------------------------------------------------------
# quantizer


@pytest.mark.parametrize("group_k", [None, 16, 32])  # 32: the scheme's block
def test_int8_dequantize_error_is_at_most_half_a_step_per_group(group_k):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g) * torch.logspace(-3, 1, 48)[:, None]  # rows of very different scales
    w[3] = 0.0  # an all-zero row
    q, s = quantize_int8(w, group_k)
    G = 64 // (group_k or 64)
    assert q.dtype == torch.int8 and s.shape == (48, G) and s.dtype == torch.float32
    assert int(q.abs().max()) <= 127
    assert torch.equal(s, s.bfloat16().float())  # what the bf16 kernel multiplies with, exactly
    err = (w - dequantize_int8(q, s)).abs().reshape(48, G, -1)
    bound = s[..., None] / 2
    assert bool((err <= bound * (1 + 1e-6)).all())
    # every group uses its range: the largest |q| of a non-zero group is 127 (or 126 after rounding)
    qa = q.abs().reshape(48, G, -1).amax(-1)
    nz = w.reshape(48, G, -1).abs().amax(-1) > 0
    assert bool((qa[nz] >= 126).all()) and bool((q[3] == 0).all())


def test_int8_requantizing_dequantized_weights_is_exact():
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    q, s = quantize_int8(w, 16)
    q2, s2 = quantize_int8(dequantize_int8(q, s), 16)
    assert torch.equal(q, q2) and torch.equal(s, s2)


def _q4_0_reference(w: torch.Tensor) -> torch.Tensor:
    """llama.cpp's ``quantize_row_q4_0_ref`` dequantized, elementwise in plain Python: per block of
    32, d = (the signed value of largest magnitude) / -8, q = min(15, int(x / d + 8.5)), value
    (q - 8) d (with d rounded to bf16 here, as the scheme stores it)."""
    out = torch.empty_like(w)
    for r in range(w.shape[0]):
        for b in range(w.shape[1] // 32):
            blk = w[r, 32 * b : 32 * b + 32].tolist()
            m = max(blk, key=abs)
            d = float(torch.tensor(m / -8).bfloat16()) if m else 1.0
            for i, x in enumerate(blk):
                q = min(15, int(x / d + 8.5)) if m else 8
                out[r, 32 * b + i] = (q - 8) * d
    return out


def test_int4_layout_and_error_bound():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 96, generator=g) * torch.logspace(-3, 1, 24)[:, None]
    w[3] = 0.0  # an all-zero row
    packed, s = quantize_int4(w)
    assert packed.dtype == torch.uint8 and packed.shape == (24, 48) and s.shape == (24, 3)
    assert torch.equal(s, s.bfloat16().float()) and bool((s != 0).all())
    q = unpack_int4(packed)
    assert int(q.min()) >= -8 and int(q.max()) <= 7 and bool((q[3] == 0).all())
    # Q4_0's byte order: in block b, byte j holds channel 32b + j (low nibble) and 32b + 16 + j (high)
    assert int(packed[0, 16 + 5]) == (int(q[0, 32 + 5]) + 8) | (int(q[0, 48 + 5]) + 8) << 4
    err = (w - dequantize_int4(packed, s)).abs().reshape(24, 3, 32)
    assert bool((err <= s.abs()[..., None] * (1 + 1e-6)).all())  # half a step, or one where q clips at 7
    # the searched scale is never worse than Q4_0's single rule, block by block
    sse = (w - dequantize_int4(packed, s)).square().reshape(24, 3, 32).sum(-1)
    sse_q40 = (w - _q4_0_reference(w)).square().reshape(24, 3, 32).sum(-1)
    assert bool((sse <= sse_q40 * (1 + 1e-5) + 1e-12).all()) and float(sse.sum()) < float(sse_q40.sum())


def test_int4_with_the_q4_0_divisor_is_llama_cpp_q4_0():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    got = dequantize_int4(*quantize_int4(w, divisors=(-8.0,)))
    torch.testing.assert_close(got, _q4_0_reference(w), atol=0, rtol=0)


def test_int4_requantizing_dequantized_weights_is_exact():
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(1)) * 0.02
    v = dequantize_int4(*quantize_int4(w))
    assert torch.equal(dequantize_int4(*quantize_int4(v)), v)


def _weights_and_importance(seed=5):
    """``w [24, 128]`` of mixed row scales (an all-zero row, a row below bf16's range in one block)
    and an importance ``[128]`` spanning six decades, with a zero channel and a zero block."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(24, 128, generator=g) * torch.logspace(-3, 1, 24)[:, None]
    w[3] = 0.0
    w[4, :32] = 1e-41
    imp = torch.logspace(-3, 3, 128)[torch.randperm(128, generator=g)]
    imp[7] = 0.0
    imp[96:] = 0.0
    return w, imp


def _weighted_sse(w, v, imp):
    return ((w - v).square() * imp).reshape(w.shape[0], -1, 32).sum(-1)


@pytest.mark.parametrize("imp", [1.0, 2.0])
def test_int4_with_uniform_importance_and_no_refit_is_the_plain_rule(imp):
    w, _ = _weights_and_importance()
    plain = quantize_int4(w)
    got = quantize_int4(w, importance=torch.full((128,), imp), refit=False)
    assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1])


def test_int4_with_importance_bounds_and_beats_the_plain_rule_block_by_block():
    w, imp = _weights_and_importance()
    packed, s = quantize_int4(w, importance=imp)
    assert packed.shape == (24, 64) and s.shape == (24, 4) and s.dtype == torch.float32
    assert torch.equal(s, s.bfloat16().float()) and bool((s != 0).all()) and bool(torch.isfinite(s).all())
    q = unpack_int4(packed)
    v = dequantize_int4(packed, s)
    inside = (q > -8) & (q < 7)  # not clipped: rounding error only
    err = (w - v).abs()
    step = s.abs().repeat_interleave(32, dim=1)
    assert bool((err[inside] <= step[inside] / 2 * (1 + 1e-6) + 1e-30).all())
    assert bool((q[3] == 0).all()) and float(v[4, :32].abs().max()) == 0.0
    plain = dequantize_int4(*quantize_int4(w))
    mine, theirs = _weighted_sse(w, v, imp), _weighted_sse(w, plain, imp)
    assert bool((mine <= theirs * (1 + 1e-5) + 1e-30).all()) and float(mine.sum()) < float(theirs.sum())
    # a block of zero importance is decided by the unweighted error: never worse than the plain rule
    ones = torch.ones(128)
    assert bool((_weighted_sse(w, v, ones)[:, 3] <= _weighted_sse(w, plain, ones)[:, 3] * (1 + 1e-5) + 1e-30).all())


def test_int4_with_importance_lowers_the_output_error():
    g = torch.Generator().manual_seed(6)
    w = torch.randn(64, 256, generator=g) * 0.02
    x = torch.randn(512, 256, generator=g) * torch.logspace(-2, 1, 256)[torch.randperm(256, generator=g)]
    imp = x.square().mean(0)
    out = x @ w.T
    e_plain = float((out - x @ dequantize_int4(*quantize_int4(w)).T).square().sum())
    e_imp = float((out - x @ dequantize_int4(*quantize_int4(w, importance=imp)).T).square().sum())
    assert e_imp < 0.8 * e_plain, (e_imp, e_plain)


def test_int4_values_chosen_with_importance_are_kept_by_the_plain_rule():
    # the checkpoint reader and the runtime re-quantize dequantized values with the plain rule
    w, imp = _weights_and_importance()
    packed, s = quantize_int4(w, importance=imp)
    q = unpack_int4(packed).reshape(24, 4, 32)
    nonzero = q.abs().amax(-1) > 0
    assert bool((q.abs().amax(-1)[nonzero] >= 7).all())
    v = dequantize_int4(packed, s)
    assert torch.equal(dequantize_int4(*quantize_int4(v)), v)
    again = quantize_int4(v)
    assert torch.equal(again[0], packed) and torch.equal(again[1], s)


@pytest.mark.parametrize("bad,phrase", [
    (torch.ones(64), r"shape \(64,\), expected \[128\]"),
    (torch.ones(1, 128), r"shape \(1, 128\)"),
    (torch.ones(128, dtype=torch.int64), "dtype torch.int64"),
    (torch.full((128,), -1.0), "negative or non-finite"),
    (torch.tensor([float("nan")] + [1.0] * 127), "negative or non-finite"),
    (torch.tensor([float("inf")] + [1.0] * 127), "negative or non-finite"),
])  # fmt: skip
def test_int4_refuses_bad_importance(bad, phrase):
    with pytest.raises(ValueError, match=phrase):
        quantize_int4(torch.randn(4, 128), importance=bad)


def test_importance_is_refused_for_int8_and_for_names_the_model_lacks():
    from wide_cli.quant import int4_values_state_dict, quantize, quantize_state_dict

    with pytest.raises(ValueError, match="only int4"):
        quantize(torch.randn(4, 64), "int8", torch.ones(64))
    with pytest.raises(ValueError, match="only int4"):
        quantize_state_dict({}, attn_cols=64, ffn_group_size=32, fmt="int8", importance={})
    with pytest.raises(ValueError, match="not tensors of this model"):
        int4_values_state_dict({"a.weight": torch.zeros(2, 32)}, {"b.weight": torch.ones(32)})
    with pytest.raises(ValueError, match=r"importance of a.weight has shape \(16,\)"):
        int4_values_state_dict({"a.weight": torch.zeros(2, 32)}, {"a.weight": torch.ones(16)})


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_blocks_below_the_bf16_range_get_a_usable_scale(fmt):
    from wide_cli.quant import dequantize, quantize

    w = torch.randn(2, 64, generator=torch.Generator().manual_seed(4))
    w[0, :32] = 1e-41  # a block whose scale would round to 0 in bf16
    w[1, 32:] = 0.0
    q, s = quantize(w, fmt)
    assert bool((s != 0).all()) and bool(torch.isfinite(s).all())
    v = dequantize(q, s)
    assert bool(torch.isfinite(v).all()) and float(v[0, :32].abs().max()) == 0.0 and float(v[1, 32:].abs().max()) == 0.0


def test_int4_refuses_a_width_off_the_block():
    with pytest.raises(ValueError, match="multiple of 32, got 48"):
        quantize_int4(torch.zeros(4, 48))


# ----------------------------------------------------------------------------------------------
# each format: cpu against reference (same format), prefill (both GEMM strategies) + decode


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("p_skip", [0.0, 0.5, 1.0])
def test_cpu_format_matches_reference(fmt, p_skip, routed_model, random_masks):
    model = routed_model("qwen2")  # q/k/v biases: a bias must not leak into skipped groups
    ids = torch.tensor([p + [3] * (24 - len(p)) for p in _prompts([24, 20])])  # 24 > SMALL_M: reordering
    B, T = ids.shape
    steps = 6
    ref = Runtime.from_model(model, backend="reference", weight_format=fmt)
    cpu = Runtime.from_model(model, backend="cpu", weight_format=fmt)
    assert cpu.weight_format == ref.weight_format == fmt
    assert cpu.dtype == (torch.float32 if fmt == "fp32" else torch.bfloat16)
    ref.forced = cpu.forced = random_masks(model, B, T + steps, p_skip, seed=5)
    cr, cc = ref.new_cache(B, T + steps), cpu.new_cache(B, T + steps)
    lr, lc = ref.step(ids, None, cr), cpu.step(ids, None, cc)
    atol = 1e-4 if fmt == "fp32" else rel_atol(fmt) * float(lr.abs().max())
    torch.testing.assert_close(lc, lr, atol=atol, rtol=0)
    for _ in range(steps):
        nxt = lr.argmax(-1)[:, None]
        lr, lc = ref.step(nxt, None, cr), cpu.step(nxt, None, cc)
        torch.testing.assert_close(lc, lr, atol=atol, rtol=0)
    # batch 1 decode (the union-runs path with one token's own groups)
    cr, cc = ref.new_cache(1, T + steps), cpu.new_cache(1, T + steps)
    ref.forced = cpu.forced = random_masks(model, 1, T + steps, p_skip, seed=6)
    lr, lc = ref.step(ids[:1], None, cr), cpu.step(ids[:1], None, cc)
    for _ in range(steps):
        nxt = lr.argmax(-1)[:, None]
        lr, lc = ref.step(nxt, None, cr), cpu.step(nxt, None, cc)
        torch.testing.assert_close(lc, lr, atol=atol, rtol=0)


def test_int8_is_close_to_fp32(routed_model, random_masks):
    """The quantization error itself, on the logits: int8 (per-row / per-group scales) stays within
    the bf16 tolerance of fp32."""
    model = routed_model("llama")
    ids = torch.tensor(_prompts([12]))
    want = Runtime.from_model(model, backend="reference").forward(ids)
    got = Runtime.from_model(model, backend="cpu", weight_format="int8").forward(ids)
    torch.testing.assert_close(got, want, atol=REL_ATOL * float(want.abs().max()), rtol=0)


# ----------------------------------------------------------------------------------------------
# skipped groups read no bytes


def _group_spans(p, kind: str, j: int, cols: int, quantized: bool = False) -> list[tuple[int, int]]:
    """Byte ranges ``[start, end)`` of group ``j``'s weights in a Proj: the float tensors the
    PyTorch path reads, or (``quantized``) the int8 blocks and scales the native step reads."""
    def rng(t):
        return (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())

    if kind == "n":  # row block j*cols .. (j+1)*cols
        if quantized:
            return [rng(p.q[j * cols : (j + 1) * cols]), rng(p.s[j * cols : (j + 1) * cols])]
        return [rng(p.w[j * cols : (j + 1) * cols])]
    if quantized:
        return [rng(p.q[j]), rng(p.s[j])]
    return [rng(p.w_t[j * cols : (j + 1) * cols])]


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "int4"])
def test_skipped_groups_read_no_weight_bytes(fmt, routed_model):
    model = routed_model("llama")
    rt = Runtime.from_model(model, backend="cpu", weight_format=fmt)
    G_a, G_f = rt.meta[0].attn_groups, rt.meta[0].ffn_groups
    # layer 0: attention group 1 only, FFN groups 0 and 3; layer 1: nothing of attention, all FFN
    keep = {(0, "attention"): [False, True], (0, "ffn"): [True, False, False, True],
            (1, "attention"): [False, False], (1, "ffn"): [True] * G_f}  # fmt: skip
    assert G_a == 2 and G_f == 4
    rt.forced = {k: torch.tensor(v) for k, v in keep.items()}
    cache = rt.new_cache(1, 8)
    rt.step(torch.tensor([[5, 6, 7]]), None, cache)
    rt.counter.reset()
    rt.counter.trace = []
    rt.step(torch.tensor([[9]]), None, cache)  # one decode step, batch 1
    reads = rt.counter.trace
    rt.counter.trace = None

    def touched(span):
        a, b = span
        return sum(max(0, min(b, e) - max(a, s)) for s, e in ((s, s + n) for s, n in reads))

    expected_bytes, expected_macs = 0, 0
    D = rt.hidden_size
    for i, p in enumerate(rt.layers):
        for kind, proj, cols, mask, rows_per_group in (
            ("n", p.qkv, p.attn_cols, keep[(i, "attention")], p.attn_cols),
            ("k", p.o, p.attn_cols, keep[(i, "attention")], p.attn_cols),
            ("n", p.gu, 2 * p.ffn_group_size, keep[(i, "ffn")], 2 * p.ffn_group_size),
            ("k", p.down, p.ffn_group_size, keep[(i, "ffn")], p.ffn_group_size),
        ):
            for j, on in enumerate(mask):
                spans = _group_spans(proj, kind, j, cols)
                size = sum(e - s for s, e in spans)
                got = sum(touched(s) for s in spans)
                assert got == (size if on else 0), (fmt, i, kind, j, on, got, size)
                if on:
                    expected_bytes += size
                    expected_macs += rows_per_group * D if kind == "n" else cols * proj.N
        # K/V rows are always read (every token's K/V is cached, B06)
        kv = p.qkv.w[p.q_rows :]
        expected_bytes += kv.numel() * kv.element_size()
        expected_macs += kv.shape[0] * D
    head = rt.head
    expected_bytes += head.w.numel() * head.w.element_size()
    expected_macs += head.N * D
    assert sum(n for _, n in reads) == expected_bytes == rt.counter.weight_bytes
    assert rt.counter.macs == expected_macs


def test_executed_macs_of_a_dense_step_match_the_weights(routed_model):
    model = routed_model("llama")
    rt = Runtime.from_model(model, backend="cpu", routing=False)
    rt.step(torch.tensor([[5]]), None, rt.new_cache(1, 4))
    n_weights = sum(p.numel() for n, p in model.named_parameters()
                    if n.endswith("proj.weight") or n == "lm_head.weight")  # fmt: skip
    assert rt.counter.macs == n_weights
    assert rt.counter.attn_macs == sum(m.num_heads * m.head_dim * 2 for m in rt.meta)  # one key each


# ----------------------------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_formats_refuse_widths_the_kernels_cannot_take(fmt, routed_model):
    model = routed_model("llama", fgs=16)  # FFN groups of 16 channels: the blocks are 32 wide
    with pytest.raises(ConfigError, match=f"{fmt} weights need .*multiples of 32.*down_proj.*has 16"):
        Runtime.from_model(model, backend="cpu", weight_format=fmt)


def test_unknown_and_conflicting_formats_are_refused(routed_model):
    model = routed_model("llama")
    with pytest.raises(ConfigError, match="unknown weight format 'int2'"):
        Runtime.from_model(model, backend="cpu", weight_format="int2")
    with pytest.raises(ConfigError, match="--weights int8 computes in bfloat16"):
        Runtime.from_model(model, backend="cpu", weight_format="int8", dtype=torch.float32)


def test_cli_weights_flag(tiny_export):
    from typer.testing import CliRunner

    from wide_cli.cli.app import app, main

    def gen(*extra):
        r = CliRunner().invoke(app, ["generate", str(tiny_export), "-p", "hello", "--threads", "1", "--json",
                                     "--max-new-tokens", "4", "--ignore-eos", *extra], catch_exceptions=False)  # fmt: skip
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)

    assert gen()["weights"] == "fp32"
    d = gen("--weights", "int8")
    assert d["weights"] == "int8" and d["dtype"] == "bfloat16" and len(d["tokens"][0]) == 4
    assert gen("--weights", "bf16")["dtype"] == "bfloat16"
    d = gen("--weights", "int4")
    assert d["weights"] == "int4" and d["dtype"] == "bfloat16" and len(d["tokens"][0]) == 4
    assert main(["generate", str(tiny_export), "-p", "x", "--weights", "int2"]) == 2


# ----------------------------------------------------------------------------------------------
# quantized exports


def _quantized_export(model, path, write_export, fmt="int8"):
    """Write ``model`` as an fp32 export, then as an ``fmt`` (int8 / int4) export at ``path``."""
    from wide_cli.export import export_model
    from wide_cli.models.tiny import char_tokenizer

    write_export(model, path.parent / "fp32")
    wc = json.loads((path.parent / "fp32" / "wide_config.json").read_text())
    wc = {k: wc[k] for k in ("method", "routing", "layout", "measured_sparsity", "source_model")}
    export_model(model, char_tokenizer(), path, wide_config=wc, weight_format=fmt)
    return path


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_export_round_trip(fmt, routed_model, write_export, tmp_path):
    from safetensors.torch import load_file

    model = routed_model("llama")
    path = _quantized_export(model, tmp_path / fmt, write_export, fmt)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["weight_format"] == fmt
    assert json.loads((path / "wide_config.json").read_text())["weight_format"]["format"] == fmt
    st = load_file(str(path / "model.safetensors"))
    down = st["model.layers.0.mlp.down_proj.weight"]
    assert down.dtype == (torch.int8 if fmt == "int8" else torch.uint8)
    assert down.shape == ((64, 128) if fmt == "int8" else (64, 64))  # int4: two per byte
    scale = st["model.layers.0.mlp.down_proj.weight_scale"]
    assert scale.shape == (64, 128 // 32) and scale.dtype == (torch.float32 if fmt == "int8" else torch.bfloat16)
    assert st["model.layers.0.self_attn.q_proj.weight_scale"].shape == (64, 64 // 32)
    ratio = (path / "model.safetensors").stat().st_size / (tmp_path / "fp32" / "model.safetensors").stat().st_size
    assert ratio < (0.4 if fmt == "int8" else 0.25), ratio
    rt = Runtime.from_export(path)
    assert rt.weight_format == fmt and rt.dtype == torch.bfloat16
    want = Runtime.from_model(model, backend="cpu", weight_format=fmt)
    # same quantized values as quantizing the float model in memory
    for a, b in zip(rt.layers, want.layers):
        for pa, pb in ((a.qkv, b.qkv), (a.o, b.o), (a.gu, b.gu), (a.down, b.down)):
            assert torch.equal(pa.q, pb.q) and torch.equal(pa.s, pb.s)
    ids = torch.tensor(_prompts([9]))
    torch.testing.assert_close(rt.forward(ids), want.forward(ids), atol=0, rtol=0)


def test_int4_export_with_importance_round_trip(routed_model, write_export, tmp_path):
    """An int4 export whose scales were chosen with an importance matrix: stored in the same
    tensors, loaded back to the same values the runtime builds in memory from the same importance,
    and not the plain rule's values."""
    from safetensors.torch import load_file

    from wide_cli.calibrate.importance import collect_importance
    from wide_cli.export import export_model
    from wide_cli.models.tiny import char_tokenizer
    from wide_cli.quant import dequantize_int4

    model = routed_model("llama")
    plain_path = _quantized_export(model, tmp_path / "plain", write_export, "int4")
    imp = collect_importance(model, torch.tensor(_prompts([16] * 6)), batch_size=3)
    wc = json.loads((plain_path / "wide_config.json").read_text())
    wc = {k: wc[k] for k in ("method", "routing", "layout", "measured_sparsity", "source_model")}
    path = tmp_path / "imp"
    export_model(model, char_tokenizer(), path, wide_config=wc, weight_format="int4", importance=imp,
                 importance_info={"tokens": 96, "data": "test prompts"})
    cfg = json.loads((path / "wide_config.json").read_text())["weight_format"]
    assert cfg["format"] == "int4" and cfg["importance"] == {"tokens": 96, "data": "test prompts"}
    st, st_plain = load_file(str(path / "model.safetensors")), load_file(str(plain_path / "model.safetensors"))
    assert {k: (v.dtype, v.shape) for k, v in st.items()} == {k: (v.dtype, v.shape) for k, v in st_plain.items()}
    name = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(dequantize_int4(st[name], st[name + "_scale"]),
                           dequantize_int4(st_plain[name], st_plain[name + "_scale"]))
    rt = Runtime.from_export(path)
    want = Runtime.from_model(model, backend="cpu", weight_format="int4", importance=imp)
    for a, b in zip(rt.layers, want.layers):
        for pa, pb in ((a.qkv, b.qkv), (a.o, b.o), (a.gu, b.gu), (a.down, b.down)):
            assert torch.equal(pa.q, pb.q) and torch.equal(pa.s, pb.s)
    ids = torch.tensor(_prompts([9]))
    torch.testing.assert_close(rt.forward(ids), want.forward(ids), atol=0, rtol=0)


def test_runtime_importance_needs_int4_and_a_model_not_an_export(routed_model, tiny_export):
    model = routed_model("llama")
    with pytest.raises(ConfigError, match="importance weights int4 scales"):
        Runtime.from_model(model, weight_format="int8", importance={})
    with pytest.raises(ConfigError, match="is an export"):
        Runtime.from_target(tiny_export, weight_format="int4", importance={})


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("edit", ["missing", "mismatched", "zero"])
def test_quantized_export_with_bad_scale_is_refused(fmt, edit, routed_model, write_export, tmp_path):
    from safetensors.torch import load_file, save_file

    from wide_cli.cli.app import main
    from wide_cli.export.manifest import write_manifest

    path = _quantized_export(routed_model("llama"), tmp_path / fmt, write_export, fmt)
    f = path / "model.safetensors"
    st = load_file(str(f))
    name = "model.layers.1.mlp.down_proj.weight_scale"
    if edit == "missing":
        del st[name]
    elif edit == "mismatched":
        st[name] = st[name][:, :3].contiguous()  # 3 blocks do not fit 128 channels
    else:
        st[name] = st[name].clone()
        st[name][0, 0] = 0
    save_file(st, str(f), metadata={"format": "pt"})
    manifest = json.loads((path / "manifest.json").read_text())
    write_manifest(path, export_id=manifest["export_id"], weight_format=fmt)  # re-hashed: a hand edit
    with pytest.raises(CheckpointError, match="down_proj.weight"):
        Runtime.from_export(path)
    assert main(["generate", str(path), "-p", "x", "--max-new-tokens", "1"]) == 2
