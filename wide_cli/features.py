"""The export features of the routed decoder layer, and which implementation runs which.

The routed layer of DESIGN.md §1 exists in several implementations: the runtime's ``reference``,
``cpu`` and ``cupy`` backends (``runtime/engine.py``), the ``cpu`` backend's native decode step
(``kernels/cpu_decode.c`` through ``runtime/cpu_native.py``), the hf export's stand-alone modeling
code (``export/modeling_template.py``), the vLLM plugin (``serve/vllm_models.py``), and, for
exports without routers, llama.cpp through a GGUF file (``runtime/gguf_writer.py``).

``export_features`` says which features an export uses (from its ``config.json`` and
``wide_config.json``); ``SUPPORT`` is the table of what each implementation runs;
``check_features`` refuses, in one line naming the feature, the file that declares it and the
implementation, an export that uses something the implementation lacks. Each implementation calls
it when it loads an export, before any work starts (the hf modeling code carries a copy of
``export_features`` and of its own row, since it runs where wide is not installed), and
``tests/test_feature_parity.py`` runs every implementation that runs here on the same tiny
exports with each feature on and off.

Feature table (``+`` runs it, ``-`` refuses it; ``FEATURES`` says what each feature is):

====================  =========  ===  ======  ====  ==  ====  ====
feature               reference  cpu  native  cupy  hf  vllm  gguf
====================  =========  ===  ======  ====  ==  ====  ====
routers               +          +    +       +     +   +     -
standins              +          +    +       +     +   +     -
lowrank_standins      +          +    +       +     +   -     -
dropped_layers        +          +    +       +     +   +     +
static_depth          +          +    +       +     -   +     +
static_width_keep     +          +    +       +     -   +     -
static_width_compact  -          -    -       -     +   -     -
gemma3_layer          +          +    +       -     +   -     -
qk_norm               +          +    +       +     +   +     -
qkv_bias              +          +    +       +     +   +     -
o_bias                +          +    +       +     +   +     -
mlp_bias              -          -    -       -     +   -     -
sliding_window        +          +    +       +     +   +     -
rope_scaled           +          +    +       +     +   +     -
rope_dynamic          -          -    -       -     +   -     -
weights_fp32          +          +    +       +     +   +     +
weights_bf16          +          +    +       +     +   +     +
weights_fp16          +          +    +       +     +   +     +
weights_int8          +          +    +       +     -   -     +
weights_int4          +          +    +       +     -   -     +
format_wide           +          +    +       +     -   +     +
format_hf             +          +    +       +     +   +     -
====================  =========  ===  ======  ====  ==  ====  ====
"""

from __future__ import annotations

import json
from pathlib import Path

from wide_cli.errors import ConfigError
from wide_cli.filenames import CONFIG_JSON, WIDE_CONFIG

_CONFIG, _WIDE = CONFIG_JSON, WIDE_CONFIG

