#!/usr/bin/env bash
# Quality at equal sparsity (docs/results/quality-at-equal-sparsity.md): SmolLM2-135M at the
# paper's 50 % of groups skipped, one training budget for every trained method: STEPS optimizer
# steps x 4 sequences x 256 tokens from ../shared/data/corpus (bf16 training on CPU).
#   dense          the reference row
#   wide           stage 1 (routers), STEPS steps
#   static-width   calibration only (no training)
#   dynamic-depth  stage 1 with one group per module, STEPS steps
#   wide+lora      stage 1 for STEPS - LORA_STEPS steps, then stage 2 (LoRA + routers) for LORA_STEPS
# then one `wide eval` table: WikiText-2 test (all 62 pages, windows of SEQ_LEN tokens) and the seven
# zero-shot tasks (first LIMIT items each). Each model is evaluated in its own process (two at a
# time) into a shared --cache-dir; the final command assembles the report from it.
# The recipe is the one these numbers were measured with (routers only, group targets 0.5), taken
# from git: the shipped recipe has moved on. Hours on 2 CPU cores: a benchmark, not a test.
set -euo pipefail
cd "$(dirname "$0")/.."
WIDE=.venv/bin/wide
STEPS=${STEPS:-200}
LORA_STEPS=${LORA_STEPS:-60}
LIMIT=${LIMIT:-500}
SEQ_LEN=${SEQ_LEN:-256}   # the training sequence length (2048: ~1.7x the CPU time per token)
DATA_DIR=${DATA_DIR:-../shared/data}
OUT=${OUT:-docs/results/quality-at-equal-sparsity}
CACHE=${CACHE:-runs/eval-cache}
export OMP_NUM_THREADS=1  # two jobs share the two cores
mkdir -p runs
RECIPE=runs/quality-at-equal-sparsity.toml
git show 4f1875e:recipes/smollm2-135m-cpu.toml > "$RECIPE"

train() {  # $1 = run name, rest = extra flags
  local name=$1; shift
  [ -f "runs/cmp-$name/export/manifest.json" ] && return 0
  $WIDE prune smollm2-135m --recipe "$RECIPE" --data "$DATA_DIR/corpus" --shuffle-documents \
      --checkpoint-every 50 --eval-max-tokens 16384 --drop-layers 0 --run-dir "runs/cmp-$name" --out "runs/cmp-$name/export" \
      --json "$@" > "runs/cmp-$name.json"
}
train wide --steps "$STEPS" & a=$!
train dynamic-depth --method dynamic-depth --steps "$STEPS" & b=$!
wait $a; wait $b
train static-width --method static-width & a=$!
train wide-lora --steps $((STEPS - LORA_STEPS)) --lora --lora-steps "$LORA_STEPS" & b=$!
wait $a; wait $b

TARGETS=(smollm2-135m runs/cmp-wide/export runs/cmp-static-width/export runs/cmp-dynamic-depth/export
         runs/cmp-wide-lora/export)
EVAL=(--tasks wikitext,arc_easy,arc_challenge,piqa,hellaswag,boolq,winogrande,openbookqa
      --data-dir "$DATA_DIR" --limit "$LIMIT" --seq-len "$SEQ_LEN" --dtype bf16 --cache-dir "$CACHE")
printf '%s\n' "${TARGETS[@]}" | xargs -P 2 -I{} $WIDE eval {} "${EVAL[@]}" > /dev/null
$WIDE eval "${TARGETS[@]}" "${EVAL[@]}" --out "$OUT"
