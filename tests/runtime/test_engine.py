"""The runtime against the routed Hugging Face model (the oracle) and ``cpu`` against ``reference``.

Tolerances (fp32): atol 1e-4 on logits. The runtime and HF compute the same math in a different
order (fused QKV, per-group GEMMs, SDPA vs masked softmax); differences are ~1e-6 on these tiny
models, 1e-4 leaves room for the 600-token RoPE case.
"""

from __future__ import annotations

import pytest
import torch

from wide_cli.errors import CheckpointError, ConfigError
from wide_cli.models.tiny import tiny_model
from wide_cli.runtime.engine import Runtime

ATOL = 1e-4


def _left_pad(prompts, pad=2):
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.bool)
    for b, p in enumerate(prompts):
        ids[b, T - len(p) :] = torch.tensor(p)
        mask[b, T - len(p) :] = True
    return ids, mask


# ----------------------------------------------------------------------------------------------
# cpu == reference, prefill + 16 decode steps, at several sparsities (forced and router-driven)

SPARSITY_CASES = {
    "routers-execute": ("execute", None),  # s = 0 through the router bias
    "routers-natural": ("natural", None),  # random routers, about half skip
    "forced-0.5": ("natural", 0.5),
    "forced-0.9": ("natural", 0.9),
    # most pairs execute: a prefill of more than SMALL_M tokens runs dense then masks (cpu_plan),
    # Q in one GEMM with K and V
    "forced-0.07": ("natural", 0.07),
    "routers-skip": ("skip", None),  # every group skipped through the router bias
}


MODEL_CASES = {
    "llama-kv-aligned": ("llama", 2, {}),
    "qwen3-one-head-groups": ("qwen3", 1, {}),
    "qwen2-biases": ("qwen2", 2, {}),  # q/k/v biases on the decode fast path too (a skipped head adds no bias)
    # 6 query heads / 2 KV heads: groups of 2 heads straddle KV-group boundaries
    "llama-straddling": ("llama", 2, {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 2}),
    # sandwich norms, GELU-tanh, one KV head, a window of 8 slots (prompt + 16 steps run past it)
    "gemma3": ("gemma3", 2, {}),
}


@pytest.mark.parametrize("case", SPARSITY_CASES)
@pytest.mark.parametrize("model_case", MODEL_CASES)
def test_cpu_matches_reference_prefill_and_decode(case, model_case, prompts_ids, routed_model, random_masks):
    routers, p = SPARSITY_CASES[case]
    kind, ags, over = MODEL_CASES[model_case]
    model = routed_model(kind, routers=routers, ags=ags, **over)
    ref = Runtime.from_model(model, backend="reference")
    cpu = Runtime.from_model(model, backend="cpu")
    ids, mask = _left_pad(prompts_ids)
    B, T = ids.shape
    steps = 16
    if p is not None:
        forced = random_masks(model, B, T + steps, p, seed=3)
        ref.forced = cpu.forced = forced
    c_ref, c_cpu = ref.new_cache(B, T + steps), cpu.new_cache(B, T + steps)
    lr, lc = ref.step(ids, mask, c_ref), cpu.step(ids, mask, c_cpu)
    torch.testing.assert_close(lc, lr, atol=ATOL, rtol=0)
    for _ in range(steps):
        nxt = lr.argmax(-1)[:, None]
        lr, lc = ref.step(nxt, None, c_ref), cpu.step(nxt, None, c_cpu)
        torch.testing.assert_close(lc, lr, atol=ATOL, rtol=0)
    s = cpu.stats.summary()
    assert s == ref.stats.summary()
    if routers == "skip":
        assert s["total"] == 1.0
    if routers == "execute":
        assert s["total"] == 0.0
    if p is not None:
        assert abs(s["total"] - p) < 0.1


# ----------------------------------------------------------------------------------------------
# runtime == HF routed model, per architecture (Qwen2 q/k/v biases, Qwen3 per-head q/k norms)

