"""``README.md`` of an export (both formats): base model, method, settings, measured sparsity,
the eval table when metrics are present, files, and how to load it (wide and plain transformers).

``render_model_card`` is a pure function of ``wide_config.json`` (plus the file list), so the
card never states anything the metadata does not hold.
"""

from __future__ import annotations

import re
from pathlib import Path

from wide_cli.artifacts import ExportInfo
from wide_cli.atomic import atomic_write_bytes
from wide_cli.filenames import MANIFEST

MODEL_CARD = "README.md"

_METHOD_TEXT = {
    "wide": "token-level dynamic width (WIDE): per token and per layer, small routers choose which "
    "query-head groups and which FFN channel groups run; skipped groups are not computed",
    "dynamic-depth": "token-level dynamic depth (baseline): per token and per layer, a router skips "
    "the whole attention block or the whole FFN block",
    "static-width": "static width (baseline): the same least-important head groups and FFN channel "
    "groups are removed for every token, chosen from calibration statistics",
    "static-depth": "static depth (ShortGPT baseline): the decoder layers with the lowest Block Influence "
    "(1 - cosine between a layer's input and output) are removed; a plain smaller model, no routing",
    "dense": "dense (baseline): the unmodified model, no routing",
}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _pct(v) -> str:
    return "-" if v is None else f"{100 * float(v):.1f} %"


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return ", ".join(map(str, v))
    return str(v)


def _table(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(_fmt(c) for c in r) + " |" for r in rows]
    return out


def metrics_table(metrics: dict) -> list[str]:
    """Markdown lines for a metrics dict; [] when there is nothing numeric to show.

    Accepts ``{metric: number}`` (one column) or ``{row: {metric: number}}`` (e.g.
    ``{"dense": {"perplexity": ..}, "pruned": {...}}``: one row per key, one column per metric).
    """
    flat = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    nested = {k: v for k, v in metrics.items() if isinstance(v, dict)}
    lines: list[str] = []
    if nested:
        cols: list[str] = []
        for v in nested.values():
            cols += [c for c, x in v.items() if isinstance(x, (int, float)) and not isinstance(x, bool) and c not in cols]
        if cols:
            lines += _table(["", *cols], [[k, *(v.get(c) for c in cols)] for k, v in nested.items()])
    if flat:
        if lines:
            lines.append("")
        lines += _table(["metric", "value"], [[k, v] for k, v in flat.items()])
    return lines


def _settings_rows(wc: dict) -> list[list]:
    info = ExportInfo(wc)
    r, lay = info.routing, info.layout
    rows = [["method", info.method]]
    sd = info.static_depth
    if sd:
        rows += [["removed layers (of the source's)", f"{sd['removed']} ({len(sd['removed'])} of {sd['num_layers']})"],
                 ["cost target / reached", f"{sd['cost_target']} / {sd['cost_fraction']:.3f} of dense {sd['cost_metric']}"],
                 ["Block Influence measured on", f"{sd['calibration_tokens']} training tokens"]]
        heal = (wc.get("train") or {}).get("stage2") or {}
        tr = (wc.get("settings") or {}).get("train") or {}
        if heal:
            rows.append(["LoRA healing steps x sequences x tokens",
                         f"{heal.get('steps')} x {tr.get('batch_size', 0) * tr.get('grad_accum', 1)} x {tr.get('seq_len')}"])
        lora = info.lora
        rows.append(["LoRA", f"merged (r={lora['rank']}, alpha={lora['alpha']})" if lora else "none"])
        return rows
    if info.routing_method != "dense":
        rows += [
            ["attention group size (query heads)", lay.get("attn_group_size", r.get("attn_group_size"))],
            ["FFN group size (channels)", lay.get("ffn_group_size", r.get("ffn_group_size"))],
            ["groups per layer (attention / FFN)", f"{lay.get('attn_groups', '-')} / {lay.get('ffn_groups', '-')}"],
            ["routed modules", ", ".join(info.routed_modules)],
        ]
        if info.routing_method != "static-width":
            rows.append(["router rank", r.get("router_rank")])
        if r.get("sparsity_attention") is not None:
            rows.append(["sparsity target (attention / FFN)", f"{r['sparsity_attention']} / {r['sparsity_ffn']}"])
        else:
            rows.append(["sparsity target", r.get("sparsity")])
        if info.routing_method in ("wide", "dynamic-depth"):
            rows += [["sparsity weight (lambda)", r.get("sparsity_weight")],
                     ["Gumbel temperature", f"{r.get('tau_start')} -> {r.get('tau_end')}"]]
    tr = (wc.get("settings") or {}).get("train") or {}
    if tr:
        rows += [["stage 1 steps x sequences x tokens",
                  f"{tr.get('steps')} x {tr.get('batch_size', 0) * tr.get('grad_accum', 1)} x {tr.get('seq_len')}"],
                 ["learning rate", tr.get("lr")], ["seed", tr.get("seed")], ["dtype", tr.get("dtype")]]
    data = (wc.get("settings") or {}).get("data") or {}
    if data.get("train"):
        rows.append(["training data", data["train"]])
    lora = info.lora
    rows.append(["LoRA", f"merged (r={lora['rank']}, alpha={lora['alpha']})" if lora else "none"])
    return rows


