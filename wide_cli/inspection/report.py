"""What ``wide inspect`` reports about an export: sizes, settings, measured sparsity per layer
and module, and which groups each token of a prompt used.

Pure data: nothing here prints (``render.py`` draws it, ``plot.py`` plots it). Sizes and settings
come from the files alone; sparsity comes from ``wide_config.json`` unless a text is given, in
which case the export is loaded and measured on it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from wide_cli.artifacts import ExportInfo
from wide_cli.errors import CheckpointError, ConfigError
from wide_cli.filenames import CONFIG_JSON, WIDE_CONFIG
from wide_cli.models.arch import ROUTED_MODULES

MODULES = ROUTED_MODULES


# ----------------------------------------------------------------------------- files
def file_sizes(path: Path) -> dict[str, int]:
    """``{relative path: bytes}`` of every visible file of the export (manifest included)."""
    path = Path(path)
    return {str(p.relative_to(path)): p.stat().st_size for p in sorted(path.rglob("*"))
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)}


def parameter_counts(path: Path) -> dict:
    """Parameters stored in the export's safetensors files, read from their headers only.

    Returns ``{"backbone": n, "routers": n, "total": n, "dtypes": {dtype: n}}`` (router tensors
    are the ``.router_attention.`` / ``.router_ffn.`` ones, in whichever file they live).
    """
    from safetensors import safe_open

    from wide_cli.artifacts import is_router_tensor

    counts = {"backbone": 0, "routers": 0}
    dtypes: dict[str, int] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():  # noqa: SIM118 (safe_open is not a dict)
                sl = h.get_slice(k)
                n = 1
                for d in sl.get_shape():
                    n *= int(d)
                counts["routers" if is_router_tensor(k) else "backbone"] += n
                dtypes[str(sl.get_dtype())] = dtypes.get(str(sl.get_dtype()), 0) + n
    return {**counts, "total": counts["backbone"] + counts["routers"], "dtypes": dtypes}


def settings_of(wc: dict) -> dict:
    """The settings worth showing, flat: source, group layout, rank, targets, training, version."""
    info = ExportInfo(wc)
    r, lay = info.routing, info.layout
    tr = (wc.get("settings") or {}).get("train") or {}
    src = wc.get("source_model") or {}
    out = {
        "source model": src.get("spec"),
        "attn group size": lay.get("attn_group_size", r.get("attn_group_size")),
        "ffn group size": lay.get("ffn_group_size", r.get("ffn_group_size")),
        "groups (attention/ffn)": f"{lay.get('attn_groups', '-')}/{lay.get('ffn_groups', '-')}" if lay else None,
        "router rank": r.get("router_rank") if info.routing_method in ("wide", "dynamic-depth") else None,
        "stand-ins": (r.get("standin") if info.routing_method in ("wide", "dynamic-depth")
                      and r.get("standin") not in (None, "none") else None),
        "sparsity target": (f"{r['sparsity_attention']}/{r['sparsity_ffn']} (attention/ffn)"
                            if r.get("sparsity_attention") is not None else r.get("sparsity")),
        "train steps": tr.get("steps"),
        "lora": "merged" if info.lora else None,
        "wide version": wc.get("wide_version"),
        "created": wc.get("created"),
        "export id": wc.get("export_id"),
    }
    sd = info.static_depth
    if sd:  # a plain smaller model: no groups, routers or sparsity target
        for k in ("attn group size", "ffn group size", "groups (attention/ffn)", "router rank", "stand-ins",
                  "sparsity target", "train steps"):
            out.pop(k, None)
        out["removed layers"] = f"{sd['removed']} ({len(sd['removed'])} of {sd['num_layers']})"
        out["cost target / reached"] = f"{sd['cost_target']} / {sd['cost_fraction']:.3f} of dense {sd['cost_metric']}"
        out["healing steps"] = ((wc.get("train") or {}).get("stage2") or {}).get("steps")
    st = info.static_width
    if st:
        out["kept query heads per layer"] = [len(h) for h in st["kept_heads"]]
        out["kept ffn channels per layer"] = st["intermediate_sizes"]
    return {k: v for k, v in out.items() if v is not None}


# ----------------------------------------------------------------------------- model
def load_export(path: Path, *, verify: bool = True, trust_remote_code: bool = False):
    """Load an export of either format (a ``PrunedModel``), CPU, fp32, argmax routing; an hf
    export's shipped code runs only with ``trust_remote_code``."""
    from wide_cli.export.loader import load_pruned

    if ExportInfo.read(path).export_format == "hf":
        from wide_cli.export.hf_format import load_hf_export

        return load_hf_export(path, verify=verify, trust_remote_code=trust_remote_code)
    return load_pruned(path, verify=verify)