ARCHS = {
    "llama": {},
    "mistral-window": {"sliding_window": 4},
    "qwen2": {},  # q/k/v biases, non-zero (tiny_model randomizes biases)
    "qwen3": {"head_dim": 32},  # q width 128 != hidden 64, per-head q_norm/k_norm
    # sandwich norms scaling by 1 + w, GELU-tanh, MQA, query scale 24 ** -0.5, a window of 8 slots
    # and a RoPE base per layer type (tiny_model draws the norm weights away from zero)
    "gemma3": {},
}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_prefill_matches_hf(arch, backend, prompts_ids, routed_model, hf_logits):
    kind = arch.split("-")[0]
    model = routed_model(kind, **ARCHS[arch])
    rt = Runtime.from_model(model, backend=backend)
    ids, mask = _left_pad(prompts_ids)
    want = hf_logits(model, ids, mask.long())
    got = rt.forward(ids, mask)
    torch.testing.assert_close(got[mask], want[mask], atol=ATOL, rtol=0)
    assert rt.stats.summary()["attention"] > 0.05  # routing really applied (not silently dense)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama", "gemma3"])
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_masked_head_group_matches_hf(kind, backend, routed_model):
    """One head group masked everywhere: no bias leaks through it, q/k norms stay per head
    and are never sliced (Qwen3's per-head norms must see whole heads)."""
    over = {"head_dim": 32} if kind == "qwen3" else {}
    model = routed_model(kind, routers="execute", **over)
    if kind == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0
    G = model.wide_routing.groups("attention")
    keep = torch.ones(G, dtype=torch.bool)
    keep[1] = False
    forced = {(i, "attention"): keep for i in range(2)}
    ids = torch.randint(5, 100, (1, 8), generator=torch.Generator().manual_seed(1))
    model.wide_routing.forced = forced
    with torch.no_grad():
        want = model(input_ids=ids).logits
    model.wide_routing.forced = {}
    rt = Runtime.from_model(model, backend=backend)
    rt.forced = forced
    torch.testing.assert_close(rt.forward(ids), want, atol=ATOL, rtol=0)
    s = rt.stats.summary()
    assert s["attention"] == pytest.approx(1 / G) and s["ffn"] == 0.0


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma3"])
def test_dense_mode_matches_plain_hf(kind, prompts_ids, routed_model):
    """Routing disabled == the unmodified HF model (same weights)."""
    plain = tiny_model(kind)
    ids, mask = _left_pad(prompts_ids)
    with torch.no_grad():
        want = plain(input_ids=ids, attention_mask=mask.long()).logits
    for backend in ("cpu", "reference"):
        rt = Runtime.from_model(plain, backend=backend)
        assert not rt.routing
        torch.testing.assert_close(rt.forward(ids, mask)[mask], want[mask], atol=ATOL, rtol=0)
    routed = routed_model(kind)
    rt = Runtime.from_model(routed, backend="cpu", routing=False)
    torch.testing.assert_close(rt.forward(ids, mask)[mask], want[mask], atol=ATOL, rtol=0)
    assert rt.stats.summary()["total"] == 0.0


@pytest.mark.parametrize("standin", ["none", "trained", "lowrank:4"])
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_gemma3_routed_layer_matches_the_training_layer(standin, backend):
    """Gemma 3's sandwich norms under routing (``routing/layer.py``'s ``sublayer_output``): the
    post-norm sees the executed groups plus the stand-ins of the skipped ones (constant and
    low-rank), and a token that executes no group of a block adds nothing to the residual stream.
    Forced decisions: about half the groups, plus tokens that skip every group of a block (slot 3
    of both rows, and slot 6 of row 1 in the attention only), over 20 tokens (window 8)."""
    from tests._exports import feature_model

    model, _ = feature_model("gemma3", standin=standin, seed=2)
    st = model.wide_routing
    g = torch.Generator().manual_seed(3)
    forced = {}
    for i in range(2):
        for mod in ("attention", "ffn"):
            f = torch.rand(2, 20, st.groups(mod), generator=g) >= 0.5
            f[:, 3] = False
            if mod == "attention":
                f[1, 6] = False
            f[:, 4] = True
            forced[(i, mod)] = f
    ids = torch.randint(5, 100, (2, 20), generator=torch.Generator().manual_seed(1))
    st.forced = forced
    try:
        with torch.no_grad():
            want = model(input_ids=ids).logits
    finally:
        st.forced = {}
    rt = Runtime.from_model(model, backend=backend)
    rt.forced = forced
    torch.testing.assert_close(rt.forward(ids), want, atol=ATOL, rtol=0)
    # the routers decide (no forcing): the same decisions and logits
    with torch.no_grad():
        want = model(input_ids=ids).logits
    rt = Runtime.from_model(model, backend=backend)
    torch.testing.assert_close(rt.forward(ids), want, atol=ATOL, rtol=0)
    assert 0.2 < rt.stats.summary()["total"] < 0.8


