#!/usr/bin/env bash
# CPU speed against llama.cpp (docs/results/bench-cpu.{json,md}): `wide bench` on the demo export
# (every system, both thread counts, perplexity per format and path) and on a cost-0.5 export
# (the runtime only: the routed/dense ratio at half the dense FLOPs).
# Usage: benchmarks/bench_cpu.sh DEMO_EXPORT COST05_EXPORT [OUT_DIR]   (needs `make llama-setup`)
# Run it on a quiet machine: the 2-thread rows measure whatever else holds a core.
set -euo pipefail
demo=$1
c05=$2
out=${3:-docs/results}
wide=${WIDE:-.venv/bin/wide}
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
$wide bench "$demo" --systems hf,dense,cpu,dense-torch,cpu-torch,llama.cpp --weights fp32,bf16,int8 \
  --prefill-lengths 1024 --decode-batches 1 --new-tokens 128 --decode-prompt-len 64 --threads 1,2 \
  --ppl-tokens 4096 --ppl-seq-len 512 --data-dir ../shared/data --json-out "$out/bench-cpu.json"
$wide bench "$c05" --systems dense,cpu,dense-torch,cpu-torch,llama.cpp --weights fp32,bf16,int8 \
  --prefill-lengths 1024 --decode-batches 1 --new-tokens 128 --decode-prompt-len 64 --threads 1,2 \
  --json-out "$out/bench-cpu-cost05.json"