def measure_on_text(model, tokenizer, text: str, *, seq_len: int = 256, max_tokens: int = 8192) -> dict:
    """Measured sparsity of ``model`` on ``text``: windows of ``seq_len`` tokens (the last one
    may be shorter), at most ``max_tokens`` tokens. Returns ``SparsityCounter.summary()`` plus
    ``tokens`` and ``distinct_masks`` (per module and layer, how many distinct masks its router
    gave those tokens; ``routing.measure.measure_sparsity``).

    Raises:
        DataError: a text with fewer than 2 tokens.
    """
    from wide_cli.errors import DataError
    from wide_cli.routing.measure import measure_sparsity

    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0][:max_tokens]
    if ids.numel() < 2:
        raise DataError(f"the text has {ids.numel()} tokens; need at least 2 to measure sparsity")
    return measure_sparsity(model, (ids[i : i + seq_len].unsqueeze(0) for i in range(0, ids.numel(), seq_len)),
                            distinct_masks=True)


@dataclass
class PromptTrace:
    """Which groups each token of a prompt executed.

    Attributes:
        tokens: the prompt's tokens as strings, ``T`` of them.
        execute: per module, ``[L][T][G]`` lists of bool (True = the group ran); a layer whose
            module is not routed holds None.
        static: True when the decisions come from a static-width export's kept groups.
    """

    tokens: list[str]
    execute: dict[str, list]
    static: bool = False

    def layer_count(self) -> int:
        return max((len(v) for v in self.execute.values()), default=0)

    def summary(self, module: str) -> list[list[float]] | None:
        """``[T][G]``: per token and group, the fraction of routed layers in which it ran."""
        layers = [x for x in self.execute.get(module, []) if x is not None]
        if not layers:
            return None
        T, G = len(layers[0]), len(layers[0][0])
        return [[sum(layer[t][g] for layer in layers) / len(layers) for g in range(G)] for t in range(T)]


def trace_prompt(model, tokenizer, prompt: str, wide_config: dict) -> PromptTrace:
    """Run ``prompt`` once through the routed model and record every routing decision
    (``model.wide_routing.trace``). Static-width hf exports have no routers at all: their kept
    groups (``wide_config.json``) are the decisions for every token."""
    import torch

    ids = tokenizer(prompt, return_tensors="pt").input_ids
    if ids.numel() == 0:
        raise ConfigError("--prompt is empty after tokenisation", "give a non-empty prompt")
    tokens = [str(t) for t in tokenizer.convert_ids_to_tokens(ids[0].tolist())]
    state = model.wide_routing
    n_layers = int(model.config.num_hidden_layers)
    execute: dict[str, list] = {m: [None] * n_layers for m in MODULES}
    state.trace = []
    try:
        with torch.no_grad():
            model(input_ids=ids)
        trace = list(state.trace)
    finally:
        state.trace = None
    for layer, module, ex in trace:  # ex: [B=1, T, G] bool
        execute[module][layer] = ex[0].tolist()
    static = False
    info = ExportInfo(wide_config)
    st = info.static_width
    if not trace and st:
        static = True
        lay = info.layout
        G = {"attention": lay.get("attn_groups"), "ffn": lay.get("ffn_groups")}
        for m in MODULES:
            for i, kept in enumerate(st["kept_groups"][m]):
                row = [g in set(kept) for g in range(G[m])]
                execute[m][i] = [list(row) for _ in tokens]
    return PromptTrace(tokens, {m: v for m, v in execute.items() if any(x is not None for x in v)}, static)


# ----------------------------------------------------------------------------- report
@dataclass
class InspectReport:
    """Everything ``wide inspect`` shows (``to_dict`` is its ``--json``)."""

    path: Path
    format: str
    method: str
    files: dict[str, int]
    parameters: dict
    settings: dict
    sparsity: dict | None
    sparsity_source: str
    plot: Path | None = None
    prompt: PromptTrace | None = None
    layer: int | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(self.files.values())

    def to_dict(self) -> dict:
        d = {
            "path": str(self.path), "format": self.format, "method": self.method,
            "files": self.files, "bytes": self.bytes, "parameters": self.parameters,
            "settings": self.settings, "sparsity": self.sparsity, "sparsity_source": self.sparsity_source,
            "plot": str(self.plot) if self.plot else None, "warnings": self.warnings,
        }
        if self.prompt is not None:
            d["prompt"] = {"tokens": self.prompt.tokens, "static": self.prompt.static, "layer": self.layer,
                           "execute": {m: [None if x is None else [[int(b) for b in row] for row in x] for x in v]
                                       for m, v in self.prompt.execute.items()}}
        return d


