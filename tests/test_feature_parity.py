"""One routed layer, several implementations: every implementation that runs here (the runtime's
reference backend, the cpu backend's PyTorch path, its native decode step, the hf export's
modeling code, and the training layer of the model each export was written from) on the same tiny
exports, each export feature of ``wide_cli.features`` on (one export per feature) and off (the
plain routed Llama every other export differs from). The vLLM plugin runs in the serving suite
(``tests/serve/test_vllm.py``).

For each (export, implementation) the feature table decides: a supported export runs and must give
the reference backend's results; an unsupported one must be refused with ``UnsupportedFeature``
(when the hf export is written, or when it is loaded), never run, in one line naming the file that
declares the feature, the feature and the implementation. The oracle of an export the reference
backend refuses (mlp biases, length-dependent RoPE) is the in-memory model's training layer.

What is compared, on a 9-token prompt and 8 greedy tokens (EOS ignored):
- greedy tokens: equal (int8: up to the first near-tie of the reference's logits, see
  ``_until_near_tie``: the native step also rounds activations to int8);
- routing decisions: per layer and module, the number of skipped (token, group) decisions over
  the prompt and the reference's tokens: equal (the hf modeling code's static width is physically
  narrowed and makes none: not compared there);
- logits at the last prompt position and at each of the reference's tokens (teacher-forced):
  fp32 compute within 1e-4 absolute (logits of magnitude ~3: the same math in another summation
  order, ~1e-6 seen); int8 weights compute in bf16 (``runtime.quant.COMPUTE_DTYPE``), within 3 %
  of the largest logit (``tests/runtime/test_weight_formats.py``'s bf16 tolerance).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests._exports import feature_model
from wide_cli import features
from wide_cli.export import export_model
from wide_cli.features import FEATURES, UnsupportedFeature, read_export_features, unsupported
from wide_cli.models.arch import ROUTED_MODULES
from wide_cli.models.tiny import char_tokenizer

PROMPT = [5, 17, 33, 60, 61, 62, 90, 12, 40]
NEW = 8
FP32_ATOL = 1e-4
REL_ATOL = 0.03
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 128, "rope_theta": 500000.0}

#: export name -> (feature_model arguments, weight format, features it must have on).
EXPORTS = {
    "plain": ({}, "fp32", {"routers", "format_wide", "weights_fp32"}),
    "standins": ({"standin": "trained"}, "fp32", {"standins"}),
    "lowrank_standins": ({"standin": "lowrank:4"}, "fp32", {"standins", "lowrank_standins"}),
    "dropped_layers": ({"drop_layers": 1, "standin": "mean"}, "fp32", {"dropped_layers", "standins"}),
    "dynamic_depth": ({"method": "dynamic-depth"}, "fp32", {"routers"}),
    "static_width_keep": ({"method": "static-width", "ags": 1}, "fp32", {"static_width_keep"}),
    "static_depth": ({"method": "dense"}, "fp32", {"static_depth"}),
    "qk_norm": ({"kind": "qwen3", "head_dim": 32}, "fp32", {"qk_norm"}),
    "gemma3_layer": ({"kind": "gemma3"}, "fp32", {"gemma3_layer", "qk_norm", "sliding_window"}),
    "qkv_bias": ({"kind": "qwen2"}, "fp32", {"qkv_bias"}),
    "o_bias": ({"attention_bias": True}, "fp32", {"qkv_bias", "o_bias"}),
    "sliding_window": ({"kind": "mistral", "sliding_window": 4}, "fp32", {"sliding_window"}),
    "rope_scaled": ({"head_dim": 32, "max_position_embeddings": 1024, "rope_parameters": LLAMA3_ROPE}, "fp32",
                    {"rope_scaled"}),
    "weights_bf16": ({"dtype": torch.bfloat16}, "fp32", {"weights_bf16"}),
    "weights_fp16": ({"dtype": torch.float16}, "fp32", {"weights_fp16"}),
    "weights_int8": ({}, "int8", {"weights_int8"}),
    "format_hf": ({}, "hf", {"format_hf"}),
    "mlp_bias": ({"mlp_bias": True}, "fp32", {"mlp_bias"}),
    "rope_dynamic": ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}, "fp32",
                     {"rope_dynamic"}),
    "static_width_compact": ({"method": "static-width", "ags": 1}, "hf", {"static_width_compact"}),
}
IMPLEMENTATIONS = ("reference", "cpu", "native", "hf")


@dataclass
class Result:
    tokens: list[int]
    logits: torch.Tensor  # [NEW, V] fp32: last prompt position, then the reference's tokens but the last
    skipped: torch.Tensor | None  # [L, 2] skipped decisions per layer and (attention, ffn); None: none made


def _build(name: str, root):
    """``{"wide": path, "hf": path or UnsupportedFeature}`` of export ``name`` (the model written
    in both formats; the ``format_hf`` export is only hf, read by every implementation)."""
    kw, weights, _ = EXPORTS[name]
    kw = dict(kw)
    kind = kw.pop("kind", "llama")
    dtype = kw.pop("dtype", None)
    static_depth = kw.get("method") == "dense"
    model, wc = feature_model(kind, **kw)
    if dtype is not None:  # backbone stored in bf16, routers stay fp32
        for n, p in model.named_parameters():
            if ".router_" not in n:
                p.data = p.data.to(dtype)
        model.config.dtype = dtype
    if static_depth:  # a plain smaller model, as static_depth.export records it
        wc = {**wc, "method": "static-depth",
              "static_depth": {"removed": [2], "kept": [0, 1], "num_layers": 3, "cost_target": 0.75,
                               "cost_metric": "flops", "cost_fraction": 0.667, "calibration_tokens": 64}}
    tok = char_tokenizer()
    out = {"model": model}
    fmt = "int8" if weights == "int8" else "fp32"
    if weights != "hf":
        out["wide"] = export_model(model, tok, root / f"{name}-wide", wide_config=wc, weight_format=fmt).path
    try:
        out["hf"] = export_model(model, tok, root / f"{name}-hf", wide_config=wc, export_format="hf",
                                 weight_format=fmt).path
    except UnsupportedFeature as e:
        out["hf"] = e
    if weights == "hf":
        out["wide"] = out["hf"]
    return out


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    made: dict = {}
    root = tmp_path_factory.mktemp("parity")

    def get(name: str) -> dict:
        if name not in made:
            made[name] = _build(name, root)
        return made[name]

    return get


def _runtime(path, impl: str):
    from wide_cli.runtime.engine import Runtime

    rt = Runtime.from_export(path, backend="reference" if impl == "reference" else "cpu")
    rt.native_decode = impl == "native"
    return rt


def _run_runtime(path, impl: str, forced_tokens: list[int] | None) -> Result:
    rt = _runtime(path, impl)
    tokens = rt.generate([PROMPT], max_new_tokens=NEW, ignore_eos=True).tokens[0]
    teacher = forced_tokens if forced_tokens is not None else tokens
    rt.stats.reset()
    cache = rt.new_cache(1, len(PROMPT) + NEW)
    logits = [rt.step(torch.tensor([PROMPT]), None, cache)]
    for t in teacher[:-1]:
        logits.append(rt.step(torch.tensor([[t]]), None, cache))
    if impl == "native":
        from wide_cli.runtime import cpu_native

        assert isinstance(rt._native, cpu_native.NativeDecoder), "the native step did not run"
    rt.stats.flush()
    return Result(tokens, torch.cat(logits).float(), rt.stats.skipped.clone())


def _run_hf(path, forced_tokens: list[int] | None) -> Result:
    from wide_cli.export.hf_format import load_hf_export

    return _run_hf_model(load_hf_export(path).model, forced_tokens)


def _run_hf_model(model, forced_tokens: list[int] | None) -> Result:
    """Greedy tokens, teacher-forced logits and decisions of a routed transformers model (the hf
    export's modeling code, or the training layer ``routing/layer.py`` of an in-memory model)."""
    model.generation_config.eos_token_id = None  # greedy through EOS, like ignore_eos
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        tokens = model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)[0, len(PROMPT):].tolist()
        teacher = forced_tokens if forced_tokens is not None else tokens
        st = model.wide_routing
        st.trace = []
        full = torch.tensor([PROMPT + teacher[:-1]])
        logits = model(full).logits[0, len(PROMPT) - 1 :].float()
        trace, st.trace = st.trace, None
    skipped = None
    if trace:
        skipped = torch.zeros(len(model.model.layers), 2, dtype=torch.float64)
        for layer, module, ex in trace:
            skipped[layer, ROUTED_MODULES.index(module)] += float((~ex).sum())
    return Result(tokens, logits, skipped)


