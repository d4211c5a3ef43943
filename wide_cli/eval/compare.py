"""``wide compare``: quality and measured speed of a dense model and its pruned exports, in one
process, as a table, a JSON report and a Pareto plot.

Quality is ``wide_cli.eval.run.evaluate_targets`` (WikiText-2 token-level perplexity, the zero-shot
tasks, ``--limit``, the ``--cache-dir`` row cache). Speed is the runtime on one backend (the CPU
path by default) with the ``wide bench`` protocol: real English prompts, decode at batch 1
(``new_tokens`` greedy steps after a ``decode_prompt_len`` prompt) and prefill of one
``prefill_len`` prompt, every system measured round-robin (warm-up rounds first), the median of
``repeats`` rounds reported. Speedups are against the dense model on the same backend in the
same rounds. The dense target runs the runtime with routing off; exports run routed when they
have routers (a static-depth export has none: it is a smaller plain model).

report.json (``schema`` ``wide.compare.report``, version 1)::

    {"schema", "schema_version", "created", "wide_version",
     "settings": {quality: {...evaluate_targets settings...}, speed: SpeedConfig dict},
     "environment": {torch, threads, dtype, backend, machine, cpu_count},
     "rows": [{"name", "label", "method" (``wide+depth`` for a hybrid export: ``drop_layers`` layers
               removed, width routed in the rest), "cost_target", "cost_metric", "sparsity_target",
               "drop_layers", "lora",
               "wikitext_ppl", "task_avg" (fraction, null without every zero-shot task),
               "tasks": {task: fraction}, "flops" (fraction of dense per-token FLOPs),
               "sparsity" (measured total, null for unrouted models),
               "decode_speedup", "prefill_speedup", "decode_speedup_bound",
               "decode_tokens_per_s", "prefill_tokens_per_s",
               "decode_seconds": [s per round], "prefill_seconds": [s per round]}],
     "eval": the full ``wide eval`` report the quality columns come from}
"""

from __future__ import annotations

import datetime as _dt
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from wide_cli.errors import ConfigError


@dataclass(frozen=True)
class SpeedConfig:
    """The speed protocol (see the module docstring). ``threads``: torch intra-op threads (1 by
    default: reproducible on a shared CPU, as ``wide bench``); ``dtype``: runtime dtype (None =
    fp32); ``backend``: runtime backend of every system."""

    new_tokens: int = 64
    decode_prompt_len: int = 64
    prefill_len: int = 1024
    repeats: int = 3
    warmup: int = 1
    threads: int = 1
    dtype: str | None = None
    backend: str = "cpu"
    seed: int = 0

    def __post_init__(self):
        for name in ("new_tokens", "decode_prompt_len", "prefill_len", "repeats"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name.replace('_', '-')} {getattr(self, name)} must be >= 1")
        if self.warmup < 0 or self.threads < 0:
            raise ConfigError("warmup and threads must be >= 0")


def speed_key(target: str, weight_format: str | None = None) -> str:
    """The key of one system in ``measure_speed``'s result: the target, and its weight format in
    parentheses when one is set (``"gemma3-270m (int8)"``), so one target runs in several formats."""
    return target if weight_format is None else f"{target} ({weight_format})"


