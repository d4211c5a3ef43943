"""Measure the speed of a list of targets with `wide compare`'s protocol
(`wide_cli.eval.compare.measure_speed`: decode batch 1 and prefill, round-robin, median of rounds),
the dense model first, and write one row per target with its speedups against that dense model.
TARGETS.json is {"rows": [{"name": MODEL_OR_EXPORT, "label", "weights", "method", "cost_target", ...},
...]} ("weights": the runtime weight format of that row, fp32 / bf16 / int8 / int4; absent = --dtype;
a `wide compare` report works too; its quality columns are carried over). Usage:
python benchmarks/speed_round_robin.py TARGETS.json OUT.json [--dtype fp32|bf16] [--repeats 3]
(run from the directory the targets are relative to)."""

import argparse
import json
import os
import platform

from wide_cli.eval.compare import SpeedConfig, measure_speed, speed_key
from wide_cli.runtime.cpu_native import cpu_model

ap = argparse.ArgumentParser()
ap.add_argument("report")
ap.add_argument("out")
ap.add_argument("--dtype", default=None)
ap.add_argument("--repeats", type=int, default=3)
args = ap.parse_args()
with open(args.report) as f:
    rep = json.load(f)
targets = [r["name"] for r in rep["rows"]]
formats = [r.get("weights") for r in rep["rows"]]
cfg = SpeedConfig(repeats=args.repeats, dtype=args.dtype)
speed = measure_speed(targets, cfg, weight_formats=formats, log=print)
dense = speed[speed_key(targets[0], formats[0])]
rows = []
for r in rep["rows"]:
    s = speed[speed_key(r["name"], r.get("weights"))]
    rows.append({k: r.get(k) for k in ("name", "label", "weights", "method", "cost_target", "wikitext_ppl", "task_avg", "flops",
                                        "decode_speedup_bound")}
                | {"decode_speedup": s["decode_tokens_per_s"] / dense["decode_tokens_per_s"],
                   "prefill_speedup": s["prefill_tokens_per_s"] / dense["prefill_tokens_per_s"],
                   "decode_speedup_before": r.get("decode_speedup"), "prefill_speedup_before": r.get("prefill_speedup"),
                   "decode_tokens_per_s": s["decode_tokens_per_s"], "prefill_tokens_per_s": s["prefill_tokens_per_s"],
                   "sparsity": s["sparsity"], "decode_seconds": s["decode_seconds"]})
# the machine beside its numbers: the same code ran ~2x apart on two CPUs of one kind; temp file + rename
tmp = args.out + ".tmp"
with open(tmp, "w") as f:
    json.dump({"settings": cfg.__dict__, "cpu": cpu_model() or platform.processor(), "rows": rows}, f, indent=2)
os.replace(tmp, args.out)
for r in rows:
    print(f"{r['label'] or r['name']:40s} ppl {r['wikitext_ppl'] or 0:8.1f}  decode x {r['decode_speedup']:.2f} "
          f"(was {r['decode_speedup_before'] or 0:.2f})  prefill x {r['prefill_speedup']:.2f}")
