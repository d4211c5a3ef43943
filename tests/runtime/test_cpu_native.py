"""The native decode step (``runtime/cpu_native.py``, ``kernels/cpu_decode.c``), one row and
batches, against the PyTorch paths: the reference backend (the oracle) and the cpu backend's own
PyTorch step.

Tolerances: fp32 1e-4 absolute on logits of magnitude ~3 (both paths compute the same fp32
math in another summation order; ~2e-6 observed). bf16, int8 and int4 use the suite's bf16 tolerance
(3 % of the largest logit, ``test_weight_formats.REL_ATOL``): the PyTorch path rounds every
intermediate to bf16 and the native step keeps fp32 between the roundings it emulates. int4 gets
4 % (``test_weight_formats.rel_atol``): its int4 x int8 kernel rounds the activations to int8 per
block as the int8 one does, and on these 2-layer random models that rounding reached 2.7 % (int8)
and 3.3 % (int4) of the largest logit against the reference (the portable build, fp32
activations: 1.7 % and 1.6 %).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from wide_cli.runtime import cpu_native, cpu_rows
from wide_cli.runtime.engine import Runtime

pytestmark = pytest.mark.skipif(cpu_native.library() is None,
                                reason=f"native decode step unavailable: {cpu_native.unavailable_reason()}")  # fmt: skip

def _atol(fmt: str, want: torch.Tensor) -> float:
    from test_weight_formats import rel_atol

    return 1e-4 if fmt == "fp32" else rel_atol(fmt) * float(want.abs().max())


def _prompt(n: int, seed: int = 7) -> torch.Tensor:
    return torch.randint(5, 100, (1, n), generator=torch.Generator().manual_seed(seed))


def _decode(rt: Runtime, ids: torch.Tensor, tokens: list[int] | None, steps: int, slots: int = 32):
    """Prefill ``ids`` then decode ``steps`` tokens (``tokens`` teacher-forced, else greedy);
    returns (logits [steps, V], tokens)."""
    cache = rt.new_cache(1, slots)
    lg = rt.step(ids, None, cache)
    out, toks = [], []
    for i in range(steps):
        t = tokens[i] if tokens is not None else int(lg.argmax())
        toks.append(t)
        lg = rt.step(torch.tensor([[t]]), None, cache)
        out.append(lg)
    return torch.cat(out), toks


def _pair(model, fmt: str, **kw) -> tuple[Runtime, Runtime]:
    """(native, PyTorch-path) cpu runtimes of ``model``."""
    a = Runtime.from_model(model, backend="cpu", weight_format=fmt, **kw)
    b = Runtime.from_model(model, backend="cpu", weight_format=fmt, **kw)
    b.native_decode = False
    return a, b


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("p_skip", [0.0, 0.5, 1.0])
def test_native_step_matches_reference_backend(fmt, p_skip, routed_model, random_masks):
    model = routed_model("qwen2")  # q/k/v biases: a bias must not leak into skipped groups
    _against_reference(model, fmt, _prompt(20), 8, random_masks(model, 1, 20 + 8 + 1, p_skip, seed=6))


def _against_reference(model, fmt: str, ids: torch.Tensor, steps: int, masks: dict) -> tuple[Runtime, Runtime]:
    """Decode ``steps`` tokens after ``ids`` on the reference backend and on the native step under
    the same forced ``masks`` (the native one teacher-forced with the reference's tokens); assert
    the native step ran and its logits are within the format's tolerance. Returns (reference, native)."""
    ref = Runtime.from_model(model, backend="reference", weight_format=fmt)
    nat = Runtime.from_model(model, backend="cpu", weight_format=fmt)
    ref.forced = nat.forced = masks
    want, toks = _decode(ref, ids, None, steps)
    got, _ = _decode(nat, ids, toks, steps)
    assert isinstance(nat._native, cpu_native.NativeDecoder)
    torch.testing.assert_close(got, want, atol=_atol(fmt, want), rtol=0)
    return ref, nat


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral-window", "gemma3"])
def test_native_step_matches_the_torch_step_with_routers(kind, routed_model):
    """Routers decide (about half the groups skip); Qwen3's q/k norms, Qwen2's biases, a sliding
    window of 4 slots shorter than the context; Gemma 3's layer (sandwich norms, GELU-tanh, MQA, a
    window of 8 and a RoPE base per layer type). Same tokens, decisions, counts and logits."""
    overrides = {"sliding_window": 4} if kind == "mistral-window" else {}
    model = routed_model(kind.split("-")[0], **overrides)
    nat, py = _pair(model, "fp32")
    got, toks = _decode(nat, _prompt(9), None, 12)
    want, toks_py = _decode(py, _prompt(9), None, 12)
    assert isinstance(nat._native, cpu_native.NativeDecoder) and py._native is None
    assert toks == toks_py
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    s_nat, s_py = nat.stats.summary(), py.stats.summary()
    assert 0.2 < s_nat["total"] < 0.8
    assert s_nat == s_py
    assert (nat.counter.macs, nat.counter.router_macs) == (py.counter.macs, py.counter.router_macs)


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_native_step_is_close_to_the_torch_step_in_low_precision(fmt, routed_model):
    model = routed_model("llama", routers="execute")
    nat, py = _pair(model, fmt)
    want, toks = _decode(py, _prompt(9), None, 10)
    got, _ = _decode(nat, _prompt(9), toks, 10)
    torch.testing.assert_close(got, want, atol=_atol(fmt, want), rtol=0)


def test_dense_mode_runs_every_group(routed_model):
    model = routed_model("llama")
    nat, py = _pair(model, "fp32", routing=False)
    got, toks = _decode(nat, _prompt(9), None, 6)
    want, _ = _decode(py, _prompt(9), toks, 6)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert nat.counter.router_macs == 0 and nat.counter.macs == py.counter.macs


def test_standins_are_added_for_skipped_groups():
    from wide_cli.models.tiny import tiny_model
    from wide_cli.routing import RoutingConfig, attach_routers

    model = tiny_model("llama", seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        st = attach_routers(model, RoutingConfig(attn_group_size=2, ffn_group_size=32, standin="mean"))
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for layer in model.model.layers:
            for r in (layer.router_attention, layer.router_ffn):
                r.standin.copy_(torch.randn(r.standin.shape, generator=g) * 0.2)
    st.set_mode("argmax")
    nat, py = _pair(model, "fp32")
    got, toks = _decode(nat, _prompt(9), None, 8)
    want, _ = _decode(py, _prompt(9), toks, 8)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    nat.native_decode = False
    without, _ = _decode(Runtime.from_model(model, backend="cpu"), _prompt(9), toks, 8)
    assert float((without - got).abs().max()) < 1e-4  # the torch path itself is the same model


def test_two_threads_give_the_same_logits_as_one(routed_model):
    """Threads split output rows and heads, never a sum: results are bitwise equal."""
    model = routed_model("llama")
    rt = Runtime.from_model(model, backend="cpu", weight_format="int8")
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, toks = _decode(rt, _prompt(9), None, 6)
        torch.set_num_threads(2)
        two, _ = _decode(rt, _prompt(9), toks, 6)
    finally:
        torch.set_num_threads(n)
    assert torch.equal(one, two)


def test_traced_calls_use_the_torch_path(routed_model):
    """Byte tracing records the PyTorch path's weight spans: the native step stays out of it."""
    rt = Runtime.from_model(routed_model("llama"), backend="cpu")
    rt.counter.trace = []
    assert rt._native_for(rt.new_cache(1, 4)) is None
    rt.counter.trace = None
    assert rt._native_for(rt.new_cache(1, 4)) is not None


def test_a_bad_token_id_is_refused(routed_model):
    """The same DataError as the PyTorch path (one line, exit 2 in the CLI), nothing written."""
    from wide_cli.errors import DataError

    rt = Runtime.from_model(routed_model("llama"), backend="cpu")
    cache = rt.new_cache(1, 8)
    rt.step(_prompt(3), None, cache)
    assert rt._native_for(cache) is not None
    with pytest.raises(DataError, match=str(rt.vocab_size)):
        rt.step(torch.tensor([[rt.vocab_size]]), None, cache)
    assert cache.length == 3
    with pytest.raises(ValueError, match="outside the vocabulary"):
        rt._native_for(cache).step([-1], cache)


def test_without_a_compiler_the_runtime_falls_back(monkeypatch, tmp_path, routed_model):
    monkeypatch.setattr(cpu_native, "_LIB", None)
    monkeypatch.setattr(cpu_native, "_LIB_ERROR", None)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("WIDE_CACHE", str(tmp_path / "cache"))
    assert cpu_native.library() is None
    assert "no C compiler" in cpu_native.unavailable_reason()
    rt = Runtime.from_model(routed_model("llama"), backend="cpu")
    logits, _ = _decode(rt, _prompt(5), None, 3)
    assert rt._native is False and logits.shape == (3, rt.vocab_size)


def test_decode_mode_perplexity_equals_the_prefill_one_in_fp32(routed_model):
    """``wide bench``'s perplexity of the decode path (token by token, the native step) scores the
    same tokens as the prefill path and, in fp32, gives the same value."""
    from wide_cli.bench.quality import runtime_perplexity

    rt = Runtime.from_model(routed_model("llama"), backend="cpu")
    ids = torch.randint(5, 100, (70,), generator=torch.Generator().manual_seed(2))
    pre = runtime_perplexity(rt, ids, 32, "prefill")
    dec = runtime_perplexity(rt, ids, 32, "decode")
    assert isinstance(rt._native, cpu_native.NativeDecoder)
    assert dec["tokens_scored"] == pre["tokens_scored"] > 60
    assert abs(dec["perplexity"] / pre["perplexity"] - 1) < 1e-4
    assert dec["sparsity"] == pre["sparsity"]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "int4"])