def test_gemma3_runtime_weights_fold_the_norms_and_scale_the_embeddings():
    """The Gemma 3 specifics ``weights_from_model`` reads: every RMSNorm weight folded to ``1 + w``
    in fp32, sqrt(D) embedding scale, GELU-tanh, the query scale of query_pre_attn_scalar (24, not
    head_dim 32), and the RoPE base of each layer's type (10000 sliding, 1e6 global)."""
    from wide_cli.runtime.checkpoint import weights_from_model

    model = tiny_model("gemma3", dtype=torch.bfloat16)
    w, routed = weights_from_model(model)
    layer = model.model.layers[0]
    assert not routed and w.norm_fp32 and w.embed_scale == pytest.approx(64**0.5)
    assert w.final_norm.dtype == torch.float32
    torch.testing.assert_close(w.final_norm, 1.0 + model.model.norm.weight.float(), atol=0, rtol=0)
    lw = w.layers[0]
    for ours, theirs in ((lw.ln_attn, layer.input_layernorm), (lw.ln_attn_out, layer.post_attention_layernorm),
                         (lw.ln_ffn, layer.pre_feedforward_layernorm), (lw.ln_ffn_out, layer.post_feedforward_layernorm),
                         (lw.q_norm, layer.self_attn.q_norm), (lw.k_norm, layer.self_attn.k_norm)):
        assert ours.dtype == torch.float32
        torch.testing.assert_close(ours, 1.0 + theirs.weight.float(), atol=0, rtol=0)
    assert lw.act == "gelu_tanh" and lw.attn_scale == pytest.approx(24**-0.5) and lw.window == 8
    assert w.layers[1].window is None
    for lw, base in zip(w.layers, (10000.0, 1e6)):
        torch.testing.assert_close(lw.rope[0], 1.0 / base ** (torch.arange(0, 32, 2).float() / 32), atol=0, rtol=0)


# ----------------------------------------------------------------------------------------------
# batching and padding (padded rows must not change real rows' results), generation vs HF generate()


@pytest.mark.parametrize("padding_side", ["left", "right"])
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_batch_equals_each_prompt_alone(padding_side, backend, routed_model):
    model = routed_model("llama")
    rt = Runtime.from_model(model, backend=backend)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(5, 100, (n,), generator=g).tolist() for n in (3, 9)]
    batched = rt.generate(prompts, max_new_tokens=10, ignore_eos=True, padding_side=padding_side)
    s_batch = batched.sparsity["total"]
    for b, p in enumerate(prompts):
        alone = rt.generate([p], max_new_tokens=10, ignore_eos=True)
        assert alone.tokens[0] == batched.tokens[b]
    # the logits of the prompt forward too, per row, and pad decisions never count
    ids, mask = rt.batch(prompts, padding_side)
    cache = rt.new_cache(2, ids.shape[1])
    rt.stats.reset()
    lb = rt.step(ids, mask, cache)
    rt.stats.flush()
    dec = rt.stats.decisions.sum().item()
    for b, p in enumerate(prompts):
        la = rt.step(torch.tensor([p]), None, rt.new_cache(1, len(p)))
        torch.testing.assert_close(lb[b], la[0], atol=ATOL, rtol=0)
    G = model.wide_routing.groups("attention") + model.wide_routing.groups("ffn")
    assert dec == sum(len(p) for p in prompts) * G * 2  # valid tokens only, 2 layers
    assert 0.0 < s_batch < 1.0


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("arch", ["llama", "mistral-window", "gemma3"])
def test_greedy_generation_equals_hf_generate(backend, arch, routed_model):
    """Decode too (mistral: a sliding window of 4 slots, Gemma 3: of 8, shorter than prompt + new
    tokens)."""
    kind = arch.split("-")[0]
    model = routed_model(kind, **ARCHS[arch])
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 2
    rt = Runtime.from_model(model, backend=backend)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(5, 100, (n,), generator=g).tolist() for n in (4, 7)]
    ids, mask = _left_pad(prompts)
    with torch.no_grad():
        hf = model.generate(input_ids=ids, attention_mask=mask.long(), max_new_tokens=12, do_sample=False)
    ours = rt.generate(prompts, max_new_tokens=12, ignore_eos=True)
    for b in range(2):
        assert ours.tokens[b] == hf[b, ids.shape[1] :].tolist()
    single = rt.generate([prompts[1]], max_new_tokens=12, ignore_eos=True)
    with torch.no_grad():
        hf1 = model.generate(input_ids=torch.tensor([prompts[1]]), max_new_tokens=12, do_sample=False)
    assert single.tokens[0] == hf1[0, len(prompts[1]) :].tolist()


