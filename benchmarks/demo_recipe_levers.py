"""The lever table of docs/results/demo-recipe.md from the `wide prune --json` outputs of the
short lever runs (runs/abl/NAME.json, `benchmarks/demo_recipe.sh levers-*`): per run its targets,
measured sparsity, FLOPs and decode bytes relative to dense (`wide_cli.cost` at that sparsity), the
ideal decode bound, final training loss, WikiText-2 perplexity and training time. Writes the rows as
JSON to stdout, the Markdown rows to stderr. Usage: python benchmarks/demo_recipe_levers.py runs/abl NAME..."""

import json
import sys
from pathlib import Path

from wide_cli.cost import cost_model, decode_speedup_bound
from wide_cli.models.arch import ModelShape

SMOLLM2 = ModelShape(num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64,
                     intermediate_size=1536, vocab_size=49152, model_type="llama")

root, names = Path(sys.argv[1]), sys.argv[2:]
rows = []
for name in names:
    d = json.loads((root / f"{name}.json").read_text())
    sp, ev, s = d["sparsity"], d["eval"], d["settings"]
    fl = cost_model(SMOLLM2, metric="flops", seq_len=ev["seq_len"]).relative(sp)
    by = cost_model(SMOLLM2, metric="decode_bytes").relative(sp)
    rows.append({
        "run": name, "steps": d["train"]["steps"], "train_seconds": d["train"]["seconds"],
        "cost_target": s["routing"].get("cost_target"), "sparsity_targets": [s["routing"]["sparsity_attention"], s["routing"]["sparsity_ffn"]],
        "distill": s["train"].get("distill", 0.0),
        "standin": s["routing"].get("standin", "none"), "lora_joint": s["stage2"].get("joint", False),
        "wikitext_ppl_dense": ev["dense"]["perplexity"], "wikitext_ppl": ev["pruned"]["perplexity"],
        "tokens_scored": ev["pruned"]["n_tokens_scored"], "s_attention": sp["attention"], "s_ffn": sp["ffn"],
        "flops": fl, "decode_bytes": by, "decode_speedup_bound": decode_speedup_bound(SMOLLM2, sp),
        "final_train_lm_loss": d["train"]["final"].get("lm_loss"),
    })
print(json.dumps(rows, indent=1))
for r in rows:
    print(f"| {r['run']} | {r['cost_target'] or r['sparsity_targets']} | {r['distill']} | {r['standin']} | "
          f"{r['s_attention']:.3f} / {r['s_ffn']:.3f} | {r['flops']:.3f} | {r['decode_bytes']:.3f} | "
          f"{r['decode_speedup_bound']:.2f}x | {r['final_train_lm_loss']:.3f} | {r['wikitext_ppl']:.1f} | {r['train_seconds']:.0f} |",
          file=sys.stderr)