def inspect_export(
    path,
    *,
    text: str | None = None,
    text_name: str | None = None,
    prompt: str | None = None,
    layer: int | None = None,
    plot: Path | None = None,
    seq_len: int = 256,
    max_tokens: int = 8192,
    verify: bool = True,
    trust_remote_code: bool = False,
) -> InspectReport:
    """Build the report of ``wide inspect`` for export ``path``.

    Args:
        text: measure sparsity on this text (loads the model) instead of the stored measurement.
        text_name: where ``text`` came from (shown as the data of the measurement).
        prompt: record which groups each of its tokens used (loads the model).
        layer: the layer of the prompt heat-map (None = all layers summarised).
        plot: write a PNG of per-layer attention and FFN sparsity there.
        seq_len, max_tokens: windows for the ``text`` measurement.
        verify: check ``manifest.json`` (sha256 and size of every file) first.
        trust_remote_code: let an hf export's shipped code run when the model is loaded.

    Raises:
        CheckpointError: not an export, or a missing / damaged file (named).
        ConfigError: ``layer`` out of range, or ``layer`` without ``prompt``.
    """
    from wide_cli.artifacts import check_manifest_owner, verify_manifest

    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"export directory {str(path)!r} does not exist", "check the path")
    if layer is not None and prompt is None:
        raise ConfigError("--layer needs --prompt", "add --prompt TEXT, or drop --layer")
    if verify:
        check_manifest_owner(path)
        verify_manifest(path)
    info = ExportInfo.read(path)
    wc, fmt, method = info.wide_config, info.export_format, info.method
    n_layers = _num_layers(path)
    if layer is not None and not 0 <= layer < n_layers:
        raise ConfigError(f"--layer {layer} is out of range: the model has {n_layers} layers",
                          f"use 0..{n_layers - 1}, or omit --layer to summarise all layers")
    sparsity = wc.get("measured_sparsity") or None
    source = f"stored in {WIDE_CONFIG} ({sparsity.get('data', 'held-out data')})" if sparsity else "none stored"
    trace = None
    if text is not None or prompt is not None:
        pm = load_export(path, verify=False, trust_remote_code=trust_remote_code)  # verified above
        if text is not None and info.static_width:  # no routers: the kept groups are the sparsity
            from wide_cli.routing.measure import static_sparsity

            sparsity = static_sparsity(wc)
            source = "fixed by the kept groups of this static-width export (the same for any text)"
        elif text is not None:
            sparsity = measure_on_text(pm.model, pm.tokenizer, text, seq_len=seq_len, max_tokens=max_tokens)
            sparsity["data"] = text_name or "given text"
            source = f"measured now on {sparsity['data']} ({sparsity['tokens']} tokens)"
        if prompt is not None:
            trace = trace_prompt(pm.model, pm.tokenizer, prompt, wc)
    report = InspectReport(path, fmt, method, file_sizes(path), parameter_counts(path), settings_of(wc),
                           sparsity, source, prompt=trace, layer=layer)
    if sparsity and sparsity.get("distinct_masks") and sparsity.get("tokens", 0) > 1:
        report.warnings += static_router_warnings(sparsity)
    if plot is not None:
        from wide_cli.inspection.plot import plot_sparsity

        if not sparsity or not sparsity.get("per_layer"):
            raise ConfigError("no per-layer sparsity to plot", "pass --text FILE to measure it")
        report.plot = plot_sparsity(sparsity["per_layer"], plot, title=f"{path.name} ({method})")
    return report


def static_router_warnings(sparsity: dict) -> list[str]:
    """One warning naming the routers that gave every measured token the same partial mask
    (``routing.measure.static_routers``), or none. Such a router is a static mask: the export
    routes no token differently from another there, and its text tends to repeat itself."""
    from wide_cli.routing.measure import static_routers

    static = static_routers(sparsity["distinct_masks"], sparsity.get("per_layer"))
    routed = sum(n is not None for v in sparsity["distinct_masks"].values() for n in v)
    if not static:
        return []
    where = ", ".join(f"{m} {i}" for m, i in static[:8]) + (" ..." if len(static) > 8 else "")
    return [(f"{len(static)} of {routed} routers gave all {sparsity['tokens']} measured tokens the same groups "
             f"({where}): they act as static masks, not per-token routing; if the model's residual stream has a "
             "large mean (Gemma 3), retrain with --router-input standardized")]


def _num_layers(path: Path) -> int:
    p = Path(path) / CONFIG_JSON
    try:
        return int(json.loads(p.read_text())["num_hidden_layers"])
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"{p} is unreadable ({e})", "re-run `wide export`") from None
