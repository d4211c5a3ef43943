"""Write docs/results/gemma3-270m.md from the files `benchmarks/gemma3_270m.sh` leaves in OUT:
parity.json, prune-gemma3-{wide,sd}.json, quality-{wikitext,tasks}-*.json, speed.json, text.json.
Missing files leave their section out (the page says so). Usage:
python benchmarks/gemma3_270m_report.py OUT_DIR"""

import json
import platform
import sys
from pathlib import Path

from transformers import AutoConfig

from wide_cli.cost import cost_model
from wide_cli.models.arch import model_shape
from wide_cli.models.loader import resolve_source
from wide_cli.runtime.cpu_native import cpu_model

out = Path(sys.argv[1])


def load(name):
    p = out / name
    return json.loads(p.read_text()) if p.is_file() else None


prunes = {slug: load(f"prune-{slug}.json") for slug in ("gemma3-wide", "gemma3-sd")}


def fmt_target(rep, default="?"):
    return f"{rep['settings']['routing']['cost_target']:g}" if rep else default


def removed(rep, key):
    return len(rep["train"][key]["removed"]) if rep and rep["train"].get(key) else None


TARGET = fmt_target(prunes["gemma3-wide"], fmt_target(prunes["gemma3-sd"]))
ROWS = [("gemma3-270m", "dense", "gemma3-270m"),
        ("gemma3-wide", (f"wide (the recipe's method): {removed(prunes['gemma3-wide'], 'dropped_layers') or 0} layers "
         f"removed + width routed to {fmt_target(prunes['gemma3-wide'])} of dense FLOPs"), "runs/gemma3-wide/export"),
        ("gemma3-sd", (f"static depth: {removed(prunes['gemma3-sd'], 'static_depth') or '?'} layers removed (the first "
         f"count at or under {fmt_target(prunes['gemma3-sd'])} of dense FLOPs) + LoRA"), "runs/gemma3-sd/export")]


def data_words(rep) -> str:
    """The training data of a prune report, as the page names it."""
    if not rep:
        return "the recipe's data"
    d = rep["settings"]["data"]
    name = "CPython's pydoc topics" if d["train"] == "builtin:pydoc" else f"`{Path(d['train']).name}/`"
    extra = ["documents shuffled"] if d.get("shuffle_documents") else []
    if d.get("max_train_tokens"):
        extra.append(f"at most {d['max_train_tokens']:,} tokens")
    return name + (f" ({', '.join(extra)})" if extra else "")


lines = ["# Gemma 3 270M: dense parity, width routing against static depth, speed", "",
         ("Written by `benchmarks/gemma3_270m_report.py` from the files `benchmarks/gemma3_270m.sh` wrote "
         f"(`{'' if (out / 'speed-bf16.json').is_file() else 'SPEED_DTYPES=fp32 '}benchmarks/gemma3_270m.sh parity wide "
         "static-depth quality speed text report`), "
         "1 thread per process."), ""]

# where a token's cost goes: the tied head, which no routing touches
local_dir, _, _ = resolve_source("gemma3-270m")
shape = model_shape(AutoConfig.from_pretrained(local_dir))
lines += ["## Where a token's cost goes", "",
          ("| metric | lm_head (tied, 262,144 x 640) | 18 layers | routable (q/o rows, FFN channels) | "
          "ideal speed-up of width routing alone at 50 % routed sparsity |"), "|---|---|---|---|---|"]
for metric in ("flops", "decode_bytes"):
    cm = cost_model(shape, metric=metric, attn_group_size=1, ffn_group_size=128, seq_len=256)
    head = shape.vocab_size * shape.hidden_size * (2 if metric == "flops" else 1)
    routable = 1.0 - cm.floor_fraction
    lines.append(f"| {metric} | {head / cm.dense_total:.1%} | {1 - cm.model_floor / cm.dense_total:.1%} | "
                 f"{routable:.1%} | {1 / (1 - 0.5 * routable):.2f}x |")
lines += ["", ("The head is most of what a token costs; width routing alone cannot buy much on this model, "
          "so the recipe also removes layers (hybrid), and the speed section below measures what that buys."), ""]