#: feature -> (what it is, in the words of an error line; the export file that declares it).
FEATURES: dict[str, tuple[str, str]] = {
    "routers": ("per-token routers (method wide / dynamic-depth)", _WIDE),
    "standins": ("stand-ins for skipped groups (routing.standin)", _WIDE),
    "lowrank_standins": ("low-rank stand-ins for skipped groups (routing.standin lowrank:R)", _WIDE),
    "dropped_layers": ("decoder layers removed before routing (routing.drop_layers, a hybrid export)", _WIDE),
    "static_depth": ("whole decoder layers removed (method static-depth)", _WIDE),
    "static_width_keep": ("static-width keep masks (method static-width)", _WIDE),
    "static_width_compact": ("static width physically narrowed per layer (wide_layer_heads)", _CONFIG),
    # before qk_norm: an implementation without the Gemma 3 layer is refused by the layer, not
    # by one of its parts (``unsupported`` names features in this order)
    "gemma3_layer": (("the Gemma 3 decoder layer (sandwich RMSNorms scaling by 1 + w, GELU-tanh gating, "
                      "embeddings scaled by sqrt(hidden_size), a RoPE base per layer type)"), _CONFIG),
    "qk_norm": ("per-head q/k RMSNorm (Qwen3, Gemma 3)", _CONFIG),
    "qkv_bias": ("q/k/v projection biases", _CONFIG),
    "o_bias": ("an o_proj bias (attention_bias)", _CONFIG),
    "mlp_bias": ("gate/up/down biases (mlp_bias)", _CONFIG),
    "sliding_window": ("sliding-window attention shorter than the context (sliding_window)", _CONFIG),
    "rope_scaled": ("scaled RoPE (rope_type llama3, linear, yarn, ...)", _CONFIG),
    "rope_dynamic": ("RoPE that changes with the sequence length (rope_type dynamic / longrope)", _CONFIG),
    "weights_fp32": ("fp32 weights", _CONFIG),
    "weights_bf16": ("bf16 weights", _CONFIG),
    "weights_fp16": ("fp16 weights", _CONFIG),
    "weights_int8": ("int8 weights (wide export --weights int8)", _WIDE),
    "weights_int4": ("int4 weights (wide export --weights int4)", _WIDE),
    "format_wide": ("the wide export format (base config.json + routers.safetensors)", _WIDE),
    "format_hf": ("the hf export format (remote code, routers in the weight files)", _WIDE),
}

#: feature, or (feature, implementation) -> the fix to suggest when an implementation refuses it
#: (else the implementation's); a pair wins over the feature alone.
FIXES: dict[str | tuple[str, str], str] = {
    "static_width_compact": "use the run's --format wide export (`wide export --run-dir R`)",
    "weights_int8": "export fp32 weights (`wide export` without --weights int8)",
    "weights_int4": "export fp32 weights (`wide export` without --weights int4)",
    ("gemma3_layer", "gguf"): ("export with --format wide or hf and run it with `wide generate`: wide writes GGUF "
                               "files of llama.cpp's plain Llama graph only"),
}

#: implementation -> (its name in an error line, what to use instead when it refuses).
IMPLEMENTATIONS: dict[str, tuple[str, str]] = {
    "reference": ("the runtime's reference backend", "load it with `wide eval` (transformers) instead"),
    "cpu": ("the runtime's cpu backend", "load it with `wide eval` (transformers) instead"),
    "native": ("the native decode step (kernels/cpu_decode.c)", "the cpu backend's PyTorch path runs it"),
    "cupy": ("the runtime's cupy backend", "load it with `wide eval` (transformers) instead"),
    "hf": ("the hf export's modeling code (modeling_wide.py)", "export with --format wide"),
    "vllm": ("the wide vLLM plugin", "run it with `wide generate` (the runtime) instead of `wide serve`"),
    "gguf": ("llama.cpp (GGUF)", "export with --format wide or hf: llama.cpp runs no per-token routing"),
}

#: what the runtime's backends and its native step refuse (``runtime/checkpoint.py`` refuses
#: mlp biases, length-dependent RoPE and per-layer narrowed static width).
_RUNTIME_LACKS = {"static_width_compact", "mlp_bias", "rope_dynamic"}

