"""`wide bench EXPORT`: prefill/decode tokens/s of dense HF transformers, the runtime's dense mode
and the routed backends, with speedups and the ideal bound (see ``wide_cli/bench``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from wide_cli.cli.options import JsonOpt
from wide_cli.errors import ConfigError

QUICK = {"prefill_lengths": (32, 128), "decode_batches": (1, 2), "new_tokens": 16, "decode_prompt_len": 32, "repeats": 1, "warmup": 1}
# Shapes of a named protocol. llama-bench: its default tests pp512 (a 512-token prompt) and tg128
# (128 tokens generated from an empty context, here after a 1-token prompt), 5 repetitions.
PROTOCOLS = {
    "llama-bench": {"prefill_lengths": (512,), "decode_batches": (1,), "new_tokens": 128, "decode_prompt_len": 1,
                    "repeats": 5, "warmup": 1},
}


def _ints(text: str | None, flag: str) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        from wide_cli.errors import ConfigError

        raise ConfigError(f"{flag} {text!r} is not a comma-separated list of integers", f"e.g. {flag} 128,1024") from None
    return vals


def _words(text: str | None) -> tuple[str, ...] | None:
    return None if text is None else tuple(s.strip() for s in text.split(",") if s.strip())


def bench_table(doc: dict):
    """The Rich table of a bench report (``BenchReport.to_dict()``)."""
    from rich.table import Table

    env = doc["environment"]
    t = Table(title=f"wide bench: {doc['export']} (weights {','.join(env.get('weights') or [])}; "
                    f"threads {','.join(map(str, env.get('threads') or []))})")  # fmt: skip
    cols = ("shape", "threads", "system", "path", "tokens/s", "ms", "x HF", "x dense", "skips", "MACs", "ideal",
            "sparsity a/f")
    for col in cols:
        t.add_column(col, justify="left" if col in ("shape", "system", "path", "skips") else "right")
    last = None
    for r in doc["results"]:
        shape = (
            f"prefill {r['prompt_len']}" if r["phase"] == "prefill" else f"decode b{r['batch']} x{r['new_tokens']}"
        )
        sp = r["measured_sparsity"]
        f = lambda v, n=2: "-" if v is None else f"{v:.{n}f}"
        key = (shape, r.get("threads"))
        t.add_row(
            shape if key != last else "",
            str(r.get("threads")) if key != last else "",
            r["system"],
            r.get("path") or "-",
            f(r["tokens_per_s"], 1),
            f(r["ms_per_step"], 1),
            f(r["speedup_vs_hf"]),
            f(r["speedup_vs_dense"]),
            "yes" if r.get("skips_work") else "no",
            f(r.get("executed_mac_fraction")),
            f(r["ideal_speedup"]),
            "-" if not sp else f"{f(sp.get('attention'))}/{f(sp.get('ffn'))}",
        )
        last = key
    return t


def bench_cmd(
    export: Annotated[Path, typer.Argument(help="Export directory (written by `wide export`).")],
    prefill_lengths: Annotated[str | None, typer.Option("--prefill-lengths", help="Prompt lengths, e.g. 128,1024.")] = None,
    decode_batches: Annotated[str | None, typer.Option("--decode-batches", help="Decode batch sizes, e.g. 1,8.")] = None,
    new_tokens: Annotated[int | None, typer.Option("--new-tokens", help="Timed decode steps (default 128).")] = None,
    decode_prompt_len: Annotated[int | None, typer.Option("--decode-prompt-len", help="Prompt tokens before decoding (default 64).")] = None,
    repeats: Annotated[int | None, typer.Option("--repeats", help="Timed rounds; the median is reported (default 3).")] = None,
    warmup: Annotated[int | None, typer.Option("--warmup", help="Untimed rounds first (default 1).")] = None,
    systems: Annotated[str | None, typer.Option("--systems", help="hf,dense,reference,cpu,cpu-torch,dense-torch,llama.cpp (and cupy on a GPU).")] = None,
    dense_backend: Annotated[str | None, typer.Option("--dense-backend", help="Backend of the `dense` system (default cpu).")] = None,
    dtype: Annotated[str | None, typer.Option("--dtype", help="fp32 | bf16 (default fp32; shorthand for --weights).")] = None,
    weights: Annotated[str | None, typer.Option("--weights", help="Runtime weight formats, e.g. fp32,bf16,int8,int4 (default fp32).")] = None,
    threads: Annotated[str | None, typer.Option("--threads", help="CPU threads for every system, e.g. 1,2 (each measured in turn; default 1, reproducible on shared CPUs; 0 = torch's default).")] = None,
    llama_cpp_types: Annotated[str | None, typer.Option("--llama-cpp-types", help="GGUF types of the llama.cpp rows: F16, Q8_0, Q4_0 (default F16,Q8_0,Q4_0; a gemma3-270m export runs its original Q4_K_M GGUF instead).")] = None,
    ppl_tokens: Annotated[int | None, typer.Option("--ppl-tokens", help="Also score this many WikiText-2 test tokens per runtime format (needs --data-dir).")] = None,
    ppl_seq_len: Annotated[int | None, typer.Option("--ppl-seq-len", help="Perplexity window (default 512).")] = None,
    data_dir: Annotated[Path | None, typer.Option("--data-dir", help="Folder holding wikitext-2-raw/ (for --ppl-tokens).")] = None,
    forced_sparsity: Annotated[float | None, typer.Option("--forced-sparsity", help="Replace routers by random masks skipping this fraction (label the results).")] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="Prompt offsets and forced masks (default 0).")] = None,
    quick: Annotated[bool, typer.Option("--quick", help="Small shapes, one round (explicit flags still win).")] = False,
    protocol: Annotated[str | None, typer.Option("--protocol", help="Named shapes: llama-bench (pp512 and tg128, 5 rounds, as llama.cpp's llama-bench; explicit flags still win).")] = None,
    json_out: JsonOpt = False,
    json_file: Annotated[Path | None, typer.Option("--json-out", help="Also write the JSON report to FILE (atomic).")] = None,
):
    """Benchmark EXPORT: prefill and decode tokens/s for dense HF, the runtime's dense mode and
    the routed backends, with speedups, measured sparsity and the ideal bound."""
    from wide_cli.bench.config import BenchConfig
    from wide_cli.bench.run import run_bench
    from wide_cli.cli import render
    from wide_cli.cli.logging_setup import quiet_libraries

    quiet_libraries()
    given = {
        "prefill_lengths": _ints(prefill_lengths, "--prefill-lengths"),
        "decode_batches": _ints(decode_batches, "--decode-batches"),
        "new_tokens": new_tokens,
        "decode_prompt_len": decode_prompt_len,
        "repeats": repeats,
        "warmup": warmup,
        "systems": _words(systems),
        "dense_backend": dense_backend,
        "dtype": dtype,
        "weights": _words(weights),
        "threads": _ints(threads, "--threads"),
        "llama_cpp_types": _words(llama_cpp_types),
        "ppl_tokens": ppl_tokens,
        "ppl_seq_len": ppl_seq_len,
        "data_dir": None if data_dir is None else str(data_dir),
        "forced_sparsity": forced_sparsity,
        "seed": seed,
    }
    if protocol is not None and protocol not in PROTOCOLS:
        raise ConfigError(f"unknown --protocol {protocol!r}", f"choose one of {', '.join(PROTOCOLS)}")
    kw = dict(QUICK) if quick else {}
    kw.update(PROTOCOLS.get(protocol, {}))
    kw.update({k: v for k, v in given.items() if v is not None})
    cfg = BenchConfig(**kw)
    report = run_bench(export, cfg, log=render.log)
    doc = report.to_dict()
    if json_file is not None:
        from wide_cli.atomic import atomic_write_json

        json_file.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(json_file, doc)
    if json_out:
        render.emit_json(doc)
        return
    from rich.console import Console

    # the table needs ~110 columns; a Console clips at its own width (80 when not a terminal)
    Console(stderr=True, width=max(render.err.width, 120)).print(bench_table(doc))
    for name, q in doc.get("quality", {}).items():
        d = q.get("vs_routed_fp32")
        render.log(f"WikiText-2 perplexity {name}: {q['perplexity']:.3f}"
                   + ("" if d is None else f" ({100 * d:+.2f} % vs routed fp32)"))  # fmt: skip
    for note in doc["notes"]:
        render.log(f"note: {note}")
    if json_file is not None:
        render.log(f"wrote {json_file}")
