"""``wide export --format hf``: loads in plain transformers (remote code generated from our routing
code), gives the reference routed model's logits, works in ``pipeline`` and lm-eval's ``HFLM``,
loads where ``wide`` is not importable, and static width is physically smaller."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import sysconfig
import textwrap

import pytest
import torch
from safetensors import safe_open

from wide_cli.export import export_model, load_pruned
from wide_cli.export.hf_format import compact_static, load_hf_export
from wide_cli.export.modeling_template import (
    ARCH_PREFIX,
    CONSTANTS,
    COPIED,
    render_modeling,
    shipped_definitions,
)
from wide_cli.models.tiny import char_tokenizer, tiny_model
from wide_cli.routing import RoutingConfig, attach_routers

IDS = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))
ATOL = 1e-5  # fp32; the routed forward is the same code, so routed exports are in fact bit-equal


def _routed(kind="llama", cfg=None, **over):
    model = tiny_model(kind, **over)
    cfg = cfg or RoutingConfig(attn_group_size=2, ffn_group_size=32)
    attach_routers(model, cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".router_" in n and n.endswith("bias"):
                p.normal_(0, 1.0)  # routers that actually skip
    return model, cfg


def _export(model, cfg, out, fmt):
    wc = {"method": cfg.method, "routing": cfg.to_dict(),
          "measured_sparsity": {"attention": 0.25, "ffn": 0.5, "total": 0.375, "tokens": 24,
                                "per_layer": {"attention": [0.0, 0.5], "ffn": [0.5, 0.5]}},
          "source_model": {"spec": "tiny-llama"}}
    return export_model(model, char_tokenizer(), out, wide_config=wc, export_format=fmt)


def _auto_load(path, **kw):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, output_loading_info=True, **kw)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


# ----------------------------------------------------------------------------- generated code
@pytest.mark.parametrize("model_type", list(ARCH_PREFIX))
def test_shipped_routing_code_is_verbatim_package_code(model_type):
    text = render_modeling(model_type)
    shipped = shipped_definitions(text)
    for mod, name in COPIED:
        obj = getattr(__import__(mod, fromlist=[name]), name)
        assert shipped[name] == inspect.getsource(obj), f"{mod}.{name} drifted from the shipped copy"
    for mod, name in CONSTANTS:
        assert f"{name} = {getattr(__import__(mod, fromlist=[name]), name)!r}" in text
    # The generated classes use the copied forward, not a re-implementation.
    assert f"class Wide{ARCH_PREFIX[model_type]}DecoderLayer" in text and "forward = routed_layer_forward" in text
    assert "wide_cli" not in "".join(line for line in text.splitlines(True) if line.startswith(("import", "from")))


def test_exported_file_is_the_generated_one(tmp_path):
    model, cfg = _routed()
    _export(model, cfg, tmp_path / "hf_gen", "hf")
    assert (tmp_path / "hf_gen" / "modeling_wide.py").read_text() == render_modeling("llama")


# ----------------------------------------------------------------------------- round trip
@pytest.mark.parametrize(
    "kind,over",
    [("llama", {}), ("llama", {"tie_word_embeddings": True}), ("qwen2", {}), ("qwen3", {"head_dim": 32}),
     ("mistral", {}), ("gemma3", {}), ("gemma3", {"tie_word_embeddings": False})],
)
def test_hf_export_logits_equal_wide_loader(tmp_path, kind, over):
    model, cfg = _routed(kind, **over)
    _export(model, cfg, tmp_path / f"wide_{kind}", "wide")
    res = _export(model, cfg, tmp_path / f"hf_{kind}", "hf")
    ref = load_pruned(tmp_path / f"wide_{kind}").model
    got = _auto_load(res.path)
    with torch.no_grad():
        a, b = ref(IDS).logits, got(IDS).logits
    assert (a - b).abs().max().item() <= ATOL
    assert type(got).__name__ == f"Wide{ARCH_PREFIX[model.config.model_type]}ForCausalLM"
    # routing actually happens: some groups skip on this input
    got.wide_routing.trace = []
    with torch.no_grad():
        got(IDS)
    trace = got.wide_routing.trace
    assert len(trace) == 2 * 2 and any(not ex.all() for _, _, ex in trace)
    if model.config.tie_word_embeddings:  # tiny-gemma3 ties them, as Gemma 3 does
        assert got.lm_head.weight.data_ptr() == got.model.embed_tokens.weight.data_ptr()
    else:
        assert got.lm_head.weight.data_ptr() != got.model.embed_tokens.weight.data_ptr()


def test_hf_export_files_config_and_router_tensors(tmp_path):
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128, "rope_theta": 500000.0}
    model, cfg = _routed("llama", head_dim=32, max_position_embeddings=1024, rope_parameters=rope)
    res = _export(model, cfg, tmp_path / "hf_files", "hf")
    out = res.path
    names = set(json.loads((out / "manifest.json").read_text())["files"])
    assert {"config.json", "model.safetensors", "modeling_wide.py", "configuration_wide.py", "README.md",
            "wide_config.json", "tokenizer.json"} <= names
    assert "routers.safetensors" not in names
    c = json.loads((out / "config.json").read_text())
    assert c["model_type"] == "wide_llama" and c["architectures"] == ["WideLlamaForCausalLM"]
    assert c["auto_map"]["AutoModelForCausalLM"] == "modeling_wide.WideLlamaForCausalLM"
    assert c["head_dim"] == 32  # head_dim != hidden / heads must survive the round trip
    saved = c.get("rope_parameters") or c.get("rope_scaling")
    assert all(saved[k] == v for k, v in rope.items())  # rope_scaling kept (Llama 3.1 needs it)
    assert c["wide_routing"]["layout"]["attn_groups"] == 2 and c["wide_routing"]["routing"]["ffn_group_size"] == 32
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.layers.1.router_ffn.router.weight").dtype == torch.float32
    for i in range(2):
        for m in ("attention", "ffn"):
            for p in ("compressor", "router"):
                assert {f"model.layers.{i}.router_{m}.{p}.weight", f"model.layers.{i}.router_{m}.{p}.bias"} <= keys
    assert json.loads((out / "wide_config.json").read_text())["export_format"] == "hf"


@pytest.mark.parametrize("method", ["dynamic-depth", "dense"])
def test_hf_export_other_methods(tmp_path, method):
    model, cfg = _routed(cfg=RoutingConfig(method=method, attn_group_size=2, ffn_group_size=32))
    with torch.no_grad():
        ref = model(IDS).logits
    got = _auto_load(_export(model, cfg, tmp_path / f"hf_{method}", "hf").path)
    with torch.no_grad():
        assert (got(IDS).logits - ref).abs().max().item() <= ATOL


def test_hf_export_bf16_keeps_routers_fp32(tmp_path):
    model, cfg = _routed()
    got = _auto_load(_export(model, cfg, tmp_path / "hf_bf16", "hf").path, dtype=torch.bfloat16)
    assert got.model.layers[0].router_attention.router.weight.dtype == torch.float32
    assert got.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.isfinite(got(IDS).logits).all()


def test_load_hf_export_verifies_manifest(tmp_path):
    from wide_cli.errors import CheckpointError

    model, cfg = _routed()
    out = _export(model, cfg, tmp_path / "hf_verify", "hf").path
    pm = load_hf_export(out)
    with torch.no_grad():
        assert (pm.model(IDS).logits - model(IDS).logits).abs().max().item() <= ATOL
    p = out / "modeling_wide.py"
    p.write_text(p.read_text() + "\n# edited\n")
    with pytest.raises(CheckpointError, match="modeling_wide.py has .* bytes"):
        load_hf_export(out)


# ----------------------------------------------------------------------------- consumers
def test_text_generation_pipeline(tmp_path):
    from transformers import pipeline

    model, cfg = _routed()
    out = _export(model, cfg, tmp_path / "hf_pipe", "hf").path
    gen = pipeline("text-generation", model=str(out), trust_remote_code=True, device="cpu")
    text = gen("The fox", max_new_tokens=8, do_sample=False, return_full_text=False)[0]["generated_text"]
    tok = char_tokenizer()
    ids = tok("The fox", return_tensors="pt").input_ids
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=2)
    assert text == tok.decode(want[0, ids.shape[1]:], skip_special_tokens=True)


def test_lm_eval_hflm_loads_hf_export(tmp_path):
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    model, cfg = _routed()
    out = _export(model, cfg, tmp_path / "hf_lmeval", "hf").path
    lm = HFLM(pretrained=str(out), trust_remote_code=True, batch_size=2, device="cpu", max_length=64)
    assert type(lm.model).__name__ == "WideLlamaForCausalLM"
    ref = HFLM(pretrained=model, tokenizer=char_tokenizer(), batch_size=2, max_length=64)
    reqs = [Instance("loglikelihood", {}, (c, x), i) for i, (c, x) in
            enumerate([("The quick brown", " fox"), ("Hello", " world!"), ("a", "bc")])]
    got = lm.loglikelihood(reqs, disable_tqdm=True)
    want = ref.loglikelihood(reqs, disable_tqdm=True)
    assert [g[0] for g in got] == pytest.approx([w[0] for w in want], abs=1e-5)


def _without_wide(tmp_path, body: str):
    """Run ``body`` (Python, dedented) in a python that cannot import wide_cli (no repo on
    sys.path, no editable-install hook) and return the JSON its last stdout line holds."""
    site = sysconfig.get_paths()["purelib"]
    prologue = textwrap.dedent(f"""
        import sys, json
        sys.path[:] = [p for p in sys.path if 'site-packages' not in p] + [{site!r}]
        try:
            import wide_cli
        except ImportError:
            pass
        else:
            raise SystemExit('wide_cli is importable: the test is not isolated')
        import torch
        from transformers import AutoModelForCausalLM
    """)
    code = prologue + textwrap.dedent(body) + "\nassert 'wide_cli' not in sys.modules\n"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "hf_modules"), OMP_NUM_THREADS="1")
    # -I: no PYTHONPATH, no cwd / script dir, no user site; -S: no .pth files (the editable
    # install of wide is a .pth import hook), site-packages is added back by hand above.
    r = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_loads_where_wide_is_not_importable(tmp_path):
    """A python that cannot import wide_cli loads the export and prints the same logits."""
    model, cfg = _routed("qwen3", head_dim=32)
    out = _export(model, cfg, tmp_path / "hf_nowide", "hf").path
    got = torch.tensor(_without_wide(tmp_path, f"""
        m = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True).eval()
        ids = torch.tensor({IDS.tolist()!r})
        with torch.no_grad():
            print(json.dumps(m(ids).logits.tolist()))
    """))
    with torch.no_grad():
        ref = load_pruned(_export(model, cfg, tmp_path / "wide_nowide", "wide").path).model(IDS).logits
    assert (got - ref).abs().max().item() <= ATOL


def test_standin_hybrid_hf_export_matches_the_reference_backend_without_wide(tmp_path):
    """A hybrid export with trained stand-ins (a layer removed, then width routed; skipped groups
    add their stand-in vectors) loads in plain transformers where wide is not installed and gives
    the runtime reference backend's logits and greedy tokens (EOS ignored)."""
    from tests._exports import feature_model
    from wide_cli.features import read_export_features
    from wide_cli.runtime.engine import Runtime

    model, wc = feature_model("llama", standin="trained", drop_layers=1)
    tok = char_tokenizer()
    hf = export_model(model, tok, tmp_path / "hf_hybrid", wide_config=wc, export_format="hf").path
    wide = export_model(model, tok, tmp_path / "wide_hybrid", wide_config=wc).path
    assert {"standins", "dropped_layers", "format_hf"} <= read_export_features(hf)
    res = _without_wide(tmp_path, f"""
        m = AutoModelForCausalLM.from_pretrained({str(hf)!r}, trust_remote_code=True).eval()
        m.generation_config.eos_token_id = None  # greedy through EOS, like --ignore-eos
        ids = torch.tensor({IDS.tolist()!r})
        with torch.no_grad():
            logits = m(ids).logits.tolist()
            tokens = m.generate(ids[:1], max_new_tokens=10, do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()
        skipped = [l.router_attention.standin.abs().sum().item() > 0 for l in m.model.layers]
        print(json.dumps({{"logits": logits, "tokens": tokens, "layers": len(m.model.layers), "standins": skipped}}))
    """)
    assert res["layers"] == 2 and all(res["standins"])
    rt = Runtime.from_export(wide, backend="reference")
    want = rt.forward(IDS)
    assert (torch.tensor(res["logits"]) - want).abs().max().item() <= ATOL
    assert 0 < rt.stats.summary()["total"] < 1  # groups skipped, so the stand-ins were used
    assert res["tokens"] == rt.generate([IDS[0].tolist()], max_new_tokens=10, ignore_eos=True).tokens[0]