def measure_speed(targets: list[str], cfg: SpeedConfig, *, weight_formats: list[str | None] | None = None,
                  log=None) -> dict[str, dict]:
    """Decode (batch 1) and prefill tokens/s of every target's runtime, round-robin, median of
    ``cfg.repeats`` rounds. ``weight_formats``: one runtime weight format per target (``fp32``,
    ``bf16``, ``int8``, ``int4``; None = ``cfg.dtype``; a model's int4 uses the plain scale rule).
    Returns ``{speed_key(target, format): {decode_tokens_per_s, prefill_tokens_per_s,
    decode_seconds, prefill_seconds, sparsity, weight_format}}`` (``sparsity``: measured in the
    decode rounds, None when the runtime routes nothing; ``weight_format``: the format the runtime
    ran).

    Raises:
        ConfigError: ``weight_formats`` not one per target, or the same system twice."""
    from wide_cli.bench.systems import RuntimeSystem
    from wide_cli.bench.workload import prompt_batch, text_token_stream
    from wide_cli.runtime.engine import Runtime

    log = log or (lambda msg: None)
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    formats = list(weight_formats) if weight_formats is not None else [None] * len(targets)
    if len(formats) != len(targets):
        raise ConfigError(f"{len(formats)} weight formats for {len(targets)} targets", "give one per target")
    keys = [speed_key(t, f) for t, f in zip(targets, formats)]
    if len(set(keys)) != len(keys):
        raise ConfigError(f"a system is listed twice: {keys}", "list each target and weight format once")
    systems = {}
    for t, f, key in zip(targets, formats, keys):
        log(f"speed: loading {key} on the {cfg.backend} backend")
        rt = Runtime.from_target(t, backend=cfg.backend, dtype=None if f else cfg.dtype, weight_format=f)
        routed = bool(rt.routing) and _has_routers(rt)
        systems[key] = RuntimeSystem(rt, routed, None, cfg.seed)
    tok = next(iter(systems.values())).rt.tokenizer
    stream = text_token_stream(tok, max(cfg.prefill_len, cfg.decode_prompt_len) * 4)
    out = {k: {"decode_seconds": [], "prefill_seconds": [], "sparsity": None,
               "weight_format": systems[k].rt.weight_format} for k in keys}
    shapes = (("decode", prompt_batch(stream, 1, cfg.decode_prompt_len, cfg.seed + 1)),
              ("prefill", prompt_batch(stream, 1, cfg.prefill_len, cfg.seed + 2)))
    for phase, ids in shapes:
        for r in range(cfg.warmup + cfg.repeats):
            for t, s in systems.items():
                if r == cfg.warmup:
                    s.rt.stats.reset()
                sec = s.decode(ids, cfg.new_tokens) if phase == "decode" else s.prefill(ids)
                if r >= cfg.warmup:
                    out[t][f"{phase}_seconds"].append(sec)
                if phase == "decode" and s.routed and r == cfg.warmup + cfg.repeats - 1:
                    sp = s.rt.stats.summary()
                    out[t]["sparsity"] = {k: sp.get(k) for k in ("attention", "ffn", "total")}
            log(f"speed: {phase} round {r + 1}/{cfg.warmup + cfg.repeats}"
                + (" (warm-up)" if r < cfg.warmup else ""))
    for o in out.values():
        o["decode_tokens_per_s"] = cfg.new_tokens / statistics.median(o["decode_seconds"])
        o["prefill_tokens_per_s"] = cfg.prefill_len / statistics.median(o["prefill_seconds"])
    return out


def _has_routers(rt) -> bool:
    """True when some layer of the runtime has a router or a static keep mask."""
    return any(v is not None for m in rt.meta for v in (*m.routers.values(), *m.keeps.values()))


def _label(row: dict) -> str:
    m = row["method"]
    if m == "dense":
        return "dense"
    parts = [m]
    if row.get("cost_target") is not None:
        parts.append(f"cost {row['cost_target']:.2f}")
    elif row.get("sparsity_target") is not None:
        parts.append(f"s {row['sparsity_target']:.2f}")
    if row.get("lora"):
        parts.append("+LoRA")
    return " ".join(parts)


def compare_rows(eval_report: dict, speed: dict[str, dict]) -> list[dict]:
    """One row per target (see the module docstring) from the eval report and the speed runs;
    speedups are relative to the first dense row (None without one)."""
    from wide_cli.eval.tasks import TASKS

    dense_name = next((r["name"] for r in eval_report["rows"] if r["kind"] == "dense"), None)
    ref = speed.get(dense_name) if dense_name else None
    rows = []
    for r in eval_report["rows"]:
        wcfg_routing = r.get("routing") or {}
        method = r.get("method") or "dense"
        if wcfg_routing.get("drop_layers"):  # hybrid: layers removed, width routed in the rest
            method = f"{method}+depth"
        s = speed.get(r["name"], {})
        cost_target = cost_metric = None
        if method == "static-depth":
            sd = r.get("static_depth") or {}
            cost_target, cost_metric = sd.get("cost_target"), sd.get("cost_metric")
        elif method != "static-width" and wcfg_routing.get("cost_target") is not None:
            # static width keeps a fixed group fraction and ignores a recipe's cost_target
            cost_target, cost_metric = wcfg_routing.get("cost_target"), wcfg_routing.get("cost_metric")
        row = {
            "name": r["name"],
            "method": method,
            "cost_target": 1.0 if r["kind"] == "dense" and method == "dense" else cost_target,
            "cost_metric": cost_metric,
            "sparsity_target": None if method in ("dense", "static-depth") else wcfg_routing.get("sparsity"),
            "drop_layers": int(wcfg_routing.get("drop_layers") or 0),
            "lora": bool(r.get("lora")),
            "wikitext_ppl": (r.get("summary") or {}).get("wikitext_ppl"),
            "task_avg": r.get("average"),
            "tasks": {t: v for t, v in (r.get("summary") or {}).items() if t in TASKS},
            "flops": (r.get("flops") or {}).get("relative"),
            "sparsity": (r.get("sparsity") or {}).get("total"),
            "decode_speedup_bound": r.get("decode_speedup_bound"),
            "decode_tokens_per_s": s.get("decode_tokens_per_s"),
            "prefill_tokens_per_s": s.get("prefill_tokens_per_s"),
            "decode_speedup": (s["decode_tokens_per_s"] / ref["decode_tokens_per_s"]) if ref and s else None,
            "prefill_speedup": (s["prefill_tokens_per_s"] / ref["prefill_tokens_per_s"]) if ref and s else None,
            "decode_seconds": s.get("decode_seconds"),
            "prefill_seconds": s.get("prefill_seconds"),
            "runtime_sparsity": s.get("sparsity"),
        }
        row["label"] = _label(row)
        rows.append(row)
    return rows