par = load("parity.json")
if par:
    lines += ["## Dense parity", "",
              (f"Token-level WikiText-2 perplexity, first {par['pages']} pages, {par['seq_len']}-token windows "
              f"({par['tokens_scored']:,} tokens scored), fp32: `wide eval`'s path (wide's loader and cache) "
              f"**{par['wide_eval_perplexity']:.4f}**, transformers' own forward of the same GGUF weights "
              f"**{par['transformers_perplexity']:.4f}** (relative difference {par['relative_difference']:+.2e}). "
              f"Model: {par['model']}."), ""]

quality = {}
for slug, _, _ in ROWS:
    q = {}
    for kind in ("wikitext", "tasks"):
        rep = load(f"quality-{kind}-{slug}.json")
        if rep:
            q[kind] = {**rep["rows"][0], "settings": rep.get("settings", {})}
    quality[slug] = q
speed_rep = load("speed.json") or {"rows": []}
speed = {r["name"]: r for r in speed_rep["rows"]}
# the CPU the speed files were measured on (older files do not name it: then this machine's, said so)
speed_cpu = speed_rep.get("cpu") or f"not recorded (this page was written on {cpu_model() or platform.processor()})"
speed_bf16 = {r["name"]: r for r in (load("speed-bf16.json") or {"rows": []})["rows"]}

if any(quality.values()) or speed:
    lines += [f"## Dense, wide and static depth at one FLOPs target ({TARGET} of dense)", "",
              ("| model | FLOPs of dense | WikiText-2 ppl | task avg % | decode x dense (fp32) | prefill x dense "
               "(fp32) | " + ("decode x dense (bf16) | prefill x dense (bf16) | " if speed_bf16 else "")
               + "held-out ppl (training data) | training |"),
              "|---|---|---|---|---|---|" + ("---|---|" if speed_bf16 else "") + "---|---|"]
    task_names = []
    for slug, label, target in ROWS:
        q = quality[slug]
        wt = q.get("wikitext", {}).get("results", {}).get("wikitext", {}).get("summary_value")
        tr = q.get("tasks", {}).get("results", {})
        tasks = {k: v["summary_value"] for k, v in tr.items()}
        task_names = task_names or list(tasks)
        flops = (q.get("wikitext") or q.get("tasks") or {}).get("flops", {}) or {}
        sp, sb = speed.get(target, {}), speed_bf16.get(target, {})
        rep = prunes.get(slug)
        held = f"{rep['eval']['pruned']['perplexity']:.2f} (dense {rep['eval']['dense']['perplexity']:.2f})" \
            if rep else "-"
        train = f"{rep['train']['steps']} steps, {rep['train']['seconds'] / 60:.0f} min" if rep else "-"
        lines.append(f"| {label} | {flops.get('relative', 1.0):.3f} | {'-' if wt is None else f'{wt:.2f}'} | "
                     f"{'-' if not tasks else f'{100 * sum(tasks.values()) / len(tasks):.2f}'} | "
                     f"{sp.get('decode_speedup', float('nan')):.2f} | {sp.get('prefill_speedup', float('nan')):.2f} | "
                     + (f"{sb.get('decode_speedup', float('nan')):.2f} | {sb.get('prefill_speedup', float('nan')):.2f} | "
                        if speed_bf16 else "")
                     + f"{held} | {train} |")
    if task_names:
        lines += ["", "| model | " + " | ".join(task_names) + " |", "|---|" + "---|" * len(task_names)]
        for slug, label, _ in ROWS:
            tr = quality[slug].get("tasks", {}).get("results", {})
            lines.append(f"| {label} | " + " | ".join(
                f"{100 * tr[t]['summary_value']:.1f}" if t in tr else "-" for t in task_names) + " |")
    any_q = next((q for q in quality.values() if q), {})
    wt_pages = any_q.get("wikitext", {}).get("results", {}).get("wikitext", {}).get("dataset", {}).get("n_documents")
    limit = any_q.get("tasks", {}).get("settings", {}).get("limit") if "tasks" in any_q else None
    lines += ["", (f"Protocol: WikiText-2 test, token level, 256-token windows, first {wt_pages} of 62 pages; "
              f"the seven tasks (acc_norm where lm-eval reports it) on their first {limit} items each; bf16. "
              "Speed: `wide compare`'s protocol (the runtime's native decode step, 1 thread, batch 1 after a "
              "64-token prompt, 64 new tokens; prefill of 1,024 tokens; round-robin, median of 5 rounds, dense "
              f"first in the same run), in fp32" + (" and once in bf16 (another run)" if speed_bf16 else "")
              + f", on {speed_cpu}. Training: both runs on "
              f"{data_words(prunes['gemma3-wide'] or prunes['gemma3-sd'])}, 4 x 256 tokens per step, distillation "
              "to the dense model; wide trains routers, stand-ins and LoRA together (the recipe `gemma3-270m-cpu` "
              "with the data and cost target above in place of its own), static depth trains LoRA."), ""]

