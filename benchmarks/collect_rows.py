"""Collect one comparison's rows into one JSON (the rows files of
docs/results/quality-at-equal-speed/): quality from the evaluation cache
(`evaluate_targets(..., cache_dir=...)`: WikiText-2 token level and the seven tasks), the training
report of each `wide prune --json` run, and the speed rows of `benchmarks/speed_round_robin.py`.
Usage (from the repository root):

python benchmarks/collect_rows.py EVAL_CACHE_DIR SPEED.json OUT.json RUN [RUN ...]

RUN is a run name under runs/ (its export is runs/RUN/export and its report runs/RUN.json), or a
model spec (the dense reference). Prints a Markdown table; writes OUT.json with one row per run:
method, cost_target, wikitext_ppl, task_avg, flops, decode_speedup, prefill_speedup, plus held-out
perplexity, per-task scores and training time."""

import json
import sys
from pathlib import Path

cache_dir, speed_path, out_path, *runs = sys.argv[1:]
cached = {}
for f in Path(cache_dir).glob("*.json"):
    row = json.loads(f.read_text())
    cached[row["name"]] = row
speed = {r["name"]: r for r in json.loads(Path(speed_path).read_text())["rows"]}
rows = []
for run in runs:
    target = run if not Path("runs", run).is_dir() else f"runs/{run}/export"
    q = cached[target]
    res = q["results"]
    tasks = {k: v["summary_value"] for k, v in res.items() if k != "wikitext"}
    row = {"name": run, "method": q["method"], "wikitext_ppl": res["wikitext"]["summary_value"],
           "wikitext_pages": res["wikitext"]["dataset"]["n_documents"],
           # a WikiText-2-only evaluation (QUALITY_TASKS=wikitext) has no task average
           "task_avg": sum(tasks.values()) / len(tasks) if tasks else None, "tasks": tasks,
           "task_limit": next(iter(res[k]["dataset"]["limit"] for k in tasks), None),
           "flops": q["flops"]["relative"], "sparsity": q["sparsity"]}
    report = Path("runs", f"{run}.json")
    if report.is_file():
        rep = json.loads(report.read_text())
        row |= {"cost_target": rep["cost"]["target"], "heldout_ppl": rep["eval"]["pruned"]["perplexity"],
                "heldout_dense_ppl": rep["eval"]["dense"]["perplexity"], "train_steps": rep["train"]["steps"],
                "train_tokens": rep["train"]["tokens"], "train_seconds": rep["train"]["seconds"],
                "drop_layers": rep["settings"]["routing"]["drop_layers"]}
    else:
        row["cost_target"] = None
    s = speed.get(target)
    if s:
        row |= {k: s[k] for k in ("decode_speedup", "prefill_speedup", "decode_tokens_per_s", "prefill_tokens_per_s",
                                  "decode_seconds")}
    rows.append(row)
dense_heldout = next((r["heldout_dense_ppl"] for r in rows if "heldout_dense_ppl" in r), float("nan"))
Path(out_path).write_text(json.dumps({"rows": rows}, indent=1) + "\n")
print("| run | method | WikiText-2 ppl | task avg % | held-out ppl | FLOPs | decode x | prefill x |")
print("|---|---|---|---|---|---|---|---|")
for r in rows:
    method = r["method"] + (f" + {r['drop_layers']} layers dropped" if r.get("drop_layers") else "")
    avg = "-" if r["task_avg"] is None else f"{100 * r['task_avg']:.2f}"
    print(f"| {r['name']} | {method} | {r['wikitext_ppl']:.2f} | {avg} | "
          f"{r.get('heldout_ppl', dense_heldout):.2f} | {r['flops']:.3f} | "
          f"{r.get('decode_speedup', float('nan')):.2f} | {r.get('prefill_speedup', float('nan')):.2f} |")
