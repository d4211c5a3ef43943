"""The vLLM CPU acceptance run: greedy parity with `wide generate`, throughput under concurrency.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/vllm_cpu.py EXPORT --dense-model DIR \\
        --prompts ../shared/data/wikitext-2-raw/wiki.test.raw --out docs/results/vllm-cpu

1. Parity: the first 16 prose lines of the prompts file (cut to 24 words), 64 greedy tokens each
   (EOS ignored): `wide generate EXPORT --backend reference --json` vs vLLM's offline ``LLM``
   with the plugin on the same token ids (``wide_cli.serve.offline``, which also reports the
   multiply-adds the routed ops executed).
2. Throughput: one server per system, all started first -- the routed export, the export with
   every group on (``--all-on``), both as `wide serve` runs them, and the dense base model on
   vLLM's own ``LlamaForCausalLM`` -- then max(16, c) requests x 64 tokens at c = 1, 4, 16 and 64
   concurrent requests, round-robin over the systems (``--rounds``, median reported); output
   tokens / wall seconds.
3. A real client: lm-evaluation-harness's ``local-completions`` model scores PIQA (the harness's
   own task yaml, fed the local file; ``--harness-limit`` items) through the routed server's
   prompt log-probabilities, against `wide eval` on the same export and items.

Writes ``OUT.json`` and ``OUT.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
N_PROMPTS, NEW_TOKENS, WORDS = 16, 64, 24
CONCURRENCY = (1, 4, 16, 64)


def prompts_from(path: Path, n: int = N_PROMPTS) -> list[str]:
    """The first ``n`` prose lines of ``path`` with >= 24 words, cut to 24 words."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        s = line.strip()
        if len(s.split()) >= WORDS and not s.startswith("="):
            out.append(" ".join(s.split()[:WORDS]))
        if len(out) == n:
            return out
    raise SystemExit(f"{path}: fewer than {n} lines of {WORDS}+ words")


def wide_generate(export: Path, prompts: list[str], *extra: str) -> dict:
    cmd = [str(REPO / ".venv/bin/wide"), "generate", str(export), "--backend", "reference", "--json",
           "--max-new-tokens", str(NEW_TOKENS), "--ignore-eos", "--dtype", "fp32", *extra]  # fmt: skip
    for p in prompts:
        cmd += ["-p", p]
    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(r.stdout)


def vllm_offline(python: str, export: Path, ids: list[list[int]], work: Path) -> dict:
    req = {"export": str(export), "prompts": ids, "max_tokens": NEW_TOKENS, "dtype": "float32",
           "max_model_len": 512, "modes": ["routed", "all-on", "routed-sequential"]}  # fmt: skip
    (work / "req.json").write_text(json.dumps(req))
    with open(work / "offline.log", "w") as log:
        subprocess.run([python, "-m", "wide_cli.serve.offline", str(work / "req.json"), str(work / "out.json")],
                       check=True, stdout=subprocess.DEVNULL, stderr=log)  # fmt: skip
    return json.loads((work / "out.json").read_text())