@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_chunked_prefill_equals_one_pass(padding_side, routed_model):
    model = routed_model("llama")
    g = torch.Generator().manual_seed(12)
    prompts = [torch.randint(5, 100, (n,), generator=g).tolist() for n in (4, 11)]
    for backend in ("cpu", "reference"):
        rt = Runtime.from_model(model, backend=backend)
        ids, valid = rt.batch(prompts, padding_side)
        whole = rt.prefill(ids, valid, rt.new_cache(2, 11))
        parts = rt.prefill(ids, valid, rt.new_cache(2, 11), chunk=3)
        torch.testing.assert_close(parts, whole, atol=ATOL, rtol=0)
        a = rt.generate(prompts, max_new_tokens=6, ignore_eos=True, padding_side=padding_side, prefill_chunk=3)
        b = rt.generate(prompts, max_new_tokens=6, ignore_eos=True, padding_side=padding_side, prefill_chunk=None)
        assert a.tokens == b.tokens


# ----------------------------------------------------------------------------------------------
# KV cache: complete for every layer at every step; incremental == one full forward


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_kv_cache_complete_and_incremental_equals_full(backend, routed_model, hf_logits):
    model = routed_model("llama")  # natural routers: tokens pick different groups
    rt = Runtime.from_model(model, backend=backend)
    ids = torch.randint(5, 100, (2, 6), generator=torch.Generator().manual_seed(2))
    steps = 5
    cache = rt.new_cache(2, 6 + steps)
    logits = [rt.step(ids, None, cache)]
    seq = ids
    for _ in range(steps):
        assert cache.filled() == [(2, 2, seq.shape[1], 16)] * 2
        nxt = logits[-1].argmax(-1)[:, None]
        seq = torch.cat([seq, nxt], 1)
        logits.append(rt.step(nxt, None, cache))
    assert cache.filled() == [(2, 2, seq.shape[1], 16)] * 2
    # decisions really differ between tokens
    full_rt = Runtime.from_model(model, backend=backend)
    full_cache = full_rt.new_cache(2, seq.shape[1])
    full = full_rt.step(seq, None, full_cache, logits="all")
    for t, lg in enumerate(logits):
        torch.testing.assert_close(lg, full[:, 5 + t], atol=ATOL, rtol=0)
    want = hf_logits(model, seq)
    torch.testing.assert_close(full, want, atol=ATOL, rtol=0)
    # K/V of every token were written, even where the token's own query heads were skipped
    for i in range(2):
        torch.testing.assert_close(cache.k[i][:, :, : seq.shape[1]], full_cache.k[i], atol=1e-5, rtol=0)
        torch.testing.assert_close(cache.v[i][:, :, : seq.shape[1]], full_cache.v[i], atol=1e-5, rtol=0)
        assert cache.k[i][:, :, : seq.shape[1]].abs().sum(dim=-1).gt(0).all()  # no slot left empty
    att = rt.stats.summary()["per_layer"]["attention"]
    assert all(0.0 < a < 1.0 for a in att)


# ----------------------------------------------------------------------------------------------
# per-layer widths (layers may keep different numbers of groups)