def _f(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def table_lines(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Header and cells of the comparison table (accuracies in %)."""
    head = ["model", "method / cost point", "wikitext ppl", "task avg %", "FLOPs vs dense", "decode x",
            "prefill x", "decode bound", "decode tok/s", "prefill tok/s"]
    cells = [[r["name"], r["label"], _f(r["wikitext_ppl"], ".2f"),
              _f(None if r["task_avg"] is None else 100 * r["task_avg"], ".2f"), _f(r["flops"], ".3f"),
              _f(r["decode_speedup"], ".2f"), _f(r["prefill_speedup"], ".2f"), _f(r["decode_speedup_bound"], ".2f"),
              _f(r["decode_tokens_per_s"], ".1f"), _f(r["prefill_tokens_per_s"], ".1f")] for r in rows]
    return head, cells


def render_markdown(doc: dict) -> str:
    head, cells = table_lines(doc["rows"])
    sp = doc["settings"]["speed"]
    q = doc["settings"]["quality"]
    env = doc["environment"]
    lines = ["# wide compare", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(c) + " |" for c in cells]
    quality = (f"Quality: tasks {', '.join(q['tasks'])}; limit {q['limit']}; perplexity window {q['seq_len']}; "
               f"dtype {q['dtype']}. Task average = mean of the zero-shot tasks' summary metric.")
    speed = (f"Speed: runtime backend {sp['backend']}, {env['dtype']}, {env['threads']} thread(s); decode batch 1, "
             f"{sp['new_tokens']} new tokens after a {sp['decode_prompt_len']}-token prompt; prefill of "
             f"{sp['prefill_len']} tokens; systems round-robin, {sp['warmup']} warm-up + {sp['repeats']} timed "
             "rounds, median; speedups vs the dense model in the same rounds.")
    lines += ["", quality, speed, ""]
    return "\n".join(lines)


def pareto_plot(rows: list[dict], path: Path, *, title: str = "") -> Path:
    """Perplexity and task average against measured decode speedup, one marker per (method, cost
    point); written atomically as PNG."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    from wide_cli.eval.plots import save_figure

    pts = [r for r in rows if r["decode_speedup"] is not None]
    have_tasks = any(r["task_avg"] is not None for r in pts)
    methods = sorted({(r["method"], r["lora"]) for r in pts}, key=lambda m: (m[0] != "dense", m))
    markers = "o^sDvP*Xh<>"
    style = {m: (f"C{i % 10}", markers[i % len(markers)]) for i, m in enumerate(methods)}
    ncols = 2 if have_tasks else 1
    fig, axes = plt.subplots(1, ncols, figsize=(6.2 * ncols, 4.6), dpi=120, squeeze=False)
    try:
        panels = [("wikitext_ppl", "WikiText-2 perplexity (token-level, log scale)", True)]
        if have_tasks:
            panels.append(("task_avg", "zero-shot task average (%)", False))
        for ax, (key, ylabel, logy) in zip(axes[0], panels):
            for m in methods:
                color, marker = style[m]
                sel = sorted((r for r in pts if (r["method"], r["lora"]) == m and r[key] is not None),
                             key=lambda r: r["decode_speedup"])
                if not sel:
                    continue
                xs = [r["decode_speedup"] for r in sel]
                ys = [r[key] * (100.0 if key == "task_avg" else 1.0) for r in sel]
                name = m[0] + (" + LoRA" if m[1] else "")
                ax.plot(xs, ys, linestyle="-" if len(sel) > 1 else "none", marker=marker, color=color,
                        markersize=8, label=name, alpha=0.9)
                for r, x, y in zip(sel, xs, ys):
                    point = r.get("cost_target") if r.get("cost_target") is not None else r.get("sparsity_target")
                    if r["method"] != "dense" and point is not None:
                        tag = f"{point:.2f}" if r.get("cost_target") is not None else f"s={point:.2f}"
                        ax.annotate(tag, (x, y), textcoords="offset points", xytext=(6, 4), fontsize=8, color=color)
            if logy:
                ax.set_yscale("log")
                ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
                ax.yaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
                ax.tick_params(axis="y", which="minor", labelsize=7)
            ax.set_title("lower is better" if logy else "higher is better", fontsize=9)
            ax.set_xlabel("measured decode speedup vs dense (batch 1, runtime)")
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
            ax.axvline(1.0, color="grey", linewidth=0.8, linestyle=":")
            ax.margins(x=0.08, y=0.08)  # room for the point labels
        axes[0][0].legend(fontsize=8, loc="best")
        if title:
            fig.suptitle(title, fontsize=10)
        fig.text(0.01, 0.01, "labels: cost target (fraction of dense per-token cost) or s= sparsity target",
                 fontsize=7, color="grey")
        fig.tight_layout(rect=(0, 0.03, 1, 1))
    except BaseException:
        plt.close(fig)
        raise
    return save_figure(fig, path)


def compare(targets: list[str], *, tasks: list[str], data_dir: Path | None, limit: int | None, seq_len: int | None,
            batch_size: int, dtype: str, cache_dir: Path | None, speed: SpeedConfig, out_dir: Path | None,
            word_perplexity: bool = False, log=None) -> dict:
    """Evaluate and time ``targets`` (the first is normally the dense model); returns the report
    (module docstring) and writes ``report.json``, ``report.md`` and ``pareto.png`` to ``out_dir``.
    WikiText-2 is scored token-level only unless ``word_perplexity`` (lm-eval's rolling protocol too,
    twice the time).

    Raises:
        ConfigError / DataError: bad settings or data, before any model is loaded (speed
            settings are checked first too).
    """
    import platform

    from wide_cli.atomic import atomic_write_bytes, atomic_write_json
    from wide_cli.eval.run import evaluate_targets
    from wide_cli.version import __version__

    log = log or (lambda msg: None)
    dup = sorted({t for t in targets if targets.count(t) > 1})
    if dup:
        raise ConfigError(f"target {dup[0]} is given twice", "name each model once")
    if len(targets) < 2:
        raise ConfigError(f"wide compare needs the dense model and at least one export (got {len(targets)})",
                          "e.g. wide compare smollm2-135m runs/a/export runs/b/export")
    report = evaluate_targets(targets, tasks=tasks, data_dir=data_dir, limit=limit, seq_len=seq_len,
                              batch_size=batch_size, dtype=dtype, device="cpu", cache_dir=cache_dir,
                              wikitext_protocols=("token", "harness") if word_perplexity else ("token",))
    _attach_export_facts(report)
    spd = measure_speed(targets, speed, log=log)
    rows = compare_rows(report, spd)
    from wide_cli.models.loader import resolve_dtype

    doc = {
        "schema": "wide.compare.report",
        "schema_version": 1,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "wide_version": __version__,
        "settings": {"quality": report["settings"], "speed": asdict(speed)},
        "environment": {"torch": torch.__version__, "threads": torch.get_num_threads(),
                        "dtype": str(resolve_dtype(speed.dtype)).removeprefix("torch."), "backend": speed.backend,
                        "machine": platform.machine(), "cpu_count": __import__("os").cpu_count()},
        "rows": rows,
        "eval": report,
    }
    if out_dir is not None:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(out_dir / "report.json", doc)
        atomic_write_bytes(out_dir / "report.md", render_markdown(doc).encode())
        pareto_plot(rows, out_dir / "pareto.png", title="quality vs measured decode speedup")
    return doc


def _attach_export_facts(report: dict) -> None:
    """Copy what the rows need from each export's ``wide_config.json`` (static-depth selection,
    LoRA) into the eval report's rows."""
    from wide_cli.artifacts import ExportInfo, is_export

    for r in report["rows"]:
        if is_export(r["name"]):
            info = ExportInfo.read(r["name"])
            r["static_depth"] = info.static_depth
            r["lora"] = info.lora