def machine() -> str:
    """The CPU this run measured on, with the vector extensions the kernels use: the same code
    runs at different speeds on machines of one kind."""
    from wide_cli.runtime.cpu_native import cpu_flags, cpu_model

    flags = set(cpu_flags().split())
    ext = [n for n, f in (("AVX-512", "avx512f"), ("AVX512-BF16", "avx512_bf16"), ("AVX512-VNNI", "avx512_vnni"),
                          ("AMX", "amx_tile"), ("AVX2", "avx2")) if f in flags]  # fmt: skip
    name = cpu_model() or platform.processor() or platform.machine()
    return f"{os.cpu_count()} CPU cores, {name} ({', '.join(ext) or 'no AVX2'})"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def measure(base: str, prompts: list[str], c: int) -> tuple[int, float]:
    """max(16, c) greedy requests (the first prompts) x 64 tokens at ``c`` concurrent requests:
    ``(output tokens, seconds)``."""
    url = base + "/v1"
    body = {"model": _post_models(url), "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    todo = prompts[: max(N_PROMPTS, c)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(c) as pool:
        outs = list(pool.map(lambda q: _post(url + "/completions", {**body, "prompt": q}), todo))
    return sum(o["usage"]["completion_tokens"] for o in outs), time.perf_counter() - t0


def throughput(systems: list[tuple], prompts: list[str], work: Path, rounds: int, then=None) -> list[dict]:
    """Start every system's server (the same process handling as `wide serve`), then measure them
    round-robin -- per round, per concurrency, each system once -- so that load from other jobs
    hits all of them alike; a row's ``output_tokens_per_s`` is the median over rounds.
    ``then(base_url)`` runs against the first system's server before the servers stop."""
    from wide_cli.serve.server import server_env, start, stop

    procs, logs = [], []
    try:
        for i, (name, _, cmd, o) in enumerate(systems):
            print(f"starting {name} ...", file=sys.stderr)
            logs.append(open(work / f"server-{i}.log", "w"))  # noqa: SIM115 -- the server writes to it until stopped
            procs.append(start(cmd, server_env(o), f"http://{o.host}:{o.port}", log=logs[-1])[0])
            base = f"http://{o.host}:{o.port}"
            _post(base + "/v1/completions", {"model": _post_models(base + "/v1"), "prompt": prompts[0], "max_tokens": 4})
        runs: dict = {}
        for r in range(rounds):
            for c in CONCURRENCY:
                for name, _, _, o in systems:
                    toks, dt = measure(f"http://{o.host}:{o.port}", prompts, c)
                    runs.setdefault((name, c), []).append(toks / dt)
                    print(f"  round {r + 1} {name} concurrency {c}: {toks} tokens in {dt:.1f} s = {toks / dt:.1f} tok/s",
                          file=sys.stderr)  # fmt: skip
        if then is not None:
            o = systems[0][3]
            then(f"http://{o.host}:{o.port}")
    finally:
        for p in procs:
            stop(p)
        for lf in logs:
            lf.close()
    rows = []
    for name, skips, _, _ in systems:
        for c in CONCURRENCY:
            v = sorted(runs[(name, c)])
            rows.append({"system": name, "skips_work": skips, "concurrency": c, "requests": max(N_PROMPTS, c),
                         "output_tokens_per_request": NEW_TOKENS, "output_tokens_per_s": round(v[len(v) // 2], 2),
                         "rounds_tokens_per_s": [round(x, 2) for x in runs[(name, c)]]})  # fmt: skip
    return rows


#: The harness's own PIQA task, fed the local validation file instead of the Hugging Face hub.
HARNESS_TASK = """\
include: {piqa_yaml}
task: piqa_local
dataset_path: json
dataset_name: null
dataset_kwargs:
  data_files:
    validation: {data_file}
training_split: null
test_split: null
"""


def harness_vs_wide_eval(base: str, export: Path, data_dir: Path, limit: int, work: Path) -> dict:
    """lm-eval ``local-completions`` (prompt log-probabilities through ``/v1/completions``) on
    PIQA's first ``limit`` items against the served export, and `wide eval` on the same export and
    items: accuracies and the items whose acc differs."""
    import lm_eval

    tasks = work / "harness-tasks"
    tasks.mkdir(parents=True, exist_ok=True)
    piqa_yaml = Path(lm_eval.__file__).parent / "tasks" / "piqa" / "piqa.yaml"
    (tasks / "piqa_local.yaml").write_text(HARNESS_TASK.format(piqa_yaml=piqa_yaml,
                                                               data_file=(data_dir / "zeroshot/piqa.jsonl").resolve()))
    out = work / "harness-out"
    model_args = (f"model={_post_models(base + '/v1')},base_url={base}/v1/completions,tokenizer={export},"
                  "tokenizer_backend=huggingface,num_concurrent=4,max_length=512")  # fmt: skip
    cmd = [str(REPO / ".venv/bin/lm_eval"), "--model", "local-completions", "--model_args", model_args,
           "--tasks", "piqa_local", "--include_path", str(tasks), "--limit", str(limit), "--log_samples",
           "--output_path", str(out)]  # fmt: skip
    print("harness: " + " ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    res = json.loads(max(out.rglob("results_*.json"), key=lambda q: q.stat().st_mtime).read_text())
    samples = [json.loads(ln) for f in out.rglob("samples_piqa_local_*.jsonl") for ln in f.read_text().splitlines()]
    h_acc = {s["doc_id"]: s["acc"] for s in samples}
    # `wide eval`'s own scoring (evaluate_task) of the export, in fp32, keeping the items
    import torch

    from wide_cli.eval.run import load_target
    from wide_cli.eval.zeroshot import evaluate_task

    t = load_target(str(export), dtype=torch.float32, device="cpu")
    w = evaluate_task(t.model, t.tokenizer, "piqa", data_dir=data_dir, limit=limit, keep_items=True)
    w_acc = {i: 1.0 if it["pred"] == it["gold"] else 0.0 for i, it in enumerate(w["items"])}
    m = res["results"]["piqa_local"]
    return {
        "task": "piqa", "items": limit,
        "harness_command": "lm_eval " + " ".join(cmd[1:]),
        "harness": {"acc": m["acc,none"], "acc_norm": m["acc_norm,none"]},
        "wide_eval": {"acc": w["metrics"]["acc"], "acc_norm": w["metrics"]["acc_norm"]},
        "items_with_different_acc": sorted(i for i in w_acc if h_acc.get(i) != w_acc[i]),
    }  # fmt: skip


def _post_models(url: str) -> str:
    with urllib.request.urlopen(url + "/models", timeout=60) as r:
        return json.loads(r.read())["data"][0]["id"]


def macs_share(stats: dict, cfg: dict) -> dict:
    """Executed / dense multiply-adds: of the routed projections (O, gate/up/down), and of all
    decoder-layer projections (Q/K/V stay dense)."""
    H, D = cfg["num_attention_heads"], cfg["hidden_size"]
    d = cfg.get("head_dim") or D // H
    Hkv = cfg.get("num_key_value_heads") or H
    a, f = stats["attention"], stats["ffn"]
    qkv = a["dense"] / (H * d * D) * D * (H + 2 * Hkv) * d  # tokens x layers x qkv MACs
    return {
        "o_proj": round(a["executed"] / a["dense"], 4),
        "ffn": round(f["executed"] / f["dense"], 4),
        "routed_projections": round((a["executed"] + f["executed"]) / (a["dense"] + f["dense"]), 4),
        "all_decoder_projections": round((qkv + a["executed"] + f["executed"]) / (qkv + a["dense"] + f["dense"]), 4),
    }


PATHS = """\
Which paths skip work: `forward_cpu` (what ran here) executes only the active groups of the O
projection and of the FFN (gate/up/down), behind one opaque op per module that also runs its
router and adds its stand-ins: a decode step of <= 4 tokens is one native call that decides and runs
each token over its own groups on the runtime's native decode kernels (a group's weights read once
for all the tokens that execute it); a step of 5-16 tokens decides natively and runs those kernels when the union of its tokens'
groups is at most half the groups, else it runs vLLM's own dense kernels and masks (there oneDNN's
GEMM, which blocks all the tokens together, is faster); a larger step (prefill) gathers each group's executing tokens on the `cpu` backend's
projections (`runtime/cpu_proj.py`), or, when its tokens execute most (token, group) pairs and
every group, runs vLLM's dense kernels and masks. Q/K/V projections and vLLM's paged attention
kernel stay dense: attention computes every head and the skipped heads are masked before O.
`forward_native` (the oracle) only masks. `forward_cuda` calls the project's CuPy kernels when
CuPy and a GPU are present: not run (no GPU here, and vllm-cpu has no CUDA build)."""


def add_speedups(rows: list[dict]) -> list[dict]:
    """Each row's ``speedup_vs_dense``: its tokens/s over the dense system's at the same concurrency
    (measured in the same run)."""
    dense = {x["concurrency"]: x["output_tokens_per_s"] for x in rows if x["system"].startswith("dense")}
    for x in rows:
        d = dense.get(x["concurrency"])
        x["speedup_vs_dense"] = round(x["output_tokens_per_s"] / d, 4) if d else None
    return rows


def render_md(r: dict) -> str:
    p = r["parity"]
    lines = [
        "# wide on vLLM (CPU): greedy parity and throughput",
        "",
        f"Command: `{r['command']}`",
        "",
        (
            f"Export `{r['export']}` served by the plugin; dense baseline `{r['dense_model']}` on vLLM's own "
            f"`LlamaForCausalLM`. {r['vllm']}. Machine: {r['machine']}. Each server's "
            "worker runs one thread (`OMP_NUM_THREADS=1`; vLLM binds it to one core and keeps another for its other "
            "processes); a round "
            "measures the systems one after another, so load on the machine hits all of them alike; a row is the "
            "median of the rounds, which differ by several percent (the rounds column)."
            + (f" {r['export_note']}" if r.get("export_note") else "")
        ),
        "",
        "## Greedy parity with `wide generate --backend reference`",
        "",
        (
            f"{p['prompts']} prompts (first WikiText-2 test lines of 24+ words, cut to 24) x {p['new_tokens']} "
            f"tokens, EOS ignored, fp32: **{p['matched']}/{p['prompts']} prompts identical** (`greedy_parity`: "
            f"{str(r['greedy_parity']).lower()}). First differing position per prompt: "
            f"{'none' if r['greedy_parity'] else ['-' if x is None else x for x in p['first_mismatch_position']]}. "
            "Every group forced on equals `wide generate --no-routing`: "
            f"{str(p['all_on_equals_reference_no_routing']).lower()}."
        ),
        "",
        "## What the routed op executed (share of the dense model's multiply-adds, parity prompts)",
        "",
        "Counted per token, its own groups, by the path that ran (see Paths): the native kernels and the",
        "gathered prefill count each token's groups, vLLM's dense kernels every group; the weights read per",
        "step are those of the union of the tokens' groups.",
        "",
        "| requests | O projection | FFN (gate/up/down) | routed projections | all decoder projections (Q/K/V dense) |",
        "|---|---|---|---|---|",
    ]
    for k, sh in r["dense_multiply_add_share"].items():
        lines.append(f"| {k} | {sh['o_proj']:.3f} | {sh['ffn']:.3f} | {sh['routed_projections']:.3f} | "
                     f"{sh['all_decoder_projections']:.3f} |")  # fmt: skip
    lines += [
        "",
        "## Throughput (max(16, concurrency) requests x 64 tokens, `/v1/completions`)",
        "",
        "| system | skips work | concurrency | output tokens/s (median) | rounds | vs dense |",
        "|---|---|---|---|---|---|",
    ]
    dense = {x["concurrency"]: x["output_tokens_per_s"] for x in r["rows"] if x["system"].startswith("dense")}
    for x in r["rows"]:
        ratio = x["output_tokens_per_s"] / dense[x["concurrency"]] if dense.get(x["concurrency"]) else float("nan")
        lines.append(f"| {x['system']} | {'yes' if x['skips_work'] else 'no'} | {x['concurrency']} | "
                     f"{x['output_tokens_per_s']:.1f} | {', '.join(f'{v:.0f}' for v in x.get('rounds_tokens_per_s', []))} | "
                     f"{ratio:.2f}x |")  # fmt: skip
    def kind(name: str) -> str:
        return "dense" if name.startswith("dense") else "all-on" if "every group" in name else "routed"

    tps = {(kind(x["system"]), x["concurrency"]): x["output_tokens_per_s"] for x in r["rows"]}
    cs = sorted({c for _, c in tps})
    vs_on = ", ".join(f"{tps[('routed', c)] / tps[('all-on', c)]:.2f}x" for c in cs)
    vs_dense = ", ".join(f"{tps[('routed', c)] / tps[('dense', c)]:.2f}x" for c in cs)
    slower = [str(c) for c in cs if tps[("routed", c)] < tps[("dense", c)]]
    verdict = (
        "The routed export serves faster than vLLM's dense model at every concurrency measured."
        if not slower
        else f"At concurrency {', '.join(slower)} the routed export serves **slower** than vLLM's dense model: "
        "the routed op runs outside vLLM's compiled graph (an opaque op per layer and module, with its "
        "Python dispatch), Q/K/V and attention stay dense, and with many requests in a step the union of "
        "their groups approaches every group."
    )
    reading = (
        f"Routed vs the same plugin with every group on, at concurrency {', '.join(map(str, cs))}: {vs_on}. "
        f"Routed vs vLLM's own dense model: {vs_dense}. {verdict}"
    )
    lines += ["", reading]
    h = r.get("harness")
    if h:
        lines += [
            "",
            "## A real client: lm-evaluation-harness `local-completions` against the server",
            "",
            (f"The harness's own PIQA task fed the local file, first {h['items']} items, scored through the routed "
            "server's prompt log-probabilities (`/v1/completions` with `echo`), against `wide eval`'s scoring of "
            "the same export and items (fp32):"),
            "",
            "| client | acc | acc_norm |",
            "|---|---|---|",
            f"| lm-eval local-completions -> `wide serve` | {h['harness']['acc']:.4f} | {h['harness']['acc_norm']:.4f} |",
            f"| `wide eval` (reference backend) | {h['wide_eval']['acc']:.4f} | {h['wide_eval']['acc_norm']:.4f} |",
            "",
            (f"Items whose acc differs: {len(h['items_with_different_acc'])} "
            f"({', '.join(map(str, h['items_with_different_acc'])) or 'none'})."),
            "",
            f"Harness command: `{h['harness_command']}`",
        ]
    lines += ["", "## Paths", "", PATHS, ""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("export", type=Path)
    ap.add_argument("--dense-model", type=Path, required=True, help="the base model directory (Hugging Face)")
    ap.add_argument("--prompts", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True, help="output path without extension")
    ap.add_argument("--work", type=Path, default=Path("runs/vllm-cpu-bench"))
    ap.add_argument("--rounds", type=int, default=3, help="round-robin rounds of the throughput measurement")
    ap.add_argument("--data-dir", type=Path, default=REPO.parent / "shared" / "data", help="holds zeroshot/piqa.jsonl")
    ap.add_argument("--harness-limit", type=int, default=500, help="PIQA items scored through the server")
    ap.add_argument("--export-note", help="a sentence on what the export is (stored in OUT.json, shown in OUT.md)")
    ap.add_argument("--render-only", action="store_true", help="rewrite OUT.md and the derived fields of OUT.json from OUT.json (and --export-note)")
    args = ap.parse_args()
    if args.render_only:
        r = json.loads(args.out.with_suffix(".json").read_text())
        add_speedups(r["rows"])
        if args.export_note:
            r["export_note"] = args.export_note
        args.out.with_suffix(".json").write_text(json.dumps(r, indent=2) + "\n")
        args.out.with_suffix(".md").write_text(render_md(r))
        return 0
    python = os.environ.get("WIDE_SERVE_PYTHON", str(REPO / ".venv-serve/bin/python"))
    args.work.mkdir(parents=True, exist_ok=True)
    prompts = prompts_from(args.prompts, max(N_PROMPTS, *CONCURRENCY))

    print("parity: wide generate --backend reference ...", file=sys.stderr)
    ref = wide_generate(args.export, prompts[:N_PROMPTS])
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(args.export))
    ids = [list(tok(p).input_ids) for p in prompts[:N_PROMPTS]]
    print("parity: vLLM offline (routed, all-on) ...", file=sys.stderr)
    off = vllm_offline(python, args.export, ids, args.work)
    routed = off["runs"]["routed"]["tokens"]
    per_prompt = [a == b for a, b in zip(ref["tokens"], routed)]
    first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(ref["tokens"], routed)]
    cfg = json.loads((args.export / "config.json").read_text())
    share = {"16 requests batched": macs_share(off["runs"]["routed"]["stats"], cfg),
             "one request at a time": macs_share(off["runs"]["routed-sequential"]["stats"], cfg)}

    from wide_cli.serve.config import serve_plan
    from wide_cli.serve.server import ServeOptions, server_command

    opts = {"dtype": "float32", "max_model_len": 512, "kv_cache_gib": 2}
    systems = []
    for name, skips, mode in (("wide routed (plugin, forward_cpu)", True, "routed"),
                              ("wide, every group on (plugin, --all-on)", False, "all-on")):  # fmt: skip
        o = ServeOptions(port=_free_port(), **opts)
        systems.append((name, skips, server_command(Path(python), serve_plan(args.export, mode=mode), o), o))
    o = ServeOptions(port=_free_port(), **opts)
    dense_cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.dense_model),
                 "--host", o.host, "--port", str(o.port), "--dtype", o.dtype, "--max-model-len", str(o.max_model_len)]
    systems.append(("dense base model (vLLM's own LlamaForCausalLM)", False, dense_cmd, o))  # fmt: skip
    harness: dict = {}
    rows = throughput(systems, prompts, args.work, args.rounds, then=lambda base: harness.update(
        harness_vs_wide_eval(base, args.export, args.data_dir, args.harness_limit, args.work)))

    result = {
        "command": "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/vllm_cpu.py " + " ".join(sys.argv[1:]),
        "export": str(args.export),
        "dense_model": str(args.dense_model),
        "vllm": "vllm-cpu 0.32.0, torch 2.13.0+cpu, dtype float32, torch.compile (vLLM's CPU default)",
        "machine": machine(),
        "greedy_parity": all(per_prompt),
        "parity": {"prompts": N_PROMPTS, "new_tokens": NEW_TOKENS, "matched": sum(per_prompt),
                   "first_mismatch_position": first_diff, "reference": "wide generate --backend reference (fp32)",
                   "all_on_equals_reference_no_routing": None},
        "routed_op_path": off["path"],
        "dense_multiply_add_share": share,
        "rows": add_speedups(rows),
        "harness": harness,
        "export_note": args.export_note,
    }
    ref_dense = wide_generate(args.export, prompts[:N_PROMPTS], "--no-routing")
    result["parity"]["all_on_equals_reference_no_routing"] = ref_dense["tokens"] == off["runs"]["all-on"]["tokens"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(render_md(result))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