if speed and all(quality[slug].get("wikitext") for slug, _, _ in ROWS):
    def num(slug, target):
        wt = quality[slug]["wikitext"]["results"]["wikitext"]["summary_value"]
        return wt, speed.get(target, {}).get("decode_speedup"), speed.get(target, {}).get("prefill_speedup")

    (d_wt, _, _), (w_wt, w_dec, w_pre), (s_wt, s_dec, s_pre) = (num(slug, t) for slug, _, t in ROWS)
    ahead = "ahead of" if w_pre > s_pre else "behind"
    if w_wt < s_wt and w_dec >= s_dec - 0.03:
        verdict = ("Width routing pays here: a lower perplexity than static depth at no less measured decode "
                   "speed (within 0.03x or faster).")
    elif w_wt < s_wt:
        verdict = ("wide has the lower perplexity but decodes slower than static depth: the two are not at equal "
                   "measured speed, so this table does not show width routing paying on this model.")
    else:
        verdict = ("Width routing does not pay on this model at this budget: static depth has the lower or equal "
                   "perplexity" + (" and decodes faster." if s_dec > w_dec else "."))
    lines += [(f"What this run shows: at batch-1 decode (fp32) the routed model runs {w_dec:.2f}x dense against "
               f"{s_dec:.2f}x for static depth (the tied head, which no routing touches, is read whole at every "
               f"step); at a 1,024-token prefill it is {ahead} static depth, {w_pre:.2f}x against {s_pre:.2f}x. "
               f"WikiText-2: {w_wt:.1f} wide ({w_wt / d_wt:.2f}x dense) and {s_wt:.1f} static depth "
               f"({s_wt / d_wt:.2f}x) against {d_wt:.1f} dense. {verdict}"), ""]


slow = [label.split(":")[0] for slug, label, target in ROWS[1:]
        if speed_bf16.get(target, {}).get("decode_speedup", 1.0) < 1.0]
if slow:
    lines += [(f"Not representative: in bf16 the native decode step runs {', '.join(slow)} slower than the dense "
              "model although it reads fewer bytes, while in fp32 it is faster; the fp32 columns are the "
              "comparison until that runtime defect is found."), ""]

text = load("text.json")
if text:
    names = {target: label.split(":")[0] for _, label, target in ROWS}
    lines += ["## Greedy continuations (`wide generate`, the runtime's cpu backend, fp32)", "",
              "| prompt | " + " | ".join(names.get(m["model"], m["model"]) for m in text["models"]) + " |",
              "|---|" + "---|" * len(text["models"])]
    for i, prompt in enumerate(text["prompts"]):
        cells = [m["texts"][i].replace("\n", " / ").replace("|", "\\|").strip() for m in text["models"]]
        lines.append(f"| {prompt} | " + " | ".join(cells) + " |")
    lines.append("")

page = "\n".join(lines).rstrip() + "\n"
dest = out.parent / "gemma3-270m.md"
tmp = dest.with_suffix(".md.tmp")
tmp.write_text(page)
tmp.replace(dest)
print(page)
