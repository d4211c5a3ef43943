"""Offline greedy generation of an export through vLLM's ``LLM`` (runs in the serving venv).

``python -m wide_cli.serve.offline REQUEST.json OUT.json`` with a request

    {"export": DIR, "prompts": [[token ids], ...], "max_tokens": 16, "dtype": "float32",
     "max_model_len": 512, "modes": ["routed", "all-on"], "enforce_eager": false, "kv_cache_gib": 2}

starts one engine (in this process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the model and its
counters are reachable), generates greedily (``temperature 0``, ``ignore_eos``) for each mode in
turn (``MODES``) -- ``all-on`` flips the routers' ``force_on`` buffers, no second engine -- and
writes

    {"path": "forward_cpu", "runs": {mode: {"tokens": [[...]], "seconds": s,
     "stats": {"attention": {"executed", "dense"}, "ffn": {...}}}}}

Prefix caching is off: a prompt's KV cache from one mode must not be reused by the next.
Used by the serving tests and ``benchmarks/vllm_cpu.py``; ``wide serve`` is the server.
"""

from __future__ import annotations

import json
import os
import sys
import time

#: ``routed`` and ``all-on`` submit every prompt at once (vLLM batches them); ``routed-sequential``
#: one prompt at a time (what a single client sees; the routed ops then skip the most).
MODES = ("routed", "all-on", "routed-sequential")


def run(req: dict) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # A fixed KV-cache size: vLLM's default reserves 92 % of the machine's memory and refuses to
    # start when other processes hold part of it.
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(req.get("kv_cache_gib", 2)))
    from vllm import LLM, SamplingParams

    from wide_cli.serve import vllm_cpu_ops
    from wide_cli.serve import vllm_models as vm
    from wide_cli.serve.config import serve_plan

    plan = serve_plan(req["export"])
    llm = LLM(
        model=str(plan.path),
        hf_overrides=plan.overrides or None,
        trust_remote_code=plan.trust_remote_code,
        dtype=req.get("dtype", "float32"),
        max_model_len=int(req.get("max_model_len", 512)),
        enable_prefix_caching=False,
        enforce_eager=bool(req.get("enforce_eager", False)),
        seed=0,
    )
    sp = SamplingParams(temperature=0.0, max_tokens=int(req["max_tokens"]), ignore_eos=True)
    prompts = [{"prompt_token_ids": list(map(int, p))} for p in req["prompts"]]
    out: dict = {"path": vm.active_path(), "runs": {}}
    for mode in req.get("modes", ["routed"]):
        if mode not in MODES:
            raise SystemExit(f"unknown mode {mode!r}; choose from {MODES}")
        llm.apply_model(lambda m, on=(mode == "all-on"): vm.set_all_on(m, on))
        vllm_cpu_ops.reset_stats()
        t0 = time.perf_counter()
        if mode == "routed-sequential":
            res = [r for p in prompts for r in llm.generate([p], sp, use_tqdm=False)]
        else:
            res = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        stats = vllm_cpu_ops.stats()
        out["runs"][mode] = {"tokens": [list(r.outputs[0].token_ids) for r in res], "seconds": dt, "stats": stats}
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m wide_cli.serve.offline REQUEST.json OUT.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        req = json.load(f)
    res = run(req)
    from wide_cli.atomic import atomic_write_bytes

    atomic_write_bytes(argv[1], json.dumps(res).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
