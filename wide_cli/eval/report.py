"""The evaluation report: one row per model, written as report.json, report.md and PNG plots.

report.json schema (``schema_version`` 1)::

    {
      "schema": "wide.eval.report", "schema_version": 1,
      "created": ISO-8601 UTC time, "wide_version": str,
      "settings": {tasks: [str], data_dir, limit, seq_len (null = per model, min(2048, context)),
                   stride, batch_size, dtype, device, eval_data},
      "summary_metrics": {task: "acc" | "acc_norm"},   # which metric enters "average" (fixed table)
      "reference": name of the dense row "% of dense" is relative to, or null,
      "warnings": [str],                                 # e.g. export source != dense reference
      "rows": [{
        "name": the target as given, "kind": "dense" | "pruned", "method": wide | dynamic-depth | ...,
        "source": {spec, resolved, revision},            # an export's recorded source_model
        "routing": RoutingConfig dict or null, "export_measured_sparsity": as recorded at export,
        "seq_len": perplexity window used for this model,
        "results": {
          "wikitext": {dataset: {name: "wikitext-2-raw-v1", requested, split, file, n_documents,
                                 n_documents_total, limit},
                       token_level: {unit: "token-level perplexity", perplexity, nll_sum, nll_mean,
                                     seq_len, stride, n_tokens, n_tokens_scored, n_windows,
                                     protocol, bos_policy, text, sparsity},
                       harness: {unit: "word-level perplexity (lm-eval wikitext)", word_perplexity,
                                 byte_perplexity, bits_per_byte, token_perplexity, loglikelihood,
                                 n_documents, n_words, n_bytes, n_tokens_scored, n_windows,
                                 max_length, prefix_token_id, protocol, dataset_view, sparsity},
                       summary_metric: "token_level.perplexity", summary_value, sparsity},
          "<task>": {task, harness_task, dataset: {file, split, n_items, n_total, limit},
                     metrics: {acc, acc_stderr[, acc_norm, acc_norm_stderr]},   # fractions in [0, 1]
                     summary_metric, summary_value, n_requests, max_length, protocol, sparsity},
          "eval_data": {...token_perplexity..., dataset: {file, n_chars}, bos_policy}   # --eval-data
        },
        "summary": {"wikitext_ppl": token-level ppl, "wikitext_word_ppl": lm-eval word ppl,
                    "<task>": value of its summary metric, "eval_data_ppl": ...},
        "average": mean over the zero-shot tasks of their summary metric (fraction) or null,
        "average_tasks": [task],
        "percent_of_dense": 100 * average / reference average, or null,
        "sparsity": measured over every evaluated token {attention, ffn, total,
                    per_layer: {attention: [..], ffn: [..]}, tokens_measured} or null (dense),
        "flops": {relative, dense_flops_per_token, routed_flops_per_token, router_flops_per_token,
                  context_len},                         # see wide_cli.cost
        "decode_speedup_bound": ideal decode speed-up at the measured sparsity,
        "plot": PNG file name (pruned rows, when written) or null,
        "warnings": [str]
      }]
    }

Accuracies are fractions in the JSON and percentages in the tables.
"""

from __future__ import annotations

import datetime as _dt
import re
from pathlib import Path

from wide_cli.eval.tasks import SUMMARY_METRIC, TASKS

SCHEMA = "wide.eval.report"
SCHEMA_VERSION = 1


def _summary(row: dict) -> dict:
    out = {}
    res = row["results"]
    if "wikitext" in res:
        w = res["wikitext"]
        out["wikitext_ppl"] = (w.get("token_level") or {}).get("perplexity")
        out["wikitext_word_ppl"] = (w.get("harness") or {}).get("word_perplexity")
    for t, r in res.items():
        if t in TASKS:
            out[t] = r["summary_value"]
    if "eval_data" in res:
        out["eval_data_ppl"] = res["eval_data"]["perplexity"]
    return out


def build_report(rows: list[dict], *, settings: dict, warnings: list[str] | None = None) -> dict:
    """Assemble the report dict (schema above) from ``run.evaluate_model`` rows."""
    zs = [t for t in settings.get("tasks", []) if t in TASKS]
    ref = next((r for r in rows if r["kind"] == "dense"), None)
    for r in rows:
        r["summary"] = _summary(r)
        vals = [r["results"][t]["summary_value"] for t in zs if t in r["results"]]
        r["average"] = sum(vals) / len(vals) if vals and len(vals) == len(zs) else None
        r["average_tasks"] = zs
        r.setdefault("plot", None)
    ref_avg = ref["average"] if ref is not None else None
    for r in rows:
        r["percent_of_dense"] = (100.0 * r["average"] / ref_avg
                                 if ref_avg and r["average"] is not None else None)
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "wide_version": _wide_version(),
        "settings": settings,
        "summary_metrics": {t: SUMMARY_METRIC[t] for t in zs},
        "reference": ref["name"] if ref is not None else None,
        "warnings": list(warnings or []),
        "rows": rows,
    }


def _wide_version() -> str:
    from wide_cli.version import __version__

    return str(__version__)


# ----------------------------------------------------------------------------------------------
# the table (shared by Rich and Markdown)


def _f(v, digits=2, scale=1.0) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