def test_native_step_reads_only_the_executed_groups_weights(fmt, arch, routed_model):
    """The native step's weight-byte count equals the bytes of the executed groups' blocks (int8 /
    int4: with their scales), the K/V rows and the LM head; a skipped group adds nothing (Gemma 3
    too, whose layer 1 attention executes no group: no post-norm then either)."""
    from test_weight_formats import _group_spans

    rt = Runtime.from_model(routed_model(arch), backend="cpu", weight_format=fmt)
    keep = {(0, "attention"): [False, True], (0, "ffn"): [True, False, False, True],
            (1, "attention"): [False, False], (1, "ffn"): [True] * 4}  # fmt: skip
    rt.forced = {k: torch.tensor(v) for k, v in keep.items()}
    cache = rt.new_cache(1, 8)
    rt.step(_prompt(3), None, cache)
    rt.counter.reset()
    rt.step(torch.tensor([[9]]), None, cache)
    assert isinstance(rt._native, cpu_native.NativeDecoder)
    q = fmt in ("int8", "int4")

    def size(spans):
        return sum(e - s for s, e in spans)

    want = 0
    for i, p in enumerate(rt.layers):
        for kind, proj, cols, mod in (("n", p.qkv, p.attn_cols, "attention"), ("k", p.o, p.attn_cols, "attention"),
                                      ("n", p.gu, 2 * p.ffn_group_size, "ffn"), ("k", p.down, p.ffn_group_size, "ffn")):
            want += sum(size(_group_spans(proj, kind, j, cols, q)) for j, on in enumerate(keep[(i, mod)]) if on)
        n_kv = p.qkv.N - p.q_rows
        per_weight = {"int8": 1 + 4 / 32, "int4": 0.5 + 2 / 32}.get(fmt, p.qkv.w.element_size())
        want += int(n_kv * rt.hidden_size * per_weight)
    want += rt.head.nbytes()
    assert rt.counter.weight_bytes == want