@pytest.mark.parametrize("standin", ["none", "trained", "lowrank:4"])
def test_gemma3_hf_export_routes_sandwich_norm_blocks_like_the_training_layer(tmp_path, standin):
    """Gemma 3's routed block output (executed groups plus stand-ins) goes through the block's
    output norm, and a token that executes no group of a block adds exactly nothing: layer 0's
    attention skips every group for every token here (router biases of -30), so with stand-ins
    on, a wrong order (stand-ins renormalised to a full block's scale) shows in the logits. The
    hf export, loaded where wide is not importable, gives the in-memory training layer's logits
    and greedy tokens (EOS ignored)."""
    from tests._exports import feature_model

    model, wc = feature_model("gemma3", standin=standin)
    with torch.no_grad():
        model.model.layers[0].router_attention.router.bias.fill_(-30.0)
        st = model.wide_routing
        st.trace = []
        ref = model(IDS).logits
        trace, st.trace = st.trace, None
        model.generation_config.eos_token_id = None
        ref_tokens = model.generate(IDS[:1], max_new_tokens=10, do_sample=False, pad_token_id=0)[0, IDS.shape[1]:]
    skipped_block = {(layer, m): bool((~ex).all(-1).any()) for layer, m, ex in trace}
    assert skipped_block[(0, "attention")] and not all(ex.all() for _, _, ex in trace)
    hf = export_model(model, char_tokenizer(), tmp_path / "hf_gemma3", wide_config=wc, export_format="hf").path
    res = _without_wide(tmp_path, f"""
        m = AutoModelForCausalLM.from_pretrained({str(hf)!r}, trust_remote_code=True).eval()
        m.generation_config.eos_token_id = None  # greedy through EOS, like --ignore-eos
        ids = torch.tensor({IDS.tolist()!r})
        with torch.no_grad():
            logits = m(ids).logits.tolist()
            tokens = m.generate(ids[:1], max_new_tokens=10, do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()
        print(json.dumps({{"logits": logits, "tokens": tokens, "cls": type(m).__name__}}))
    """)
    assert res["cls"] == "WideGemma3ForCausalLM"
    assert (torch.tensor(res["logits"]) - ref).abs().max().item() <= ATOL
    assert res["tokens"] == ref_tokens.tolist()


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_hf_export_refuses_quantized_weights_before_writing(fmt, tmp_path):
    from wide_cli.features import UnsupportedFeature

    model, cfg = _routed()
    with pytest.raises(UnsupportedFeature, match=rf"{fmt} weights .* is not supported by the hf export's modeling code"):
        export_model(model, char_tokenizer(), tmp_path / f"hf_{fmt}", wide_config={"routing": cfg.to_dict()},
                     export_format="hf", weight_format=fmt)
    assert not (tmp_path / f"hf_{fmt}").exists()