#: implementation -> the features it runs (the table in the module docstring), written as what
#: it lacks.
SUPPORT: dict[str, frozenset[str]] = {
    "reference": frozenset(FEATURES.keys() - _RUNTIME_LACKS),
    "cpu": frozenset(FEATURES.keys() - _RUNTIME_LACKS),
    "native": frozenset(FEATURES.keys() - _RUNTIME_LACKS),
    # the CUDA FFN kernels fuse SwiGLU only (GELU-tanh gating would need its own epilogue)
    "cupy": frozenset(FEATURES.keys() - _RUNTIME_LACKS - {"gemma3_layer"}),
    # an hf export is never int8 / int4 nor --format wide; static width is narrowed physically in it
    # (write_hf), and static depth is a plain checkpoint that needs no modeling code
    "hf": frozenset(FEATURES.keys() - {"static_depth", "static_width_keep", "weights_int8", "weights_int4",
                                                  "format_wide"}),
    # the routed FFN op has no biases; vLLM's RoPE is not transformers' length-dependent one;
    # int8 / int4 weights are wide's own layouts; the fused routed ops add constant stand-ins only
    "vllm": frozenset(FEATURES.keys() - {"static_width_compact", "mlp_bias", "rope_dynamic", "weights_int8",
                                         "weights_int4", "lowrank_standins", "gemma3_layer"}),
    # llama.cpp's ``llama`` graph as runtime/gguf_writer.py writes it: a plain dense Llama
    "gguf": frozenset({"dropped_layers", "static_depth", "weights_fp32", "weights_bf16", "weights_fp16",
                       "weights_int8", "weights_int4", "format_wide"}),
}


class UnsupportedFeature(ConfigError):
    """An export uses a feature an implementation does not run (exit 2, before any work).

    Attributes:
        feature: the ``FEATURES`` key; implementation: the ``IMPLEMENTATIONS`` key.
    """

    def __init__(self, feature: str, implementation: str, where: str | Path | None = None, *,
                 label: str | None = None):
        what, file = FEATURES[feature]
        name, fix = IMPLEMENTATIONS[implementation]
        fix = FIXES.get((feature, implementation), FIXES.get(feature, fix))
        self.feature, self.implementation = feature, implementation
        at = label if label is not None else str(Path(where) / file) if where is not None else file
        super().__init__(f"{at}: {what} [{feature}] is not supported by {name}", fix)


def export_features(config: dict, wide_config: dict | None = None) -> frozenset:
    """The features (``FEATURES`` keys) an export uses.

    Self-contained (builtins only): ``export/modeling_template.py`` copies it verbatim into the hf
    export's ``modeling_wide.py``.

    Args:
        config: the export's full model config as a dict (``PretrainedConfig.to_dict()``: the
            defaults of its config class included, since ``config.json`` omits them), with
            ``wide_routing`` for an hf export.
        wide_config: the export's ``wide_config.json`` (None: an hf export read by its own code,
            or an in-memory model: then ``routing`` comes from ``config["wide_routing"]``); its
            ``export_format`` (default ``wide``, or ``hf`` when the config has ``wide_routing``
            and there is no wide_config) and ``weight_format`` are read.

    Returns:
        A frozenset of feature names; exactly one ``weights_*`` and one ``format_*``.
    """
    wc = wide_config or {}
    wr = config.get("wide_routing") or {}
    routing = wc.get("routing") or wr.get("routing") or {}
    method = routing.get("method") or wc.get("method") or ("wide" if routing else "dense")
    out = set()
    if method in ("wide", "dynamic-depth") and (routing.get("route_attention", True) or routing.get("route_ffn", True)):
        out.add("routers")
        if routing.get("standin") not in (None, "none"):
            out.add("standins")
        if str(routing.get("standin") or "").startswith("lowrank:"):
            out.add("lowrank_standins")
    if method == "static-width":
        out.add("static_width_compact" if config.get("wide_layer_heads") is not None else "static_width_keep")
    if int(routing.get("drop_layers") or 0) > 0 or wc.get("dropped_layers"):
        out.add("dropped_layers")
    if wc.get("method") == "static-depth" or wc.get("static_depth"):
        out.add("static_depth")
    model_type = str(config.get("model_type") or "").removeprefix("wide_")
    if model_type in ("qwen3", "gemma3_text"):
        out.add("qk_norm")
    if model_type == "gemma3_text":
        out.add("gemma3_layer")
    if model_type == "qwen2" or config.get("attention_bias"):
        out.add("qkv_bias")
    if config.get("attention_bias") and model_type != "qwen2":
        out.add("o_bias")
    if config.get("mlp_bias"):
        out.add("mlp_bias")
    window, types = config.get("sliding_window"), config.get("layer_types")
    windowed = "sliding_attention" in types if types is not None else model_type == "mistral"
    context = config.get("max_position_embeddings")
    if window and windowed and (context is None or int(window) < int(context)):
        out.add("sliding_window")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    # one RoPE for every layer, or one per layer type ({"sliding_attention": {...}, ...}: Gemma 3)
    per_type = [v for v in rope.values() if isinstance(v, dict)] or [rope]
    rope_types = {r.get("rope_type") or r.get("type") or "default" for r in per_type}
    if rope_types & {"dynamic", "longrope"}:
        out.add("rope_dynamic")
    elif rope_types - {"default"}:
        out.add("rope_scaled")
    qfmt = (wc.get("weight_format") or {}).get("format")
    if qfmt in ("int8", "int4"):
        out.add(f"weights_{qfmt}")
    else:
        dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32").removeprefix("torch.")
        out.add({"bfloat16": "weights_bf16", "float16": "weights_fp16"}.get(dtype, "weights_fp32"))
    fmt = wc.get("export_format") or ("hf" if wr and not wc else "wide")
    out.add("format_hf" if fmt == "hf" else "format_wide")
    return frozenset(out)


