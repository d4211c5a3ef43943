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
# what the routed run's routers read (absent: a run from before the setting, the raw residual)
router_input = (((prunes.get("gemma3-wide") or {}).get("settings") or {}).get("routing") or {}).get(
    "router_input", "residual")
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
         "static-depth quality speed bench text routing report`), "
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
              "with the data and cost target above in place of its own"
              + ("" if router_input == "standardized" else
                 "; its routers read the raw residual stream (`router_input = \"residual\"`), not the recipe's "
                 "standardised input, and route every token alike: see below")
              + "), static depth trains LoRA."), ""]
if router_input != "standardized":
    lines += [("Why the routed model above routes every token alike: Gemma 3's residual stream grows to ~3 x 10^4, with "
               "a mean over tokens 3-5x the per-token deviation, so routers reading it raw have logits in the "
               "thousands that barely vary between tokens: on the first 255 tokens of WikiText-2's test text, 30 "
               "of that export's 32 routers give every token the same mask (the other two: 2 masks), and its "
               "greedy decoding repeats itself. The recipe's `router_input = \"standardized\"` standardises each "
               "router's input by the dense model's per-channel moments (folded into the exported routers); an "
               "8-step run with it (same data, 8 x 4 x 256 tokens) gives 2 to 176 distinct masks per router on "
               "the same tokens. This table's wide row is from a run without it."), ""]

routing = load("routing-gemma3-wide.json")
if routing and (routing.get("sparsity") or {}).get("distinct_masks"):
    sp = routing["sparsity"]
    dm = {m: [n for n in v if n is not None] for m, v in sp["distinct_masks"].items()}
    spans = "; ".join(f"{m} routers {min(v)} to {max(v)}" for m, v in dm.items() if v)
    warned = [w for w in routing.get("warnings") or [] if "static masks" in w]
    lines += [(f"How varied the routing is (`benchmarks/gemma3_270m.sh routing`: `wide inspect "
               f"runs/gemma3-wide/export --text` on the start of WikiText-2's test text, {sp['tokens']:,} "
               f"tokens): distinct masks per router, {spans}; measured sparsity attention "
               f"{100 * sp['attention']:.1f} %, FFN {100 * sp['ffn']:.1f} %. "
               + (f"`wide inspect` warns: {warned[0]}." if warned else
                  "No router gives every token the same mask.")), ""]

if speed and all(quality[slug].get("wikitext") for slug, _, _ in ROWS):
    def num(slug, target):
        wt = quality[slug]["wikitext"]["results"]["wikitext"]["summary_value"]
        return wt, speed.get(target, {}).get("decode_speedup"), speed.get(target, {}).get("prefill_speedup")

    (d_wt, _, _), (w_wt, w_dec, w_pre), (s_wt, s_dec, s_pre) = (num(slug, t) for slug, _, t in ROWS)
    task_avg = {slug: sum(v["summary_value"] for v in (quality[slug].get("tasks") or {}).get("results", {}).values())
                for slug, _, _ in ROWS}
    ahead = ("level with" if abs(w_pre - s_pre) < 0.005 else "ahead of" if w_pre > s_pre else "behind")
    if w_wt < s_wt and w_dec >= s_dec - 0.03:
        verdict = ("Width routing pays here on perplexity: a lower one than static depth at no less measured "
                   "decode speed (within 0.03x or faster)"
                   + ("; on the seven tasks (50 items each, a few points of noise) static depth's average is "
                      "the higher." if task_avg.get("gemma3-sd", 0) > task_avg.get("gemma3-wide", 0) else "."))
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

benches = {name: load(f"bench-{name}.json") for name in ("gemma3-wide", "gemma3-sd")}
if any(benches.values()):
    lines += ["## Against llama.cpp on the original GGUF (`wide bench`)", "",
              ("`benchmarks/gemma3_270m.sh bench`: per export, `wide bench EXPORT --systems dense,cpu,llama.cpp "
              "--weights fp32,bf16,int8,int4 --prefill-lengths 1024 --decode-batches 1 --new-tokens 64 "
              "--threads 1 --repeats 3` (median of 3 rounds after a warm-up, systems round-robin in one "
              "process). `dense`: the runtime with routing off on the export's own backbone (its removed "
              "layers stay removed); `cpu`: the routed model, the native decode step; llama.cpp runs the "
              "model's original Q4_K_M GGUF, all 18 layers, the file a llama.cpp user downloads. "
              "x llama.cpp: tokens/s against llama.cpp at the same threads."), ""]
    for name, rep in benches.items():
        if not rep:
            continue
        label = {slug: lab for slug, lab, _ in ROWS}.get(name, name)
        rows = rep["results"]
        env = rep.get("environment") or {}
        cpu_name = ", ".join(x for x in (env.get("cpu_model"), "/".join(env.get("simd") or [])) if x)
        lines += [f"**{label}**" + (f" ({cpu_name})" if cpu_name else ""), "",
                  "| system | weights | threads | decode tok/s | x llama.cpp | prefill 1,024 tok/s | x llama.cpp |",
                  "|---|---|---|---|---|---|---|"]
        def pick(system, weights, threads, phase):
            return next((r for r in rows if r["system"] == system and r["weights"] == weights
                         and r["threads"] == threads and r["phase"] == phase), None)
        for threads in sorted({r["threads"] for r in rows}):
            ll = [r for r in rows if r["kind"] == "llama.cpp" and r["threads"] == threads]
            ll_dec = next((r["tokens_per_s"] for r in ll if r["phase"] == "decode"), None)
            ll_pre = next((r["tokens_per_s"] for r in ll if r["phase"] == "prefill"), None)
            systems = list(dict.fromkeys((r["system"], r["weights"]) for r in rows if r["threads"] == threads))
            for system, weights in systems:
                dec, pre = pick(system, weights, threads, "decode"), pick(system, weights, threads, "prefill")
                def cell(r, ref):
                    if r is None:
                        return "-", "-"
                    return f"{r['tokens_per_s']:.1f}", (f"{r['tokens_per_s'] / ref:.2f}" if ref else "-")
                (dt, dx), (pt, px) = cell(dec, ll_dec), cell(pre, ll_pre)
                lines.append(f"| {system} | {weights} | {threads} | {dt} | {dx} | {pt} | {px} |")
        lines.append("")
    def best_int4(rep):
        rs = [r for r in rep["results"] if r["weights"] == "int4" and r["phase"] == "decode" and r["threads"] == 1]
        ll = next((r for r in rep["results"] if r["kind"] == "llama.cpp" and r["phase"] == "decode"
                   and r["threads"] == 1), None)
        return max(r["tokens_per_s"] for r in rs) / ll["tokens_per_s"] if rs and ll else None
    if all(benches.values()):
        w4, s4 = best_int4(benches["gemma3-wide"]), best_int4(benches["gemma3-sd"])
        if w4 and s4:
            lines += [(f"At batch-1 decode in int4 (1 thread) the runtime runs the wide export {w4:.2f}x and the "
                       f"static-depth export {s4:.2f}x llama.cpp's Q4_K_M of the whole model; "
                       + ("static depth is the faster of the two here too." if s4 > w4 else
                          "wide is the faster of the two here.")), ""]
    lines += [("The exports have fewer layers than the file llama.cpp runs (2 or 4 of 18 removed), and "
               "the runtime's int4 is 4.5 bits per weight (one bf16 scale per 32) against Q4_K_M's mix of "
               "4- and 6-bit blocks, so these rows compare what each tool runs for a user, not one kernel "
               "against another at equal work."), ""]

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