@pytest.mark.parametrize("kind", ["qwen2", "gemma3"])
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "int4"])
def test_portable_build_matches_the_reference(fmt, kind, routed_model, random_masks):
    """The C paths for CPUs without AVX-512 (built without -march=native) against the oracle."""
    lib = cpu_native.load(cpu_native.build(portable=True))
    model = routed_model(kind)
    ref = Runtime.from_model(model, backend="reference", weight_format=fmt)
    nat = Runtime.from_model(model, backend="cpu", weight_format=fmt)
    ids, steps = _prompt(20), 6
    ref.forced = nat.forced = random_masks(model, 1, 20 + steps + 1, 0.5, seed=3)
    want, toks = _decode(ref, ids, None, steps)
    cache = nat.new_cache(1, 32)
    nat.step(ids, None, cache)
    nat._native_for(cache).lib = lib
    got = torch.cat([nat.step(torch.tensor([[t]]), None, cache) for t in toks])
    atol = _atol(fmt, want)
    torch.testing.assert_close(got, want, atol=atol, rtol=0)


# ------------------------------------------------------------------------------------- batches

#: Prompt lengths of a batch: left padding of 0, 4, 9 and 2 slots.
BATCH_LENGTHS = (11, 7, 2, 9)


def _batch_prompts(n_rows: int = 4, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts ``ids [B, T]`` and their ``valid`` mask (mixed lengths)."""
    lengths = BATCH_LENGTHS[:n_rows]
    T = max(lengths)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 100, (n_rows, T), generator=g)
    valid = torch.arange(T)[None, :] >= torch.tensor([T - n for n in lengths])[:, None]
    return ids.masked_fill(~valid, 0), valid


def _decode_batch(rt: Runtime, ids, valid, tokens: list[list[int]] | None, steps: int, slots: int = 40):
    """Prefill a left-padded batch, then decode ``steps`` tokens per row (``tokens[i]`` the i-th
    step's tokens, teacher-forced, else greedy); returns (logits [steps, B, V], tokens)."""
    cache = rt.new_cache(ids.shape[0], slots)
    lg = rt.prefill(ids, valid, cache)
    out, toks = [], []
    for i in range(steps):
        t = tokens[i] if tokens is not None else lg.argmax(-1).tolist()
        toks.append(t)
        lg = rt.step(torch.tensor(t)[:, None], None, cache)
        out.append(lg)
    return torch.stack(out), toks


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral-window", "gemma3"])
def test_batched_native_step_matches_the_torch_step_with_routers(kind, routed_model):
    """Four rows of mixed prompt lengths (left padding) decode in one native call per step: same
    tokens, decisions and router multiply-adds as the PyTorch step, logits within fp32 noise, and
    fewer projection multiply-adds (the PyTorch step runs the union of the rows' groups)."""
    overrides = {"sliding_window": 4} if kind == "mistral-window" else {}
    model = routed_model(kind.split("-")[0], **overrides)
    nat, py = _pair(model, "fp32")
    ids, valid = _batch_prompts()
    got, toks = _decode_batch(nat, ids, valid, None, 8)
    nat_counts = (nat.counter.macs, nat.counter.router_macs)
    want, toks_py = _decode_batch(py, ids, valid, None, 8)
    assert isinstance(nat._native, cpu_native.NativeDecoder) and py._native is None
    assert toks == toks_py
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert nat.stats.summary() == py.stats.summary()
    # each row runs its own groups, where the PyTorch step runs the union of the rows' groups
    assert nat_counts[1] == py.counter.router_macs and nat_counts[0] < py.counter.macs


def _row_cache(rt: Runtime, cache, b: int):
    """A one-row copy of row ``b`` of ``cache`` (its padding slots included)."""
    one = rt.new_cache(1, cache.max_len)
    for dst, src in ((one.k, cache.k), (one.v, cache.v)):
        for i in range(len(dst)):
            dst[i].copy_(src[i][b : b + 1])
    one.key_valid.copy_(cache.key_valid[b : b + 1])
    one.positions.copy_(cache.positions[b : b + 1])
    one.length, one.all_valid = cache.length, bool(cache.key_valid[b, : cache.length].all())
    return one


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "int4"])
def test_batched_native_step_equals_each_row_decoded_alone(fmt, routed_model):
    """Row b of a native batch step gives the logits of the native step on row b alone (a copy of
    its cache, padding slots included). One thread: the same kernels on the same values, so
    bitwise equal, in every format."""
    model = routed_model("qwen2")
    rt = Runtime.from_model(model, backend="cpu", weight_format=fmt)
    ids, valid = _batch_prompts()
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        cache = rt.new_cache(ids.shape[0], 40)
        lg = rt.prefill(ids, valid, cache)
        for _ in range(5):
            rows = [_row_cache(rt, cache, b) for b in range(ids.shape[0])]
            t = lg.argmax(-1)
            lg = rt.step(t[:, None], None, cache)
            for b, one in enumerate(rows):
                alone = rt.step(t[b : b + 1, None], None, one)
                assert torch.equal(lg[b : b + 1], alone), (b, float((lg[b] - alone[0]).abs().max()))
    finally:
        torch.set_num_threads(n)


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("p_skip", [0.0, 0.5, 1.0])
def test_batched_native_step_matches_reference_backend(fmt, p_skip, routed_model, random_masks):
    """Forced all-on, random (per row and slot) and all-off decisions, every format, against the
    oracle."""
    model = routed_model("llama")
    ref = Runtime.from_model(model, backend="reference", weight_format=fmt)
    nat = Runtime.from_model(model, backend="cpu", weight_format=fmt)
    ids, valid = _batch_prompts(3)
    steps = 5
    ref.forced = nat.forced = random_masks(model, 3, ids.shape[1] + steps + 1, p_skip, seed=8)
    want, toks = _decode_batch(ref, ids, valid, None, steps)
    got, _ = _decode_batch(nat, ids, valid, toks, steps)
    assert isinstance(nat._native, cpu_native.NativeDecoder)
    torch.testing.assert_close(got, want, atol=_atol(fmt, want), rtol=0)