def render_model_card(wc: dict, *, export_format: str, name: str, files: dict[str, int] | None = None) -> str:
    """The ``README.md`` text of an export.

    Args:
        wc: the export's ``wide_config.json`` content.
        export_format: ``wide`` or ``hf``.
        name: the export directory's name (used in the loading snippets).
        files: ``{relative path: bytes}`` of the export's other files (listed in the card).
    """
    src = wc.get("source_model") or {}
    spec = src.get("spec") or "unknown"
    info = ExportInfo(wc)
    method = info.method
    front = ["---", "library_name: transformers"]
    if _HUB_ID.match(str(spec)):
        front.append(f"base_model: {spec}")
    front += ["tags:", "- wide", *([f"- {method}"] if method != "wide" else []), "- pruning", "---", ""]
    lines = front + [f"# {name}: {method} export of `{spec}`", ""]
    lines += [
        (f"Made with wide {wc.get('wide_version', '?')} on {wc.get('created', '?')} "
         f"(export id `{wc.get('export_id', '?')}`, format `{export_format}`)."),
        "",
        (f"- Base model: `{spec}`" + (f" ({src['resolved']})" if src.get("resolved") else "")
         + (f", revision `{src['revision']}`" if src.get("revision") else "")),
        f"- Method: {_METHOD_TEXT.get(method, method)}.",
    ]
    if export_format == "hf" and info.static_width:
        st = info.static_width
        lines.append(
            "- Physically smaller: removed query heads and FFN channels are gone from the tensors "
            f"(kept query heads per layer: {[len(h) for h in st['kept_heads']]}; kept FFN channels per "
            f"layer: {st['intermediate_sizes']}); K/V projections are whole."
        )
    lines += ["", "## Settings", ""] + _table(["setting", "value"], _settings_rows(wc))

    ms = wc.get("measured_sparsity") or {}
    lines += ["", "## Measured sparsity", ""]
    if method == "static-depth":
        lines.append("None: the kept layers run for every token; the removed ones are gone from the checkpoint.")
    elif method == "dense" or not ms:
        lines.append("None: every group runs for every token." if method == "dense" else "Not measured.")
    else:
        lines.append(
            f"Fraction of (token, group) decisions that skip, measured on {ms.get('data', 'held-out data')}"
            + (f" ({ms['tokens']} tokens)" if ms.get("tokens") else "")
            + "; the mean over layers per module, and their mean as the total."
        )
        lines += [""] + _table(["attention", "FFN", "total"], [[_pct(ms.get("attention")), _pct(ms.get("ffn")),
                                                              _pct(ms.get("total"))]])
        pl = ms.get("per_layer") or {}
        att, ffn = pl.get("attention") or [], pl.get("ffn") or []
        if att or ffn:
            n = max(len(att), len(ffn))
            lines += ["", "Per layer:", ""] + _table(
                ["layer", "attention", "FFN"],
                [[i, _pct(att[i] if i < len(att) else None), _pct(ffn[i] if i < len(ffn) else None)] for i in range(n)],
            )

    mt = metrics_table(wc.get("metrics") or {})
    if mt:
        lines += ["", "## Evaluation", ""] + mt

    lines += ["", "## How to load", "", "With wide installed:", "", "```python"]
    if export_format == "hf":
        lines += [
            "from wide_cli.export.hf_format import load_hf_export",
            "",
            f'pm = load_hf_export("{name}")  # checks manifest.json, then loads as below',
            "model, tokenizer = pm.model, pm.tokenizer",
            "```",
            "",
            "With plain transformers (no wide needed; the routing code ships in `modeling_wide.py`):",
            "",
            "```python",
            "from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline",
            "",
            f'model = AutoModelForCausalLM.from_pretrained("{name}", trust_remote_code=True)',
            f'tokenizer = AutoTokenizer.from_pretrained("{name}", trust_remote_code=True)',
            f'generate = pipeline("text-generation", model="{name}", trust_remote_code=True)',
            "```",
            "",
            f"lm-evaluation-harness: `lm_eval --model hf --model_args pretrained={name},trust_remote_code=True ...`.",
            ("Routing is deterministic at inference (a group runs iff its execute logit >= its skip logit). "
             "`model.wide_routing.trace = []` before a forward records which groups each token used."),
        ]
    else:
        lines += [
            "from wide_cli import load_pruned",
            "",
            f'pm = load_pruned("{name}")  # verifies manifest.json; routed model + tokenizer',
            "model, tokenizer = pm.model, pm.tokenizer",
            "```",
            "",
            f"Inspect it with `wide inspect {name}`.",
            "",
            ("With plain transformers: `config.json` and the weights are the base model's, so "
             f'`AutoModelForCausalLM.from_pretrained("{name}")` loads the **dense backbone only** '
             "(the routers in `routers.safetensors` are ignored: no token skips anything). "
             "To run the routed model without wide, export with `wide export --format hf`.")
            if method != "static-depth" else
            ("With plain transformers: this is a normal checkpoint with fewer layers (no routers): "
             f'`AutoModelForCausalLM.from_pretrained("{name}")` loads exactly the pruned model.'),
        ]
    if files:
        lines += ["", "## Files", ""] + _table(
            ["file", "bytes"], [[k, v] for k, v in sorted(files.items())]
        ) + ["", "`manifest.json` holds the sha256 and size of every file; loaders verify it."]
    return "\n".join(lines) + "\n"


def write_model_card(root: Path, wide_config: dict, *, export_format: str, name: str) -> Path:
    """Write ``root/README.md`` for the export being built in ``root`` (before its manifest, so
    the manifest covers it). Returns the path."""
    root = Path(root)
    files = {
        str(p.relative_to(root)): p.stat().st_size
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.name.startswith(".") and p.name not in (MODEL_CARD, MANIFEST)
    }
    path = root / MODEL_CARD
    atomic_write_bytes(path, render_model_card(wide_config, export_format=export_format, name=name, files=files).encode())
    return path
