"""The table of docs/results/quality-at-equal-speed.md: every pruning method of SmolLM2-135M at two
cost points (~1.2x and ~1.35x measured decode), one row per (method, cost point), from the rows
files `benchmarks/quality_at_equal_speed.sh rows-*` wrote (quality from the evaluation cache, the
`wide prune` report, speed from one round-robin run against dense).

Writes docs/results/quality-at-equal-speed/report.json (per row: method, cost_target, wikitext_ppl,
task_avg, flops, decode_speedup, prefill_speedup; plus label, cost_point, the script step that
trains it, LoRA, dropped layers, training budget, held-out perplexity, measured sparsity and the
speed run its speedups come from), report.md and pareto.png (`wide compare`'s plot). A row's
speedups are against dense measured in the same run.

Usage (from the repository root): python benchmarks/quality_at_equal_speed.py
"""

import json
import math
from pathlib import Path

from wide_cli.eval.compare import pareto_plot

OUT = Path("docs/results/quality-at-equal-speed")

# run name -> (cost point, label, LoRA, the step of quality_at_equal_speed.sh that trains it); the
# cost point groups rows of about the same measured decode speed
ROWS = {
    "smollm2-135m": ("dense", "dense", False, None),
    "sd87": ("~1.2x", "static depth, 5 layers removed, no healing", False, "static-depth-1.2x"),
    "sd87s400": ("~1.2x", "static depth, 5 layers removed + LoRA healing", True, "static-depth-lora-1.2x"),
    "sw18": ("~1.2x", "static width s 0.18, no training", False, "static-width-1.2x"),
    "h3c87s400": ("~1.2x", "wide: 3 layers removed + width routed to 0.87", True, "hybrid-1.2x"),
    "dd87s400": ("~1.2x", "dynamic depth: whole attention / FFN modules skipped per token, routed to 0.87", True,
                 "dynamic-depth-1.2x"),
    "sd79": ("~1.35x", "static depth, 8 layers removed, no healing", False, "static-depth-1.35x"),
    "sd79s400": ("~1.35x", "static depth, 8 layers removed + LoRA healing", True, "static-depth-lora-1.35x"),
    "sw29": ("~1.35x", "static width s 0.29, no training", False, "static-width-1.35x"),
    "h4c83s400": ("~1.35x", "wide: 4 layers removed + width routed to 0.83", True, "hybrid-1.35x"),
    "dd79s400": ("~1.35x", "dynamic depth: whole attention / FFN modules skipped per token, routed to 0.79", True,
                 "dynamic-depth-1.35x"),
    "dd72s400": ("~1.35x", "dynamic depth: whole attention / FFN modules skipped per token, routed to 0.72", True,
                 "dynamic-depth-1.35x-cost0.72"),
    "h4c83s400lr8": ("~1.35x", "wide: 4 layers removed + width routed to 0.83, rank-8 low-rank stand-ins", True,
                     "hybrid-1.35x-lowrank8"),
}
#: rows plotted as their own series (not joined to their method's line: another stand-in kind,
#: timed in another speed run)
PLOT_SERIES = {"h4c83s400lr8": "wide, low-rank stand-ins"}
SPARSITY_TARGETS = {"sw18": 0.18, "sw29": 0.29}  # static width is asked for a sparsity, not a cost
# rows files, each with its own speed run; a run named in two files takes the first
SOURCES = ("pair-1.35x.json", "other-methods.json", "lowrank.json")