@pytest.mark.parametrize("fmt", ["fp32", "int8", "int4"])
def test_batched_native_step_reads_the_union_of_the_rows_groups(fmt, routed_model):
    """Weight bytes of a batch step = bytes of the union of the rows' executed groups (each read
    once), the K/V rows and the LM head; multiply-adds = each row's own groups."""
    from test_weight_formats import _group_spans

    rt = Runtime.from_model(routed_model("llama"), backend="cpu", weight_format=fmt)
    rows = {(0, "attention"): [[False, True], [False, False]], (0, "ffn"): [[True, False, False, True], [True, True, False, False]],
            (1, "attention"): [[False, False], [True, False]], (1, "ffn"): [[True] * 4, [False] * 4]}  # fmt: skip
    rt.forced = {k: torch.tensor(v)[:, None, :].expand(2, 16, len(v[0])) for k, v in rows.items()}
    cache = rt.new_cache(2, 16)
    rt.prefill(torch.tensor([[5, 6, 7], [8, 9, 10]]), None, cache)
    rt.counter.reset()
    rt.step(torch.tensor([[9], [11]]), None, cache)
    assert isinstance(rt._native, cpu_native.NativeDecoder)
    q = fmt in ("int8", "int4")

    def size(spans):
        return sum(e - s for s, e in spans)

    want_bytes = want_macs = 0
    D = rt.hidden_size
    for i, p in enumerate(rt.layers):
        for kind, proj, cols, mod in (("n", p.qkv, p.attn_cols, "attention"), ("k", p.o, p.attn_cols, "attention"),
                                      ("n", p.gu, 2 * p.ffn_group_size, "ffn"), ("k", p.down, p.ffn_group_size, "ffn")):
            a, b = rows[(i, mod)]
            want_bytes += sum(size(_group_spans(proj, kind, j, cols, q)) for j in range(len(a)) if a[j] or b[j])
            want_macs += (sum(a) + sum(b)) * cols * D
        n_kv = p.qkv.N - p.q_rows
        per_weight = {"int8": 1 + 4 / 32, "int4": 0.5 + 2 / 32}.get(fmt, p.qkv.w.element_size())
        want_bytes += int(n_kv * D * per_weight)
        want_macs += 2 * n_kv * D
    want_bytes += rt.head.nbytes()
    want_macs += 2 * rt.vocab_size * D
    assert rt.counter.weight_bytes == want_bytes
    assert rt.counter.macs == want_macs