def _compact_heads(model, keep_heads: dict[int, list[int]]) -> dict:
    """HF tensors with layer i's query heads cut to ``keep_heads[i]`` and unused KV heads dropped."""
    cfg = model.config
    H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d, hpk = cfg.hidden_size // H, H // Hkv
    sd = {k: v.clone() for k, v in model.state_dict().items() if ".router_" not in k}
    for i, heads in keep_heads.items():
        kv = sorted({h // hpk for h in heads})
        pre = f"model.layers.{i}.self_attn."
        qrows = torch.cat([torch.arange(h * d, (h + 1) * d) for h in heads])
        kvrows = torch.cat([torch.arange(k * d, (k + 1) * d) for k in kv])
        sd[pre + "q_proj.weight"] = sd[pre + "q_proj.weight"][qrows]
        sd[pre + "o_proj.weight"] = sd[pre + "o_proj.weight"][:, qrows]
        for n in ("k_proj.weight", "v_proj.weight"):
            sd[pre + n] = sd[pre + n][kvrows]
    return sd


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_per_layer_widths_from_weights(backend, routed_model):
    keep = {0: [0, 1, 2, 3], 1: [0, 1], 2: [1, 3]}
    model = routed_model("llama", routers="execute", ags=1, num_hidden_layers=3)
    forced = {}
    for i, heads in keep.items():
        m = torch.zeros(4, dtype=torch.bool)
        m[heads] = True
        forced[(i, "attention")] = m
    rt = Runtime.from_tensors(model.config, _compact_heads(model, keep), backend=backend)
    assert [m.num_heads for m in rt.meta] == [4, 2, 2]
    assert [m.num_kv_heads for m in rt.meta] == [2, 1, 2]
    ids = torch.randint(5, 100, (1, 7), generator=torch.Generator().manual_seed(4))
    cache = rt.new_cache(1, 10)
    lg = [rt.step(ids, None, cache)]
    seq = ids
    for _ in range(3):
        nxt = lg[-1].argmax(-1)[:, None]
        seq = torch.cat([seq, nxt], 1)
        lg.append(rt.step(nxt, None, cache))
    model.wide_routing.forced = forced
    with torch.no_grad():
        want = model(input_ids=seq).logits
    model.wide_routing.forced = {}
    for t, logit in enumerate(lg):
        torch.testing.assert_close(logit[0], want[0, 6 + t], atol=1e-5, rtol=0)
    assert [tuple(k.shape[:2]) for k in cache.k] == [(1, 2), (1, 1), (1, 2)]


# ----------------------------------------------------------------------------------------------
# RoPE scaling (Llama 3.1's rope_scaling), tied embeddings, checkpoint strictness


@pytest.mark.parametrize("factor", [8.0, 32.0])
def test_llama3_rope_scaling_600_tokens(factor, routed_model, hf_logits):
    model = routed_model(
        "llama",
        max_position_embeddings=1024,
        rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 128},
    )  # fmt: skip
    assert model.config.rope_parameters["factor"] == factor
    ids = torch.randint(5, 100, (1, 600), generator=torch.Generator().manual_seed(9))
    want = hf_logits(model, ids)
    for backend in ("cpu", "reference"):
        rt = Runtime.from_model(model, backend=backend)
        torch.testing.assert_close(rt.forward(ids), want, atol=ATOL, rtol=0)
    plain_inv = 1.0 / (500000.0 ** (torch.arange(0, 16, 2).float() / 16))
    assert not torch.allclose(rt.inv_freq, plain_inv)  # the scaling was applied


def test_tied_lm_head_missing_tensor(routed_model, hf_logits):
    model = routed_model("llama", tie_word_embeddings=True)
    sd = {k: v for k, v in model.state_dict().items() if ".router_" not in k and k != "lm_head.weight"}
    routers = {k: v for k, v in model.state_dict().items() if ".router_" in k}
    wc = {"method": "wide", "routing": {"route_attention": True, "route_ffn": True},
          "layout": {"attn_group_size": 2, "ffn_group_size": 32}}  # fmt: skip
    ids = torch.randint(5, 100, (1, 9), generator=torch.Generator().manual_seed(3))
    want = hf_logits(model, ids)
    for backend in ("cpu", "reference"):
        rt = Runtime.from_tensors(model.config, sd, routers=routers, wide_config=wc, backend=backend)
        assert rt.lm_head is rt.embed
        torch.testing.assert_close(rt.forward(ids), want, atol=1e-5, rtol=0)
    untied = routed_model("llama", tie_word_embeddings=False)
    sd2 = {k: v for k, v in untied.state_dict().items() if ".router_" not in k and k != "lm_head.weight"}
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        Runtime.from_tensors(untied.config, sd2)


def test_unknown_or_missing_tensors_are_listed():
    model = tiny_model("llama")
    sd = dict(model.state_dict())
    sd["model.extra.weight"] = torch.zeros(3)
    with pytest.raises(CheckpointError, match="model.extra.weight"):
        Runtime.from_tensors(model.config, sd)
    Runtime.from_tensors(model.config, sd, allow_extra=True)
    sd.pop("model.extra.weight")
    sd["model.embed_tokens.weightX"] = sd.pop("model.embed_tokens.weight")
    with pytest.raises(CheckpointError, match="missing .*model.embed_tokens.weight"):
        Runtime.from_tensors(model.config, sd)


def test_router_width_must_match_layer(routed_model):
    model = routed_model("llama")
    sd = {k: v for k, v in model.state_dict().items() if ".router_" not in k}
    routers = {k: v for k, v in model.state_dict().items() if ".router_" in k}
    wc = {"method": "wide", "routing": {}, "layout": {"attn_group_size": 1, "ffn_group_size": 32}}
    with pytest.raises(CheckpointError, match="router_attention shapes"):
        Runtime.from_tensors(model.config, sd, routers=routers, wide_config=wc)


def test_cupy_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(ConfigError, match="no CUDA device"):
        Runtime.from_model(tiny_model("llama"), backend="cupy")
    with pytest.raises(ConfigError, match="unknown backend"):
        Runtime.from_model(tiny_model("llama"), backend="tpu")


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_bf16_cpu_close_to_reference(kind, prompts_ids, routed_model, random_masks):
    model = routed_model(kind)
    ids, mask = _left_pad(prompts_ids)
    rt32 = Runtime.from_model(model, backend="reference")
    rt32.forced = random_masks(model, 2, ids.shape[1], 0.5)
    want = rt32.forward(ids, mask)
    for backend in ("cpu", "reference"):
        rt = Runtime.from_model(model, backend=backend, dtype=torch.bfloat16)
        assert rt.dtype == torch.bfloat16
        rt.forced = rt32.forced
        got = rt.forward(ids, mask)
        # bf16 keeps ~3 significant digits: HF's own bf16 model is 1.6 % of the logit range off its
        # fp32 logits here; allow 3 %.
        torch.testing.assert_close(got[mask], want[mask], atol=0.03 * float(want.abs().max()), rtol=0)


def test_qkv_bias_fills_a_missing_bias_with_zeros():
    """A fused QKV projection's bias: Q, K and V biases in row order, zeros for a missing one."""
    from wide_cli.runtime.backend import LayerWeights

    D, d = 8, 4
    w = {n: torch.randn(rows, D) for n, rows in (("wq", 2 * d), ("wk", d), ("wv", d))}
    lw = LayerWeights(index=0, **w, wo=torch.randn(D, 2 * d), w_gate=torch.randn(6, D), w_up=torch.randn(6, D),
                      w_down=torch.randn(D, 6), ln_attn=torch.ones(D), ln_ffn=torch.ones(D), head_dim=d,
                      attn_group_size=1, ffn_group_size=3)  # fmt: skip
    assert lw.qkv_bias() is None
    lw.bq, lw.bv = torch.ones(2 * d), torch.full((d,), 2.0)
    assert torch.equal(lw.qkv_bias(), torch.cat([torch.ones(2 * d), torch.zeros(d), torch.full((d,), 2.0)]))


def test_static_depth_export_runs_each_module_as_one_group(tmp_path):
    """A static-depth export routes nothing, whatever group sizes its recorded settings carry
    (the recipe's, e.g. 1 head and 1 channel): the runtime runs each module as one group, as it
    runs the dense model, not as H head groups and F one-channel groups."""
    from tests._exports import feature_model
    from wide_cli.export import export_model
    from wide_cli.models.tiny import char_tokenizer

    model, wc = feature_model("llama", method="dense", ags=1, fgs=1)
    wc = {**wc, "method": "static-depth",
          "static_depth": {"removed": [2], "kept": [0, 1], "num_layers": 3, "cost_target": 0.75,
                           "cost_metric": "flops", "cost_fraction": 0.667, "calibration_tokens": 64}}
    path = export_model(model, char_tokenizer(), tmp_path / "sd", wide_config=wc).path
    rt = Runtime.from_export(path, backend="reference")
    assert [(m.attn_groups, m.ffn_groups) for m in rt.meta] == [(1, 1), (1, 1)]
    assert [(m.attn_group_size, m.ffn_group_size) for m in rt.meta] == [(4, 128), (4, 128)]
    ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(rt.forward(ids), Runtime.from_model(model, backend="reference").forward(ids),
                               atol=1e-5, rtol=0)