def load() -> list[dict]:
    """One dict per row of ROWS found in SOURCES, sorted by cost point, then fastest first."""
    rows = []
    for src in SOURCES:
        if not (OUT / src).is_file():
            continue
        for r in json.loads((OUT / src).read_text())["rows"]:
            if r["name"] not in ROWS or any(x["name"] == r["name"] for x in rows):
                continue
            point, label, lora, step = ROWS[r["name"]]
            sparsity = r.get("sparsity") or {}
            rows.append({
                "name": r["name"], "label": label, "cost_point": point, "step": step, "method": r["method"],
                "cost_target": r.get("cost_target"), "sparsity_target": SPARSITY_TARGETS.get(r["name"]), "lora": lora,
                "drop_layers": r.get("drop_layers", 0),
                "wikitext_ppl": r["wikitext_ppl"], "task_avg": r["task_avg"], "tasks": r["tasks"],
                "flops": r["flops"], "measured_sparsity": sparsity.get("total"),
                "decode_speedup": r.get("decode_speedup"), "prefill_speedup": r.get("prefill_speedup"),
                "decode_tokens_per_s": r.get("decode_tokens_per_s"),
                "prefill_tokens_per_s": r.get("prefill_tokens_per_s"),
                "heldout_ppl": r.get("heldout_ppl"), "heldout_dense_ppl": r.get("heldout_dense_ppl"),
                "train_steps": r.get("train_steps", 0),
                "train_tokens": r.get("train_tokens", 0), "train_seconds": r.get("train_seconds"),
                "wikitext_pages": r["wikitext_pages"], "task_limit": r["task_limit"],
                "speed_run": src.replace(".json", "-speed.json"),
            })
    order = {"dense": 0, "~1.2x": 1, "~1.35x": 2}
    return sorted(rows, key=lambda r: (order[r["cost_point"]], -(r["decode_speedup"] or 0)))


def fmt(v, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def markdown(rows: list[dict]) -> str:
    dense = next(r for r in rows if r["method"] == "dense")
    lines = [("| cost point | model | WikiText-2 ppl | vs dense | 7-task avg % | FLOPs | measured sparsity | "
             "held-out corpus ppl (its dense) | decode x | prefill x | trained (wall time) | speed run |"), "|---" * 12 + "|"]
    for r in rows:
        trained = "no"
        if r["train_steps"]:
            hours = f", {r['train_seconds'] / 3600:.1f} h" if r.get("train_seconds") else ""
            trained = f"{r['train_steps']} steps{hours}"
        ratio = None if r["wikitext_ppl"] is None else r["wikitext_ppl"] / dense["wikitext_ppl"]
        task = None if r["task_avg"] is None else 100 * r["task_avg"]
        step = f"`{r['step']}`" if r["step"] else "`smollm2-135m`"
        lines.append(
            f"| {r['cost_point']} | {r['label']} ({step}) | {fmt(r['wikitext_ppl'], '.2f')} | "
            f"{fmt(ratio, '.2f')}{'x' if ratio else ''} | {fmt(task, '.2f')} | {r['flops']:.3f} | "
            f"{fmt(r['measured_sparsity'], '.3f')} | {fmt(r['heldout_ppl'], '.2f')} ({fmt(r['heldout_dense_ppl'], '.2f')}) | "
            f"{fmt(r['decode_speedup'], '.2f')} | "
            f"{fmt(r['prefill_speedup'], '.2f')} | {trained} | {r['speed_run']} |")
    lines += ["", ("Quality: WikiText-2 raw test, all 62 pages, token-level perplexity over 256-token windows; "
              "the seven tasks (ARC-e/c, PIQA, HellaSwag, BoolQ, WinoGrande, OpenBookQA) on their first 500 "
              "items; bf16. Speed: the runtime's cpu backend, native decode step, fp32, 1 thread; decode batch "
              "1 (64 tokens after a 64-token prompt), prefill 1,024 tokens; round-robin, 1 warm-up + 7 rounds, "
              "median, against dense in the same run. One seed; read speedups to about +-0.1x. Wall time: "
              "`wide prune`'s training stage (calibration and evaluation not counted), one thread, two or "
              "three jobs on the 2-core machine.")]
    return "\n".join(lines) + "\n"


def main() -> None:
    rows = load()
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "report.json").write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    (OUT / "report.md").write_text(markdown(rows))
    plotted = [dict(r, method=PLOT_SERIES[r["name"]]) if r["name"] in PLOT_SERIES else r for r in rows]
    pareto_plot(plotted, OUT / "pareto.png",
                title="SmolLM2-135M, <= 400 steps x 4 x 256 corpus tokens per trained method "
                      "(one seed; speed +-0.1x)")
    print(markdown(rows))


if __name__ == "__main__":
    main()
