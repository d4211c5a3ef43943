"""Rich rendering of an ``InspectReport``: one place for every table and the token heat-map."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from wide_cli.inspection.report import InspectReport, PromptTrace

SHADES = "·░▒▓█"  # none, 1/4, 1/2, 3/4, all of the layers ran the group
STYLE = {"attention": "dark_orange", "ffn": "green3"}


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f} %"


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def sizes_table(r: InspectReport) -> Table:
    t = Table(title=f"wide inspect: {r.path}", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    p = r.parameters
    t.add_row("format / method", f"{r.format} / {r.method}")
    t.add_row("files", f"{len(r.files)} files, {_size(r.bytes)} ({r.bytes} bytes)")
    big = sorted(r.files.items(), key=lambda kv: -kv[1])[:4]
    t.add_row("largest", ", ".join(f"{k} {_size(v)}" for k, v in big))
    t.add_row("parameters", f"{p['total']:,} = backbone {p['backbone']:,} + routers {p['routers']:,}")
    t.add_row("dtypes", ", ".join(f"{k}: {v:,}" for k, v in p["dtypes"].items()))
    for k, v in r.settings.items():
        t.add_row(k, ", ".join(map(str, v)) if isinstance(v, list) else str(v))
    return t


def sparsity_table(r: InspectReport) -> Group | Text:
    sp = r.sparsity
    if not sp:
        return Text(f"sparsity: {r.sparsity_source} (pass --text FILE to measure it)", style="dim")
    t = Table(title="sparsity per layer", title_justify="left")
    t.add_column("layer", justify="right")
    t.add_column("attention", justify="right", style=STYLE["attention"])
    t.add_column("ffn", justify="right", style=STYLE["ffn"])
    dm = sp.get("distinct_masks")
    if dm:  # measured on a text: how many distinct masks each router gave its tokens
        t.add_column("attention masks", justify="right", style=STYLE["attention"])
        t.add_column("ffn masks", justify="right", style=STYLE["ffn"])
    pl = sp.get("per_layer") or {}
    att, ffn = pl.get("attention") or [], pl.get("ffn") or []

    def at(v, i):
        return v[i] if i < len(v) else None

    for i in range(max(len(att), len(ffn))):
        row = [str(i), _pct(at(att, i)), _pct(at(ffn, i))]
        if dm:
            row += ["-" if at(dm.get(m) or [], i) is None else str(at(dm[m], i)) for m in ("attention", "ffn")]
        t.add_row(*row)
    t.add_row("mean", _pct(sp.get("attention")), _pct(sp.get("ffn")), *(["", ""] if dm else []), end_section=True)
    t.add_row("total", _pct(sp.get("total")), "", *(["", ""] if dm else []))
    return Group(t, Text(f"sparsity: {r.sparsity_source}", style="dim"))


def _shade(v: float) -> int:
    """Index into SHADES: the ends only for exactly none / all layers."""
    if v <= 0.0:
        return 0
    if v >= 1.0:
        return len(SHADES) - 1
    return min(len(SHADES) - 2, max(1, round(v * (len(SHADES) - 1))))


def _cells(values, module: str, exact: bool) -> Text:
    """One character per group: exact decisions (█ ran, · skipped) or a layer-fraction shade."""
    out = Text()
    for v in values:
        if exact:
            out.append("█" if v else "·", style=STYLE[module] if v else "grey50")
        else:
            out.append(SHADES[_shade(float(v))], style=STYLE[module])
    return out


def _token_label(tok: str) -> str:
    s = repr(tok)[1:-1].replace(" ", "␣")
    return s if len(s) <= 14 else s[:13] + "…"


def heatmap(trace: PromptTrace, layer: int | None) -> Group | Text:
    """Rows = tokens; per module one cell per group (``layer`` given) or, for all layers, the
    fraction of layers in which the group ran."""
    mods = [m for m in ("attention", "ffn") if m in trace.execute]
    if not mods:
        return Text("prompt: this export is dense: every group runs for every token", style="dim")
    where = f"layer {layer}" if layer is not None else f"all {trace.layer_count()} layers"
    head = Text(f"groups each token used, {where}" + (" (static: the same for every token)" if trace.static else ""),
                style="bold")
    legend = Text("█ ran  · skipped" if layer is not None
                  else "share of layers in which the group ran: · none  ░ 1/4  ▒ 1/2  ▓ 3/4  █ all", style="dim")
    t = Table()
    t.add_column("#", justify="right", style="dim")
    t.add_column("token")
    for m in mods:
        t.add_column(m, style=STYLE[m], no_wrap=True)
    t.add_column("ran", justify="right")
    for i, tok in enumerate(trace.tokens):
        row, ran = [str(i), _token_label(tok)], []
        for m in mods:
            if layer is not None:
                vals = trace.execute[m][layer]
                if vals is None:
                    row.append(Text("(not routed)", style="dim"))
                    continue
                vals = vals[i]
                row.append(_cells(vals, m, exact=True))
            else:
                vals = trace.summary(m)[i]
                row.append(_cells(vals, m, exact=False))
            ran.append(sum(vals) / len(vals))
        row.append(_pct(sum(ran) / len(ran)) if ran else "-")
        t.add_row(*row)
    return Group(head, t, legend)


def render(r: InspectReport) -> Group:
    parts = [sizes_table(r), sparsity_table(r)]
    if r.plot:
        parts.append(Text(f"plot: {r.plot}"))
    if r.prompt is not None:
        parts.append(heatmap(r.prompt, r.layer))
    for w in r.warnings:
        parts.append(Text(f"warning: {w}", style="yellow"))
    return Group(*parts)
