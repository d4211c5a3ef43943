"""WikiText-2 perplexity of a model in the runtime per weight format: fp32, int8 (Q8_0-like), int4
(Q4_0 block, searched scale), int4 with Q4_0's own scale rule (``quantize_int4(divisors=(-8,))``)
and int4 with an importance matrix (scales chosen by the error weighted with each input channel's
mean squared activation, ``calibrate/importance.py``; collected on the training corpus, never on
the evaluation text), each through the prefill path (one forward per window) and the decode path
(token by token; the native step on the cpu backend). Dense model, routing off: the quantization
cost alone.

Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/weight_format_perplexity.py [--model smollm2-135m]
     [--data-dir ../shared/data] [--calibration ../shared/data/corpus] [--calibration-tokens 32768]
     [--tokens 2048] [--seq-len 512] [--out docs/results/weight-format-perplexity.json]
(about 20 minutes for SmolLM2-135M at 2,048 tokens on one core.)
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from wide_cli import quant
from wide_cli.bench.quality import runtime_perplexity, wikitext_ids
from wide_cli.runtime.engine import Runtime

VARIANTS = (("fp32", "fp32", None), ("int8", "int8", None), ("int4", "int4", None), ("int4 q4_0 rule", "int4", (-8.0,)),
            ("int4 importance", "int4", "importance"))


def corpus_importance(model, tokenizer, source: str, tokens: int, seq_len: int) -> dict:
    """The importance matrix of ``model`` on the first ``tokens`` tokens of ``source`` packed in
    rows of ``seq_len`` (documents shuffled with seed 0, as ``wide calibrate`` packs them)."""
    from wide_cli.calibrate.importance import collect_importance
    from wide_cli.data.packing import pack_documents
    from wide_cli.data.sources import read_documents

    packed = pack_documents(read_documents(source), tokenizer, seq_len, heldout_fraction=0.0, max_tokens=tokens, seed=0)
    return collect_importance(model, packed.train, batch_size=4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--data-dir", default="../shared/data")
    ap.add_argument("--calibration", default="../shared/data/corpus", help="training text for the importance matrix")
    ap.add_argument("--calibration-tokens", type=int, default=32768)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--out", default="docs/results/weight-format-perplexity.json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    searched = quant.quantize_int4
    rows = []
    calibration = None
    try:
        for label, fmt, divisors in VARIANTS:
            if divisors == "importance":
                from wide_cli.models.loader import load_model

                quant.quantize_int4 = searched  # the runtime re-quantizes with the plain rule: a no-op on these values
                lm = load_model(a.model, dtype=torch.float32)
                t0 = time.time()
                imp = corpus_importance(lm.model, lm.tokenizer, a.calibration, a.calibration_tokens, a.seq_len)
                calibration = {"data": a.calibration, "tokens": a.calibration_tokens, "seq_len": a.seq_len,
                               "seconds": time.time() - t0}
                print(f"importance collected in {calibration['seconds']:.0f} s", flush=True)
                rt = Runtime.from_model(lm.model, lm.tokenizer, weight_format=fmt, routing=False, importance=imp)
            else:
                # the runtime quantizes through wide_cli.quant.quantize_int4; Q4_0's rule is its single divisor
                quant.quantize_int4 = searched if divisors is None else (lambda w, d=divisors: searched(w, d))
                rt = Runtime.from_target(a.model, weight_format=fmt)
            ids = wikitext_ids(rt.tokenizer, Path(a.data_dir), a.tokens)
            for mode in ("prefill", "decode"):
                t0 = time.time()
                r = runtime_perplexity(rt, ids, a.seq_len, mode)
                rows.append({"weights": label, "path": mode, "perplexity": r["perplexity"],
                             "tokens_scored": r["tokens_scored"], "seconds": time.time() - t0})
                print(f"{label:16s} {mode:8s} {r['perplexity']:.3f}", flush=True)
    finally:
        quant.quantize_int4 = searched
    fp32 = {r["path"]: r["perplexity"] for r in rows if r["weights"] == "fp32"}
    for r in rows:
        r["vs_fp32"] = r["perplexity"] / fp32[r["path"]] - 1
    out = {"what": "WikiText-2 test perplexity per runtime weight format, dense model (routing off)",
           "model": a.model, "tokens": a.tokens, "seq_len": a.seq_len, "threads": 1, "importance": calibration,
           "processor": platform.processor() or platform.machine(), "results": rows}
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