def unsupported(features, implementation: str) -> list[str]:
    """The features of ``features`` that ``implementation`` does not run, in ``FEATURES`` order."""
    row = SUPPORT[implementation]
    return [f for f in FEATURES if f in features and f not in row]


def check_features(features, implementation: str, where: str | Path | None = None, *,
                   label: str | None = None) -> None:
    """Refuse ``features`` that ``implementation`` (an ``IMPLEMENTATIONS`` key) does not run.

    Args:
        features: from ``export_features`` / ``read_export_features``.
        where: the export directory, named in the message with the file that declares the feature.
        label: what to name instead of a file (e.g. ``run runs/x`` for a run not exported yet).

    Raises:
        UnsupportedFeature: the first unsupported feature, e.g. ``e/wide_config.json: stand-ins for
            skipped groups (routing.standin) [standins] is not supported by the wide vLLM plugin``.
    """
    bad = unsupported(features, implementation)
    if bad:
        raise UnsupportedFeature(bad[0], implementation, where, label=label)


def full_config(config: dict) -> dict:
    """``config`` (a ``config.json`` as written: defaults omitted) with the defaults of its
    transformers config class filled in (``wide_<base>`` hf exports read as ``<base>``); as it is
    when the model type is unknown."""
    from transformers import CONFIG_MAPPING

    model_type = str(config.get("model_type") or "")
    base = model_type.removeprefix("wide_")
    if base not in CONFIG_MAPPING:
        return dict(config)
    d = {k: v for k, v in config.items() if k != "model_type"}
    full = CONFIG_MAPPING[base](**d).to_dict()
    full["model_type"] = model_type
    return full


def read_export_features(path) -> frozenset:
    """``export_features`` of the export directory ``path`` (its ``config.json`` with the config
    class defaults, and ``wide_config.json`` when present).

    Raises:
        CheckpointError: a missing or unreadable ``config.json``, or an unreadable ``wide_config.json``.
    """
    from wide_cli.errors import CheckpointError

    path = Path(path)
    docs = {}
    for name in (_CONFIG, _WIDE):
        p = path / name
        if name == _WIDE and not p.is_file():
            docs[name] = None
            continue
        try:
            docs[name] = json.loads(p.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{p} is missing", "is this a wide export directory?") from None
        except ValueError as e:
            raise CheckpointError(f"{p} is not valid JSON ({e})", "re-run `wide export`") from None
    return export_features(full_config(docs[_CONFIG]), docs[_WIDE])


def check_export(path, implementation: str) -> frozenset:
    """``check_features(read_export_features(path), implementation, path)``; returns the features.

    Raises:
        UnsupportedFeature, CheckpointError: see those functions.
    """
    feats = read_export_features(path)
    check_features(feats, implementation, path)
    return feats