def table(report: dict) -> tuple[list[str], list[list[str]]]:
    """Header and formatted rows of the comparison table (accuracies in %; ``*`` marks the metric
    that enters the average)."""
    tasks = report["settings"].get("tasks", [])
    rows = report["rows"]
    header = ["model", "method"]
    if "wikitext" in tasks:
        header += ["wikitext2 ppl (token)", "wikitext word ppl (lm-eval)"]
    zs = [t for t in tasks if t in TASKS]
    for t in zs:
        for m in TASKS[t].metrics:
            header.append(f"{t} {m}{'*' if SUMMARY_METRIC[t] == m else ''}")
    if zs:
        header += ["avg*", "% of dense"]
    if report["settings"].get("eval_data"):
        header.append("eval-data ppl (token)")
    header += ["sparsity attn/ffn/total", "FLOPs vs dense", "decode bound"]
    out = []
    for r in rows:
        res, s = r["results"], r["summary"]
        line = [r["name"], r["method"]]
        if "wikitext" in tasks:
            line += [_f(s.get("wikitext_ppl")), _f(s.get("wikitext_word_ppl"))]
        for t in zs:
            for m in TASKS[t].metrics:
                line.append(_f(res[t]["metrics"].get(m), 2, 100.0))
        if zs:
            line += [_f(r["average"], 2, 100.0), _f(r["percent_of_dense"], 1)]
        if report["settings"].get("eval_data"):
            line.append(_f(s.get("eval_data_ppl")))
        sp = r.get("sparsity")
        line.append("-" if not sp else "/".join(_f(sp.get(k), 3) for k in ("attention", "ffn", "total")))
        line += [_f(r["flops"]["relative"], 3), f"{r['decode_speedup_bound']:.2f}x"]
        out.append(line)
    return header, out


def notes(report: dict) -> list[str]:
    """Footnotes: units, protocols, the summary-metric table, warnings."""
    lines = []
    rows = report["rows"]
    if rows and "wikitext" in rows[0]["results"]:
        w = rows[0]["results"]["wikitext"]
        ds = w["dataset"]
        lines.append(f"WikiText: {ds['name']} {ds['split']} split, {ds['n_documents']}/{ds['n_documents_total']} "
                     "pages.")
        if "token_level" in w:
            tl = w["token_level"]
            lines.append(f"wikitext2 ppl (token): {tl['unit']}, {tl['protocol']}; {tl['bos_policy']} "
                         f"({tl['n_tokens_scored']} tokens scored, {tl['n_windows']} windows).")
        if "harness" in w:
            lines.append(f"wikitext word ppl (lm-eval): {w['harness']['unit']}; {w['harness']['protocol']}.")
    if report["summary_metrics"]:
        lines.append("avg*: mean of " + ", ".join(f"{t} {m}" for t, m in report["summary_metrics"].items())
                     + " (acc_norm where the harness task defines it, else acc).")
    if report.get("reference"):
        lines.append(f"% of dense: avg* relative to {report['reference']}.")
    lines.append("sparsity: measured skip fraction over every evaluated token (padding excluded); "
                 "FLOPs vs dense and the ideal decode bound follow wide_cli.cost.")
    for w in report.get("warnings", []):
        lines.append(f"WARNING: {w}")
    return lines


def render_table(report: dict):
    """The report as one Rich ``Table`` (the only Rich rendering of the eval report)."""
    from rich.table import Table

    header, rows = table(report)
    t = Table(title="wide eval", show_lines=False)
    for i, h in enumerate(header):
        t.add_column(h, justify="left" if i < 2 else "right", overflow="fold")
    for r in rows:
        t.add_row(*r)
    t.caption = "\n".join(notes(report))
    return t


def to_markdown(report: dict) -> str:
    """report.md: settings, the table, footnotes and per-task protocols."""
    header, rows = table(report)
    s = report["settings"]
    out = ["# wide eval report", "",
           (f"Created {report['created']} with wide {report['wide_version']}; tasks {', '.join(s['tasks'])}; "
           f"limit {s['limit']}; seq_len {s['seq_len'] or 'auto'}; batch size {s['batch_size']}; "
           f"dtype {s['dtype']}; device {s['device']}."), ""]
    esc = [h.replace("|", "\\|").replace("*", "\\*") for h in header]
    out.append("| " + " | ".join(esc) + " |")
    out.append("|" + "|".join(["---"] * len(header)) + "|")
    for r in rows:
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in r) + " |")
    out.append("")
    out += [f"- {n}" for n in notes(report)]
    plots = [r for r in report["rows"] if r.get("plot")]
    if plots:
        out += ["", "## Per-layer measured sparsity", ""]
        out += [f"![{r['name']}]({r['plot']})" for r in plots]
    out.append("")
    return "\n".join(out)


def slug(name: str) -> str:
    """A file-name-safe version of a target name."""
    s = re.sub(r"[^A-Za-z0-9._-]+", "_", str(name)).strip("._")
    return s[-80:] or "model"


def write_report(report: dict, out_dir: Path) -> list[Path]:
    """Write the per-layer sparsity PNGs of pruned rows, then report.json and report.md, atomically.

    Sets each pruned row's ``plot`` to its PNG file name (relative to ``out_dir``). Returns the
    written paths.
    """
    from wide_cli.atomic import atomic_write_bytes, atomic_write_json
    from wide_cli.eval.plots import plot_layer_sparsity

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written, used = [], set()
    for r in report["rows"]:
        if r["kind"] != "pruned" or not r.get("sparsity"):
            continue
        base = f"sparsity_{slug(r['name'])}"
        name, k = f"{base}.png", 1
        while name in used:
            k += 1
            name = f"{base}_{k}.png"
        used.add(name)
        plot_layer_sparsity(r["sparsity"], out_dir / name, title=f"{r['name']} ({r['method']})")
        r["plot"] = name
        written.append(out_dir / name)
    atomic_write_json(out_dir / "report.json", report)
    atomic_write_bytes(out_dir / "report.md", to_markdown(report).encode("utf-8"))
    return written + [out_dir / "report.json", out_dir / "report.md"]
