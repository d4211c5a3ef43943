#!/usr/bin/env bash
# Issue #11, static depth (ShortGPT layer removal) on SmolLM2-135M at two cost points, without
# and with LoRA healing (LORA_STEPS optimizer steps x 4 sequences x 256 tokens of
# ../shared/data/corpus, LoRA r 16 / alpha 32 on q,k,v,o,gate,up,down, lr 2e-4), then one
# `wide compare` (quality + measured speed in one process) into docs/results/pareto-smollm2/.
# One job at a time, one thread. Hours on a 2-core CPU: a benchmark, not a test.
set -euo pipefail
cd "$(dirname "$0")/.."
WIDE=.venv/bin/wide
LORA_STEPS=${LORA_STEPS:-200}
DATA_DIR=${DATA_DIR:-../shared/data}
COSTS=${COSTS:-"0.79 0.69"}   # fraction of dense FLOPs: 8 and 12 of 30 layers removed on SmolLM2-135M
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1

depth() {  # $1 = run name, $2 = cost target, rest = extra flags
  local name=$1 cost=$2; shift 2
  [ -f "runs/sd-$name/export/manifest.json" ] && return 0
  $WIDE prune smollm2-135m --recipe smollm2-135m-cpu --method static-depth --cost-target "$cost" \
      --data "$DATA_DIR/corpus" --shuffle-documents --checkpoint-every 50 --eval-max-tokens 16384 \
      --run-dir "runs/sd-$name" --out "runs/sd-$name/export" --json "$@" > "runs/sd-$name.json"
}
for c in $COSTS; do depth "$c" "$c"; done
for c in $COSTS; do depth "$c-lora" "$c" --lora --lora-steps "$LORA_STEPS"; done

# Quality + measured speed in one process. TASKS=wikitext by default (what fits a 2-core session);
# TASKS=wikitext,arc_easy,arc_challenge,piqa,hellaswag,boolq,winogrande,openbookqa LIMIT=500 gives
# the full acceptance table (hours: the seven tasks at 500 items are ~20 min per model here).
TASKS=${TASKS:-wikitext}
LIMIT_ARGS=()
[ -n "${LIMIT:-}" ] && LIMIT_ARGS=(--limit "$LIMIT")
OUT=${OUT:-docs/results/pareto-smollm2/static-depth}
TARGETS=(smollm2-135m)
for c in $COSTS; do TARGETS+=("runs/sd-$c/export"); done
for c in $COSTS; do [ -f "runs/sd-$c-lora/export/manifest.json" ] && TARGETS+=("runs/sd-$c-lora/export"); done
$WIDE compare "${TARGETS[@]}" --tasks "$TASKS" "${LIMIT_ARGS[@]}" --data-dir "$DATA_DIR" --seq-len 256 \
    --dtype bf16 --cache-dir runs/eval-cache --repeats "${REPEATS:-3}" --out "$OUT" --json > "runs/sd-compare.json"