# ----------------------------------------------------------------------------- static width
KEEP_ATT = {0: [True, False, False, True], 1: [False, True, True, True], 2: [False, False, False, False]}
KEEP_FFN = {0: [True, False, True, False], 1: [False, False, False, True], 2: [True, True, True, True]}


def _static(kind="llama", **over):
    model = tiny_model(kind, num_hidden_layers=3, **over)
    keep = {}
    for i in range(3):
        keep[(i, "attention")] = torch.tensor(KEEP_ATT[i])
        keep[(i, "ffn")] = torch.tensor(KEEP_FFN[i])
    cfg = RoutingConfig(method="static-width", attn_group_size=1, ffn_group_size=32)
    attach_routers(model, cfg, static_keep=keep)
    return model, cfg


@pytest.mark.parametrize("kind,over", [
    ("llama", {}), ("qwen2", {}), ("qwen3", {"head_dim": 32}),
    # layer 2 keeps no head: its attention block outputs zero through the sandwich norm
    ("gemma3", {"layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}),
])
def test_static_width_hf_is_physically_smaller_and_matches_masked_model(tmp_path, kind, over):
    model, cfg = _static(kind, **over)
    with torch.no_grad():
        ref = model(IDS).logits
        ref_gen = model.generate(IDS[:1, :5], max_new_tokens=6, do_sample=False, pad_token_id=2)
    wide = _export(model, cfg, tmp_path / f"static_wide_{kind}", "wide").path
    hf = _export(model, cfg, tmp_path / f"static_hf_{kind}", "hf").path
    c = json.loads((hf / "config.json").read_text())
    assert c["wide_layer_heads"] == [[0, 3], [1, 2, 3], []]
    assert c["wide_layer_intermediate_sizes"] == [64, 32, 128]
    got = _auto_load(hf)
    with torch.no_grad():
        diff = (got(IDS).logits - ref).abs().max().item()
        gen = got.generate(IDS[:1, :5], max_new_tokens=6, do_sample=False, pad_token_id=2)
    assert diff <= ATOL
    assert torch.equal(gen, ref_gen)  # decode with the KV cache, per-layer widths
    d = getattr(model.config, "head_dim", None) or 64 // 4  # Qwen2: D / H
    kv = model.config.num_key_value_heads
    with safe_open(str(hf / "model.safetensors"), "pt") as f:
        assert tuple(f.get_tensor("model.layers.0.self_attn.q_proj.weight").shape) == (2 * d, 64)
        assert tuple(f.get_tensor("model.layers.0.self_attn.o_proj.weight").shape) == (64, 2 * d)
        assert tuple(f.get_tensor("model.layers.1.mlp.down_proj.weight").shape) == (64, 32)
        assert tuple(f.get_tensor("model.layers.2.self_attn.q_proj.weight").shape) == (0, 64)
        for i in range(3):  # KV heads are never removed
            assert tuple(f.get_tensor(f"model.layers.{i}.self_attn.k_proj.weight").shape) == (kv * d, 64)
            assert tuple(f.get_tensor(f"model.layers.{i}.self_attn.v_proj.weight").shape) == (kv * d, 64)
        if kind == "qwen2":
            assert tuple(f.get_tensor("model.layers.1.self_attn.q_proj.bias").shape) == (3 * d,)
        if kind in ("qwen3", "gemma3"):
            assert tuple(f.get_tensor("model.layers.0.self_attn.q_norm.weight").shape) == (d,)
        assert not any(".router_" in k for k in f.keys())  # noqa: SIM118 (safe_open is not a dict)
    assert (hf / "model.safetensors").stat().st_size < 0.8 * (wide / "model.safetensors").stat().st_size


def test_compact_static_keeps_kv_and_drops_only_removed_rows():
    t = {"model.layers.0.self_attn.q_proj.weight": torch.arange(8.0).repeat_interleave(2).view(8, 2),
         "model.layers.0.self_attn.o_proj.weight": torch.arange(8.0).repeat(3, 1),
         "model.layers.0.self_attn.k_proj.weight": torch.ones(4, 2),
         "model.layers.0.mlp.gate_proj.weight": torch.arange(4.0).view(4, 1),
         "model.layers.0.mlp.up_proj.weight": torch.arange(4.0).view(4, 1),
         "model.layers.0.mlp.down_proj.weight": torch.arange(4.0).view(1, 4)}
    keep = {(0, "attention"): torch.tensor([False, True]), (0, "ffn"): torch.tensor([True, False])}
    out, heads, inter = compact_static(t, keep, num_layers=1, head_dim=2, attn_group_size=2, ffn_group_size=2)
    assert heads == [[2, 3]] and inter == [2]
    assert out["model.layers.0.self_attn.q_proj.weight"][:, 0].tolist() == [4, 5, 6, 7]
    assert out["model.layers.0.self_attn.o_proj.weight"][0].tolist() == [4, 5, 6, 7]
    assert out["model.layers.0.mlp.down_proj.weight"].tolist() == [[0, 1]]
    assert out["model.layers.0.self_attn.k_proj.weight"] is t["model.layers.0.self_attn.k_proj.weight"]


@pytest.mark.parametrize("fmt", ["wide", "hf"])
def test_export_is_readable_by_other_users_per_umask(tmp_path, fmt):
    """A deployable export is read by other users / services: the directory and every file get
    the usual permissions (umask), not the private 0700 / 0600 of temp files."""
    model, cfg = _routed()
    old = os.umask(0o022)
    try:
        out = _export(model, cfg, tmp_path / f"perm_{fmt}", fmt).path
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == 0o755
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert set(modes.values()) == {0o644}, modes


@pytest.mark.parametrize("method", ["wide", "static-width"])
def test_wide_eval_reads_hf_exports_like_wide_exports(tmp_path, text_file, method):
    from wide_cli.eval.run import evaluate_targets

    model, cfg = _routed() if method == "wide" else _static()
    wide = _export(model, cfg, tmp_path / "w", "wide").path
    hf = _export(model, cfg, tmp_path / "h", "hf").path
    rep = evaluate_targets([str(wide), str(hf)], tasks=[], data_dir=None, eval_data=text_file, seq_len=32,
                           batch_size=2)
    a, b = rep["rows"]
    assert a["kind"] == b["kind"] == "pruned"
    assert a["results"]["eval_data"]["perplexity"] == pytest.approx(b["results"]["eval_data"]["perplexity"], rel=1e-6)
    assert a["sparsity"]["total"] == pytest.approx(b["sparsity"]["total"]) and 0 < a["sparsity"]["total"] < 1
    assert a["flops"]["relative"] == pytest.approx(b["flops"]["relative"]) and a["flops"]["relative"] < 1
    for m in ("attention", "ffn"):
        assert a["sparsity"]["per_layer"][m] == pytest.approx(b["sparsity"]["per_layer"][m])