def test_padded_rows_in_a_batch_step_compute_nothing(routed_model):
    """A finished row riding along as padding (``valid`` False) gets no decisions, no work and zero
    logits; the other row is unchanged."""
    model = routed_model("llama")
    rt = Runtime.from_model(model, backend="cpu")
    ids, valid = _batch_prompts(2)
    cache = rt.new_cache(2, 32)
    rt.prefill(ids, valid, cache)
    alone = rt.new_cache(1, 32)
    rt.prefill(ids[:1], valid[:1], alone)
    before = rt.stats.decisions.clone()
    lg = rt.step(torch.tensor([[7], [8]]), torch.tensor([[True], [False]]), cache)
    assert isinstance(rt._native, cpu_native.NativeDecoder)
    assert torch.equal(lg[1], torch.zeros_like(lg[1]))
    batch_decisions = rt.stats.decisions - before
    before = rt.stats.decisions.clone()
    want = rt.step(torch.tensor([[7]]), None, alone)
    assert torch.equal(batch_decisions, rt.stats.decisions - before)  # row 0's only
    torch.testing.assert_close(lg[:1], want, atol=1e-5, rtol=0)
    # a step in which every row is padding computes nothing at all
    rt.counter.reset()
    lg = rt.step(torch.tensor([[7], [8]]), torch.tensor([[False], [False]]), cache)
    assert not lg.any() and rt.counter.macs == rt.counter.weight_bytes == 0