@pytest.fixture(scope="module")
def reference(exports):
    """The oracle of each export: the reference backend, or for an export it refuses
    (``mlp_bias``) the in-memory model's training layer (``routing/layer.py``)."""
    done: dict = {}

    def get(name: str) -> Result:
        if name not in done:
            paths = exports(name)
            if unsupported(read_export_features(paths["wide"]), "reference"):
                done[name] = _run_hf_model(paths["model"], None)
            else:
                done[name] = _run_runtime(paths["wide"], "reference", None)
        return done[name]

    return get


def _native_available() -> str | None:
    from wide_cli.runtime import cpu_native

    return None if cpu_native.library() is not None else cpu_native.unavailable_reason()


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("name", list(EXPORTS))
def test_implementation_runs_the_export_like_the_reference_or_refuses_it(exports, reference, name, impl):
    if impl == "native" and (why := _native_available()):
        pytest.skip(f"native decode step unavailable: {why}")
    paths = exports(name)
    path = paths["hf" if impl == "hf" else "wide"]
    if isinstance(path, UnsupportedFeature):  # refused when the hf export was written
        assert path.implementation == "hf" and unsupported(_features(paths), "hf")
        return
    feats = read_export_features(path)
    assert _expected(name, hf=impl == "hf" or EXPORTS[name][1] == "hf") <= feats
    if unsupported(feats, impl):
        with pytest.raises(UnsupportedFeature) as e:
            if impl == "hf":
                _run_hf(path, None)
            else:
                _run_runtime(path, impl, None)
        # the native step runs inside the cpu backend, which checks its own row first
        refuser = "cpu" if impl == "native" and unsupported(feats, "cpu") else impl
        assert (e.value.implementation, e.value.feature) == (refuser, unsupported(feats, refuser)[0])
        what, file = FEATURES[e.value.feature]
        assert str(e.value).startswith(f"{path / file}: {what} [{e.value.feature}] is not supported by "
                                       f"{features.IMPLEMENTATIONS[refuser][0]} (")
        assert "\n" not in str(e.value)
        return
    ref = reference(name)
    got = _run_hf(path, ref.tokens) if impl == "hf" else _run_runtime(path, impl, ref.tokens)
    low = "weights_int8" in feats
    atol = REL_ATOL * float(ref.logits.abs().max()) if low else FP32_ATOL
    torch.testing.assert_close(got.logits, ref.logits, atol=atol, rtol=0)
    n = _until_near_tie(ref.logits, atol if low else 0.0)
    assert got.tokens[:n] == ref.tokens[:n]
    if got.skipped is not None or "static_width_compact" not in feats:
        assert got.skipped is not None and torch.equal(got.skipped, ref.skipped), (got.skipped, ref.skipped)
    routed = {"routers", "static_width_keep", "static_width_compact"} & feats
    assert (float(ref.skipped.sum()) > 0) == bool(routed)  # the routed exports really skip groups


