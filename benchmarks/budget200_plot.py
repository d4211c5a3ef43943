"""Pareto plot of docs/results/pareto-smollm2/budget200.json's session-9 rows (WikiText-2 perplexity
and task average against measured decode speedup, median of rounds), with `wide compare`'s plot.
Usage: python benchmarks/budget200_plot.py [OUT.png]"""

import json
import sys
from pathlib import Path

from wide_cli.eval.compare import pareto_plot

HERE = Path("docs/results/pareto-smollm2")
doc = json.load(open(HERE / "budget200.json"))["session9"]
dense = doc["dense"]
rows = [{"method": "dense", "lora": False, "decode_speedup": 1.0, "wikitext_ppl": dense["wikitext_ppl"],
         "task_avg": dense["task_avg"], "cost_target": None}]
for r in doc["rows"]:
    if r["lora_lr"] != 1e-3:  # sd200 (lr 2e-4) shares sd200lrfix's architecture and speed
        continue
    rows.append({"method": r["method"], "lora": True, "decode_speedup": r["decode_speedup"],
                 "wikitext_ppl": r["wikitext_ppl"], "task_avg": r["task_avg"], "cost_target": r["cost_target"]})
out = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "budget200-s9.png"
pareto_plot(rows, out, title="SmolLM2-135M, 200 steps x 4 x 256 tokens per method, LoRA lr 1e-3 "
                             "(one seed; speed +-0.1x)")
print(out)
