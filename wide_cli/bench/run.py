"""``run_bench``: every system of a ``BenchConfig`` measured round-robin on one export (the
protocol is in the package docstring)."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from wide_cli.bench.config import BenchConfig
from wide_cli.bench.dense_work import decode_cost, dense_macs, flops_cost, weight_bytes
from wide_cli.bench.quality import runtime_perplexity, wikitext_ids
from wide_cli.bench.report import BenchEntry, BenchReport, fill_speedups
from wide_cli.bench.systems import HFSystem, LlamaCppSystem, RuntimeSystem, llama_class, original_gguf
from wide_cli.bench.workload import prompt_batch, text_token_stream
from wide_cli.errors import ConfigError
from wide_cli.runtime.cpu_proj import prefill_path
from wide_cli.runtime.gguf_writer import BYTES_PER_WEIGHT as GGUF_BYTES_PER_WEIGHT
from wide_cli.runtime.quant import BYTES_PER_WEIGHT, COMPUTE_DTYPE, QUANTIZED_FORMATS


def _label(kind: str, fmt: str, formats) -> str:
    return kind if len(formats) == 1 and kind != "llama.cpp" else f"{kind} {fmt}"


def run_bench(path, cfg: BenchConfig, *, log=None) -> BenchReport:
    """Measure every system of ``cfg`` on the export at ``path``.

    Raises:
        CheckpointError: an unreadable export. ConfigError: bad settings, an unavailable backend,
            llama.cpp without llama-cpp-python, perplexity without the data.
    """
    import os
    import platform
    import tempfile

    from wide_cli.models.loader import load_tokenizer
    from wide_cli.runtime.checkpoint import weights_from_export
    from wide_cli.runtime.cpu_native import cpu_flags, cpu_model
    from wide_cli.runtime.engine import Runtime

    log = log or (lambda msg: None)
    path = Path(path)
    original = None
    if "llama.cpp" in cfg.systems:  # refused here, before anything is loaded or written
        llama_class()
        # a model the GGUF writer has no graph for (Gemma 3) runs its original GGUF
        original = original_gguf(path)
    weights = weights_from_export(path)
    tokenizer = load_tokenizer(path)
    notes = []
    if cfg.forced_sparsity is not None:
        notes.append(
            f"routers replaced by random per-token masks skipping {cfg.forced_sparsity:.0%} of groups (--forced-sparsity)"
        )
    if cfg.ppl_tokens and cfg.data_dir is None:
        raise ConfigError("--ppl-tokens needs the WikiText-2 data", "pass --data-dir (the folder holding wikitext-2-raw/)")
    stored_quantized = weights.extra.get("weight_format") in QUANTIZED_FORMATS

    runtimes: dict[tuple[str, str, str], Runtime] = {}

    def runtime_for(backend: str, fmt: str, variant: str = "") -> Runtime:
        # the *-torch systems get their own runtime (shared by dense-torch and cpu-torch, as dense and
        # cpu share theirs): the statistics it counts are those rows' own
        if (backend, fmt, variant) not in runtimes:
            runtimes[(backend, fmt, variant)] = Runtime(weights, backend, tokenizer=tokenizer, weight_format=fmt)
        return runtimes[(backend, fmt, variant)]

    # (label, kind, format) -> system; llama.cpp systems are built per thread count
    systems: dict[tuple[str, str, str], object] = {}
    llama_types = []
    for s in cfg.systems:
        for fmt in cfg.weights:
            label = _label(s, fmt, cfg.weights)
            if s == "hf":
                if fmt in QUANTIZED_FORMATS or stored_quantized:
                    continue  # transformers has no int8 / int4 weight-only CPU path for this export
                log(f"loading {label}")
                systems[(label, s, fmt)] = HFSystem(path, COMPUTE_DTYPE[fmt])
            elif s in ("dense", "dense-torch"):
                be = cfg.dense_backend if s == "dense" else "cpu"
                systems[(label, s, fmt)] = RuntimeSystem(runtime_for(be, fmt, "torch" if s == "dense-torch" else ""), False, None, cfg.seed,
                                                         native=s == "dense")  # fmt: skip
            elif s == "cpu-torch":
                systems[(label, s, fmt)] = RuntimeSystem(runtime_for("cpu", fmt, "torch"), True, cfg.forced_sparsity, cfg.seed,
                                                         native=False)  # fmt: skip
            elif s != "llama.cpp":
                if fmt in QUANTIZED_FORMATS and s != "cpu":
                    continue  # int8 / int4 kernels exist in the cpu backend only
                systems[(label, s, fmt)] = RuntimeSystem(runtime_for(s, fmt), True, cfg.forced_sparsity, cfg.seed)
        if s == "llama.cpp":
            llama_types = [original.gguf_type] if original is not None else list(cfg.llama_cpp_types)

    quality = {}
    if cfg.ppl_tokens:
        ids = wikitext_ids(tokenizer, Path(cfg.data_dir), cfg.ppl_tokens)
        torch.set_num_threads(min(cfg.threads) or torch.get_num_threads())
        for fmt in cfg.weights:
            rt = runtime_for("cpu", fmt)
            rt.routing, rt.forced = True, {}  # the routed model is what each format ships
            # prefill: one forward per window (bf16 / int8 projections on the native GEMM); decode:
            # token by token, the path generation runs (the native step, whose int8 kernels also
            # round activations, see kernels/cpu_decode.c)
            for mode in ("prefill", "decode"):
                t = time.perf_counter()
                res = runtime_perplexity(rt, ids, cfg.ppl_seq_len, mode)
                res["seconds"] = time.perf_counter() - t
                res["mode"] = mode
                if mode == "prefill":
                    res["path"] = prefill_path(rt.dtype, routed=True)
                else:
                    res["path"] = "torch" if rt._native in (None, False) else "native"
                key = f"routed {fmt}" + ("" if mode == "prefill" else " decode")
                quality[key] = res
                log(f"WikiText-2 perplexity {key} ({res['path']}): {res['perplexity']:.3f}")
        for k, v in quality.items():
            base = quality.get("routed fp32" + (" decode" if k.endswith(" decode") else ""))
            if base:
                v["vs_routed_fp32"] = v["perplexity"] / base["perplexity"] - 1

    gguf_dir = None
    if llama_types and original is not None:
        ggufs = {original.gguf_type: original.path}
        notes.append(f"llama.cpp row: the model's original GGUF {original.path.name} ({original.gguf_type}, every "
                     "layer of the unpruned model, not the export's weights: wide writes GGUF files of plain Llama "
                     "models only), batch-1 shapes only")  # fmt: skip
    elif llama_types:
        from wide_cli.runtime.gguf_writer import write_gguf

        gguf_dir = tempfile.TemporaryDirectory(prefix="wide-bench-gguf-")
        ggufs = {}
        for t in llama_types:
            log(f"writing GGUF {t}")
            ggufs[t] = write_gguf(path, Path(gguf_dir.name) / f"model-{t}.gguf", t)
        notes.append("llama.cpp rows: the export's dense weights written as GGUF by `gguf` (no routers), "
                     "batch-1 shapes only")  # fmt: skip
    n_ctx = max((*cfg.prefill_lengths, cfg.decode_prompt_len + cfg.new_tokens)) + 8

    stream = text_token_stream(tokenizer, max((*cfg.prefill_lengths, cfg.decode_prompt_len)) * 4)
    shapes = [("prefill", 1, L) for L in cfg.prefill_lengths] + [
        ("decode", B, cfg.decode_prompt_len) for B in cfg.decode_batches
    ]
    entries: list[BenchEntry] = []
    try:
        for threads in cfg.threads:
            if threads > 0:
                torch.set_num_threads(threads)
            tsys = dict(systems)
            for t in llama_types:
                log(f"loading llama.cpp {t} ({threads} threads)")
                tsys[(f"llama.cpp {t}", "llama.cpp", t)] = LlamaCppSystem(ggufs[t], threads, n_ctx)
            for phase, B, L in shapes:
                ids = prompt_batch(stream, B, L, cfg.seed + B * 7919 + L)
                active = {k: v for k, v in tsys.items() if B == 1 or k[1] != "llama.cpp"}
                times: dict = {k: [] for k in active}
                sparsity: dict = {}
                executed: dict = {}
                bytes_read: dict = {}
                for r in range(cfg.warmup + cfg.repeats):
                    for key, sys_ in active.items():
                        if isinstance(sys_, RuntimeSystem) and r == cfg.warmup:
                            sys_.rt.stats.reset()  # measured sparsity of the timed rounds only
                        t = sys_.prefill(ids) if phase == "prefill" else sys_.decode(ids, cfg.new_tokens)
                        if r >= cfg.warmup:
                            times[key].append(t)
                        if isinstance(sys_, RuntimeSystem):
                            executed[key] = sys_.executed
                            bytes_read[key] = sys_.weight_bytes_per_step if phase == "decode" else None
                            if r == cfg.warmup + cfg.repeats - 1:
                                sparsity[key] = sys_.rt.stats.summary() if sys_.routed else None
                    log(f"{threads} threads, {phase} batch {B} len {L}: round {r + 1}/{cfg.warmup + cfg.repeats}")
                dense = dense_macs(weights, phase, B, L, cfg.new_tokens)
                for key, system in active.items():
                    label, kind, fmt = key
                    sp = sparsity.get(key)
                    sp_short = None if sp is None else {k: sp[k] for k in ("attention", "ffn", "total")}
                    frac, skips = None, False
                    if key in executed:
                        work, routers = executed[key]
                        frac = (work + routers) / dense
                        skips = work < dense * (1 - 1e-9)
                    ideal = None
                    itemsizes = {**BYTES_PER_WEIGHT, **GGUF_BYTES_PER_WEIGHT}
                    if original is not None:
                        itemsizes[original.gguf_type] = original.bytes_per_weight
                    itemsize = itemsizes[fmt]
                    dcost = decode_cost(weights, itemsize)
                    if skips and sp_short:
                        ideal = (dcost.speedup_bound(sp_short) if phase == "decode"
                                 else flops_cost(weights, (L + 1) / 2).speedup_bound(sp_short))  # fmt: skip
                    wb = sum(weight_bytes(weights, itemsize).values())
                    wb_step = wb / (dcost.speedup_bound(sp_short) if sp_short else 1.0)
                    if original is not None and kind == "llama.cpp":
                        wb_step = float(original.matrix_bytes)  # its own file's matrices, every layer
                    counted = bytes_read.get(key)
                    if phase == "decode" and counted:
                        # what the backend counted it read: for a batch the union of the rows'
                        # groups; the bound is the dense system's counted bytes over these
                        wb_step = counted
                        dense_counted = next((v for (_, k, f), v in bytes_read.items() if k == "dense" and f == fmt), None)
                        if skips and dense_counted:
                            ideal = dense_counted / counted
                    entries.append(BenchEntry(
                        system=label, kind=kind, weights=fmt, threads=threads, phase=phase, batch=B, prompt_len=L,
                        new_tokens=cfg.new_tokens if phase == "decode" else 0, seconds=times[key],
                        tokens=B * L if phase == "prefill" else B * cfg.new_tokens, measured_sparsity=sp_short,
                        skips_work=skips, executed_mac_fraction=frac, ideal_speedup=ideal,
                        path=getattr(system, "path", None),
                        weight_bytes_per_step=wb_step,
                    ))  # fmt: skip
            for sys_ in tsys.values():
                if isinstance(sys_, LlamaCppSystem):
                    sys_.close()
    finally:
        if gguf_dir is not None:
            gguf_dir.cleanup()
    fill_speedups(entries)
    env = {
        "torch": torch.__version__,
        "threads": list(cfg.threads),
        "weights": list(cfg.weights),
        "dtype": "/".join(sorted({str(COMPUTE_DTYPE[w]).removeprefix("torch.") for w in cfg.weights})),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_model": cpu_model(),
        "simd": [f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in cpu_flags().split()],
        "cpu_count": os.cpu_count(),
        "load_average_at_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass
    if llama_types:
        import llama_cpp

        env["llama_cpp_python"] = llama_cpp.__version__
    wb = {fmt: weight_bytes(weights, BYTES_PER_WEIGHT[fmt]) for fmt in cfg.weights}
    return BenchReport(str(path), cfg, entries, env, wb, notes, quality)