# ------------------------------------------------------------- routed projections (serving)


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("M", [1, 3, 16])
def test_routed_ffn_and_out_rows_match_the_masking_oracle(fmt, M):
    """``cpu_rows.routed_ffn`` / ``routed_out`` (each token over its own groups, what the vLLM
    plugin's decode steps run) against ``ops``' masking definitions on the same weights: random
    masks, all-on and all-off rows among them."""
    from test_weight_formats import rel_atol

    from wide_cli.quant import dequantize, quantize
    from wide_cli.runtime import ops
    from wide_cli.runtime.backend import Counter
    from wide_cli.runtime.cpu_proj import Proj, grouped_gate_up

    g = torch.Generator().manual_seed(M)
    D, F, fg, H, d, ag = 64, 256, 32, 4, 16, 2
    dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
    w_gate, w_up, w_down = (torch.randn(s, generator=g) * 0.1 for s in ((F, D), (F, D), (D, F)))
    w_o = torch.randn(D, H * d, generator=g) * 0.1
    x = torch.randn(M, D, generator=g)
    a = torch.randn(M, H * d, generator=g)
    mf = torch.rand(M, F // fg, generator=g) < 0.5
    mo = torch.rand(M, H // ag, generator=g) < 0.5
    mf[0], mo[0] = True, True
    if M > 1:
        mf[1], mo[1] = False, False
    proj_fmt = "float" if fmt in ("fp32", "bf16") else fmt
    gu = Proj(grouped_gate_up(w_gate, w_up, fg).to(dtype), "n", proj_fmt, dtype, "cpu", Counter())
    down = Proj(w_down.to(dtype), "k", proj_fmt, dtype, "cpu", Counter(), fg)
    o = Proj(w_o.to(dtype), "k", proj_fmt, dtype, "cpu", Counter(), ag * d)
    cf, co = (torch.full((len(cpu_native.COUNTERS),), 5, dtype=torch.int64) for _ in range(2))
    got_ffn = cpu_rows.routed_ffn(gu, down, x.to(dtype), mf, cf)
    got_out = cpu_rows.routed_out(o, a.to(dtype), mo, co)
    # the bool masks are read as they are, and the caller's counters are added to: each token's
    # own groups' multiply-adds
    assert int(cf[0]) == 5 + int(mf.sum()) * 3 * fg * D and int(co[0]) == 5 + int(mo.sum()) * ag * d * D

    def q(w):  # the values the kernels multiply
        return dequantize(*quantize(w, fmt)).float() if proj_fmt != "float" else w.to(dtype).float()

    xq = x.to(dtype).float()
    want_ffn = ops.gemm_k(ops.gemm_mn_swiglu(xq, q(w_gate), q(w_up), mf, fg), q(w_down), mf, fg)
    want_out = ops.gemm_k(a.to(dtype).float(), q(w_o), mo, ag * d)
    for got, want in ((got_ffn, want_ffn), (got_out, want_out)):
        assert got is not None and got.shape == want.shape and got.dtype == dtype
        tol = 1e-5 if fmt == "fp32" else rel_atol(fmt) * float(want.abs().max())
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=0)
    if M > 1:  # a token that executes nothing gets exactly nothing
        assert not got_ffn[1].any() and not got_out[1].any()


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("M", [1, 4])
def test_routed_module_with_its_router_and_standins_equals_the_torch_composition(fmt, M):
    """With ``router=`` the native call decides each token's groups from the residual stream and
    adds the skipped groups' stand-ins itself: the same decisions as the folded router in PyTorch
    (``WideRouter``: ``W r + b >= 0``, or every group when forced) and the same output as the
    masked call plus ``(~ex) @ standin`` in the activations' dtype."""
    from wide_cli.runtime.backend import Counter
    from wide_cli.runtime.cpu_proj import Proj, grouped_gate_up

    g = torch.Generator().manual_seed(10 + M)
    D, F, fg, H, d, ag = 64, 256, 32, 4, 16, 2
    Gf, Go = F // fg, H // ag
    dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
    proj_fmt = "float" if fmt in ("fp32", "bf16") else fmt
    w_gate, w_up, w_down = (torch.randn(s, generator=g) * 0.1 for s in ((F, D), (F, D), (D, F)))
    w_o = torch.randn(D, H * d, generator=g) * 0.1
    gu = Proj(grouped_gate_up(w_gate, w_up, fg).to(dtype), "n", proj_fmt, dtype, "cpu", Counter())
    down = Proj(w_down.to(dtype), "k", proj_fmt, dtype, "cpu", Counter(), fg)
    o = Proj(w_o.to(dtype), "k", proj_fmt, dtype, "cpu", Counter(), ag * d)
    x, r = (torch.randn(M, D, generator=g).to(dtype) for _ in range(2))
    a = torch.randn(M, H * d, generator=g).to(dtype)
    for force in (False, True):
        for standin in (True, False):
            for G, inp, call in ((Gf, x, "ffn"), (Go, a, "out")):
                rw, rb = torch.randn(G, D, generator=g) * 0.2, torch.randn(G, generator=g) * 0.2
                st = torch.randn(G, D, generator=g) * 0.5 if standin else None
                router = cpu_rows.ModuleRouter(rw, rb, force, st)
                ex = (torch.nn.functional.linear(r.float(), rw, rb) >= 0) | force
                cnt = torch.zeros(len(cpu_native.COUNTERS), dtype=torch.int64)
                if call == "ffn":
                    got = cpu_rows.routed_ffn(gu, down, inp, None, cnt, router=router, r=r)
                    want = cpu_rows.routed_ffn(gu, down, inp, ex)
                else:
                    got = cpu_rows.routed_out(o, inp, None, cnt, router=router, r=r)
                    want = cpu_rows.routed_out(o, inp, ex)
                if st is not None:
                    want = want + ((~ex).float() @ st).to(dtype)
                assert got.dtype == dtype and got.shape == want.shape
                torch.testing.assert_close(got.float(), want.float(), atol=1e-5 if fmt != "bf16" else 1e-2, rtol=0)
                assert int(cnt[2]) == (0 if force else M * G * D)  # router multiply-adds
                macs = (3 * fg * D) if call == "ffn" else (ag * d * D)
                assert int(cnt[0]) == int(ex.sum()) * macs  # the decisions the call took
    with pytest.raises(ValueError, match="router input"):
        cpu_rows.routed_ffn(gu, down, x, None, router=cpu_rows.ModuleRouter(rw, rb, False, None), r=r[:, :8])


@pytest.mark.parametrize("M", [1, 7, 16])
def test_route_rows_gives_the_routers_decisions_and_standin_sums(M):
    """``cpu_rows.route_rows`` (the plugin's larger decode steps decide natively, then run vLLM's
    kernels): the folded router's decisions, each token's skipped stand-ins summed, the union of
    executed groups and the executed pairs."""
    g = torch.Generator().manual_seed(20 + M)
    G, D, N = 12, 64, 48
    r = torch.randn(M, D, generator=g)
    rw, rb = torch.randn(G, D, generator=g) * 0.2, torch.randn(G, generator=g) * 0.2 - 0.3
    st = torch.randn(G, N, generator=g)
    for force, standin in ((False, st), (False, None), (True, st)):
        ex = (torch.nn.functional.linear(r, rw, rb) >= 0) | force
        cnt = torch.zeros(len(cpu_native.COUNTERS), dtype=torch.int64)
        mask, sums, union, pairs = cpu_rows.route_rows(cpu_rows.ModuleRouter(rw, rb, force, standin), r, N, cnt)
        assert mask.dtype == torch.uint8 and torch.equal(mask.bool(), ex)
        assert union == int(ex.any(0).sum()) and pairs == int(ex.sum())
        assert int(cnt[2]) == (0 if force else M * G * D)
        if standin is None:
            assert sums is None
        else:
            torch.testing.assert_close(sums, (~ex).float() @ st, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="stand-ins"):
        cpu_rows.route_rows(cpu_rows.ModuleRouter(rw, rb, False, st), r, N + 1)


@pytest.mark.parametrize("fmt", ["fp32", "bf16"])
@pytest.mark.parametrize("M", [2, 4, 5, 16])
def test_routed_rows_in_a_batch_equal_each_row_alone(fmt, M):
    """A token's output of a batched ``routed_ffn`` / ``routed_out`` call is bit for bit its output
    when it is called alone: several tokens share each weight read but every token keeps its own
    order of sums. A width off the vector size (72 channels) exercises the kernels' remainder
    paths; groups are multiples of 4 channels (as in every model) so that a run of groups sums in
    the same blocks of 4 whichever tokens share it."""
    from wide_cli.runtime.backend import Counter
    from wide_cli.runtime.cpu_proj import Proj, grouped_gate_up

    g = torch.Generator().manual_seed(100 + M)
    D, F, fg, cols, GA = 72, 180, 20, 20, 4
    dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
    w_gate, w_up, w_down = (torch.randn(s, generator=g) * 0.1 for s in ((F, D), (F, D), (D, F)))
    w_o = torch.randn(D, GA * cols, generator=g) * 0.1
    gu = Proj(grouped_gate_up(w_gate, w_up, fg).to(dtype), "n", "float", dtype, "cpu", Counter())
    down = Proj(w_down.to(dtype), "k", "float", dtype, "cpu", Counter(), fg)
    o = Proj(w_o.to(dtype), "k", "float", dtype, "cpu", Counter(), cols)
    x = torch.randn(M, D, generator=g).to(dtype)
    a = torch.randn(M, GA * cols, generator=g).to(dtype)
    mf = torch.rand(M, F // fg, generator=g) < 0.7
    mo = torch.rand(M, GA, generator=g) < 0.7
    mf[0], mo[0] = True, True  # one token executes everything
    ffn = cpu_rows.routed_ffn(gu, down, x, mf)
    out = cpu_rows.routed_out(o, a, mo)
    for i in range(M):
        assert torch.equal(ffn[i : i + 1], cpu_rows.routed_ffn(gu, down, x[i : i + 1], mf[i : i + 1])), i
        assert torch.equal(out[i : i + 1], cpu_rows.routed_out(o, a[i : i + 1], mo[i : i + 1])), i


def test_routed_rows_take_any_mask_layout_and_refuse_bad_shapes():
    """A call where no token executes anything returns zeros and counts nothing; a
    non-contiguous mask is read by value; a mask or counter of the wrong shape is refused before
    the kernel reads or writes past it."""
    from wide_cli.runtime.backend import Counter
    from wide_cli.runtime.cpu_proj import Proj, grouped_gate_up

    g = torch.Generator().manual_seed(3)
    D, F, fg = 64, 256, 32
    gu = Proj(grouped_gate_up(torch.randn(F, D, generator=g), torch.randn(F, D, generator=g), fg), "n", "float",
              torch.float32, "cpu", Counter())  # fmt: skip
    down = Proj(torch.randn(D, F, generator=g), "k", "float", torch.float32, "cpu", Counter(), fg)
    x = torch.randn(2, D, generator=g)
    cnt = torch.zeros(len(cpu_native.COUNTERS), dtype=torch.int64)
    y = cpu_rows.routed_ffn(gu, down, x[:1], torch.zeros(1, F // fg, dtype=torch.bool), cnt)
    assert y.shape == (1, D) and not y.any() and not cnt.any()
    mask = torch.rand(F // fg, 2, generator=g) < 0.5  # transposed below: not contiguous
    assert not mask.t().is_contiguous()
    torch.testing.assert_close(cpu_rows.routed_ffn(gu, down, x, mask.t()),
                               cpu_rows.routed_ffn(gu, down, x, mask.t().contiguous()), atol=0, rtol=0)  # fmt: skip
    with pytest.raises(ValueError, match=r"mask of shape \(2, 4\), expected \(2, 8\)"):
        cpu_rows.routed_ffn(gu, down, x, torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="counters must be a contiguous CPU int64 tensor of 4"):
        cpu_rows.routed_ffn(gu, down, x, mask.t(), torch.zeros(4, dtype=torch.int32))


def _rows_against_reference(model, fmt, p_skip, random_masks, steps: int = 6) -> None:
    """The native step against the reference backend on ``model``: one row (12-token prompt, then
    ``steps`` greedy steps), then a batch of two rows with different prompts and masks."""
    ref, nat = _against_reference(model, fmt, _prompt(12), steps,
                                  random_masks(model, 1, 12 + steps + 1, p_skip, seed=3))
    ids2 = torch.cat([_prompt(12, seed=7), _prompt(12, seed=8)])
    ref.forced = nat.forced = random_masks(model, 2, 12 + steps + 1, p_skip, seed=4)
    caches = [rt.new_cache(2, 32) for rt in (ref, nat)]
    lg = [rt.step(ids2, None, c) for rt, c in zip((ref, nat), caches)]
    for _ in range(steps):
        t = lg[0].argmax(-1, keepdim=True)
        lg = [rt.step(t, None, c) for rt, c in zip((ref, nat), caches)]
        torch.testing.assert_close(lg[1], lg[0], atol=_atol(fmt, lg[0]), rtol=0)


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("p_skip", [0.5, 1.0])
def test_native_step_runs_lowrank_standins_as_the_reference(fmt, p_skip, random_masks):
    """``lowrank:4`` stand-ins (a constant plus a rank-4 map of the module's normed input per
    skipped group) in the native step against the reference backend, one row and a batch of two
    rows with different prompts and masks (each row maps its own normed input)."""
    from tests._exports import feature_model

    model, _ = feature_model(standin="lowrank:4", seed=2)
    _rows_against_reference(model, fmt, p_skip, random_masks)


def test_native_step_counts_the_lowrank_maps_it_runs():
    """Every group skipped against every group executed, one decode step: the skipped groups'
    multiply-adds and fp32 bytes are traded for their maps' ``2 R D`` each (ranks differ per
    module: 4 for attention, 2 for the FFN), the maps of a group read once for all rows."""
    from tests._exports import feature_model

    model, _ = feature_model(standin="lowrank:4", seed=2)
    with torch.no_grad():  # the FFN's maps at rank 2: each module carries its own rank
        for layer in model.model.layers:
            r = layer.router_ffn
            r.standin_in = torch.nn.Parameter(r.standin_in[:, :2].clone())
            r.standin_out = torch.nn.Parameter(r.standin_out[:, :2].clone())
    nat = Runtime.from_model(model, backend="cpu", weight_format="fp32")
    D = nat.hidden_size
    counts = {}
    for B in (1, 2):
        for execute in (True, False):
            nat.forced = {(i, mod): torch.full((B, 16, m.attn_groups if mod == "attention" else m.ffn_groups), execute)
                          for i, m in enumerate(nat.meta) for mod in ("attention", "ffn")}
            cache = nat.new_cache(B, 16)
            nat.step(_prompt(3).expand(B, -1), None, cache)
            nat.counter.reset()
            nat.step(torch.full((B, 1), 9), None, cache)
            assert isinstance(nat._native, cpu_native.NativeDecoder)
            counts[(B, execute)] = (nat.counter.macs, nat.counter.weight_bytes)
    routed = sum(m.attn_groups * m.attn_group_size * m.head_dim * 2 + m.ffn_groups * m.ffn_group_size * 3
                 for m in nat.meta) * D  # Q rows + O columns, gate + up + down
    maps = sum(m.attn_groups * 2 * 4 + m.ffn_groups * 2 * 2 for m in nat.meta) * D
    for B in (1, 2):
        (mac_on, bytes_on), (mac_off, bytes_off) = counts[(B, True)], counts[(B, False)]
        assert mac_on - mac_off == B * (routed - maps)
        assert bytes_on - bytes_off == 4 * (routed - maps)  # a batch reads each group's weights or maps once


# ------------------------------------------------------------------------------------- Gemma 3


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("p_skip", [0.0, 0.5, 1.0])
def test_native_step_runs_gemma3_as_the_reference(fmt, p_skip, random_masks):
    """Gemma 3 (sandwich norms scaling by 1 + w, GELU-tanh, MQA, query scale 24 ** -0.5, embeddings
    times sqrt(D), a window of 8 slots and a RoPE base per layer type) with ``lowrank:4`` stand-ins
    in the native step against the reference backend, one row after a 12-token prompt (past the
    window) and a batch of two rows with their own masks. At p_skip 0.5 some tokens skip every group
    of a block (two attention groups: a quarter of them), which then adds nothing; at 1.0 all do."""
    from tests._exports import feature_model

    model, _ = feature_model("gemma3", standin="lowrank:4", seed=2)
    _rows_against_reference(model, fmt, p_skip, random_masks)


def test_native_step_skips_a_gemma3_block_that_executes_no_group():
    """A token that executes no group of a Gemma 3 block adds nothing: the native step reads
    neither the block's groups nor its low-rank stand-in maps (their output would be dropped),
    only the K/V rows and the LM head, and its logits are the reference's."""
    from tests._exports import feature_model

    model, _ = feature_model("gemma3", standin="lowrank:4", seed=2)
    ref = Runtime.from_model(model, backend="reference")
    nat = Runtime.from_model(model, backend="cpu")
    for rt in (ref, nat):
        rt.forced = {(i, mod): torch.zeros(m.attn_groups if mod == "attention" else m.ffn_groups, dtype=torch.bool)
                     for i, m in enumerate(rt.meta) for mod in ("attention", "ffn")}
    caches = [rt.new_cache(1, 16) for rt in (ref, nat)]
    for rt, c in zip((ref, nat), caches):
        rt.step(_prompt(10), None, c)
    nat.counter.reset()
    want, got = (rt.step(torch.tensor([[9]]), None, c) for rt, c in zip((ref, nat), caches))
    assert isinstance(nat._native, cpu_native.NativeDecoder)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    D, V = nat.hidden_size, nat.vocab_size
    kv = sum(2 * m.num_kv_heads * m.head_dim for m in nat.meta) * D
    assert nat.counter.macs == kv + V * D
    assert nat.counter.weight_bytes == 4 * (kv + V * D)