def _until_near_tie(logits: torch.Tensor, atol: float) -> int:
    """How many greedy steps must agree: all of them, or (``atol`` > 0) those before the first
    step whose reference top-2 logits are within ``2 atol`` (where rounding within the tolerance
    may pick the other token, and the continuations part)."""
    if atol <= 0:
        return logits.shape[0]
    top = logits.topk(2, dim=-1).values
    near = ((top[:, 0] - top[:, 1]) < 2 * atol).nonzero()
    return int(near[0]) if near.numel() else logits.shape[0]


def _expected(name: str, *, hf: bool) -> set:
    """The features export ``name`` must have on, in the hf format (static width narrowed
    physically there) or the wide one."""
    want = set(EXPORTS[name][2])
    if hf:
        want = {"format_hf" if f == "format_wide" else "static_width_compact" if f == "static_width_keep" else f
                for f in want} | {"format_hf"}
    return want


def _features(paths: dict) -> frozenset:
    return read_export_features(paths["wide"])


def test_hf_modeling_code_refuses_a_feature_its_row_lacks_when_the_model_is_built(exports, tmp_path, monkeypatch):
    """The hf export's own code (plain transformers, ``trust_remote_code``) checks its row of the
    table too: a config that declares static-width keep masks (only ``--format wide`` carries
    them) is refused in one line before any weight is read."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf_modules"))
    path = shutil.copytree(exports("plain")["hf"], tmp_path / "edited")
    cfg = json.loads((path / "config.json").read_text())
    cfg["wide_routing"]["routing"]["method"] = "static-width"
    (path / "config.json").write_text(json.dumps(cfg))
    assert "static_width_keep" in unsupported(features.export_features(features.full_config(cfg)), "hf")
    with pytest.raises(ValueError) as e:
        AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
    assert str(e.value).startswith("config.json: export feature 'static_width_keep' is not supported by this "
                                   "modeling_wide.py (it runs ")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", [n for n, (_, weights, _) in EXPORTS.items() if weights != "int8"])
def test_training_layer_gives_the_reference_results(exports, reference, name):
    """The training-time routed layer (``routing/layer.py``, argmax decisions) of the model each
    export was written from gives the reference results (the int8 export is left out: its weights
    are not the in-memory model's)."""
    paths = exports(name)
    ref = reference(name)
    got = _run_hf_model(paths["model"], ref.tokens)
    half = paths["model"].dtype in (torch.bfloat16, torch.float16)  # computes in its storage dtype
    atol = REL_ATOL * float(ref.logits.abs().max()) if half else FP32_ATOL
    torch.testing.assert_close(got.logits, ref.logits, atol=atol, rtol=0)
    assert got.tokens == ref.tokens
    if got.skipped is None:  # no routers (static depth): the reference skipped nothing either
        assert float(ref.skipped.sum()) == 0
    else:
        assert torch.equal(got.skipped, ref.skipped), (got.skipped, ref.skipped)
