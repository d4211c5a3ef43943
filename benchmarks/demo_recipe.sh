#!/usr/bin/env bash
# Why `make demo`'s recipe (recipes/smollm2-135m-cpu.toml) is set as it is
# (docs/results/demo-recipe.md): the demo itself, timed, and the short SmolLM2-135M runs that chose
# its levers and its router initialisation. Minutes to an hour per step on a 2-core CPU.
#
# Usage: benchmarks/demo_recipe.sh STEP [STEP ...]   (steps run in the order given)
#   demo                         `make demo`, timed (from a clean clone, after `make setup native`)
#   levers-paper-loss            60 steps, the paper's loss: group-fraction targets 0.3 / 0.3
#   levers-standin               60 steps, cost target 0.78 of dense FLOPs + trained stand-ins
#   levers-standin-distill       the same + distillation 0.5
#   levers-table                 demo-recipe/levers.json from the three lever runs
#   router-init-kaiming-shuffled 120 steps, 50 % groups, default (kaiming) router init, documents shuffled
#   router-init-kaiming          the same in file order (the recipe's 90/10 split of pydoc)
#   router-init-calibration      the same with router biases initialised from calibration statistics
#   text-data                    the recipe + 480 plain-text documents the dense model writes (--self-generated-text)
#   text-data-eval               WikiText-2 (first 16 pages, 256-token windows): dense, the demo export, text-data's
# The lever runs use the recipe they were measured with (taken from git: attention group 3, FFN
# group 128, router rank 32, group targets 0.5, calibration router init, frozen bf16 backbone);
# the shipped recipe has moved on, by their results among others.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || { sed -n '6,19p' "$0"; exit 2; }
WIDE=${WIDE:-.venv/bin/wide}
PY=${PY:-.venv/bin/python}
DATA_DIR=${DATA_DIR:-../shared/data}
OUT=${OUT:-docs/results/demo-recipe}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=${MKL_NUM_THREADS:-1}
mkdir -p runs/abl runs/init "$OUT"
LEVER_RECIPE=runs/abl/recipe.toml

lever() {  # $1 = run name, rest = flags; WikiText-2's first 32,768 tokens as the eval data
  local name=$1; shift
  git show 6e44242^:recipes/smollm2-135m-cpu.toml > "$LEVER_RECIPE"
  $WIDE prune smollm2-135m --recipe "$LEVER_RECIPE" \
      --data "$DATA_DIR/corpus" --eval-data "$DATA_DIR/wikitext-2-raw/wiki.test.raw" \
      --eval-seq-len 256 --eval-max-tokens 32768 --steps 60 --checkpoint-every 0 \
      --run-dir "runs/abl/$name" --json "$@" > "runs/abl/$name.json"
}

init() {  # $1 = output name, rest = flags; builtin:pydoc, 120 steps at 50 % of the groups
  local name=$1; shift
  $WIDE prune smollm2-135m --steps 120 --seq-len 256 --batch-size 4 --attn-group-size 3 --ffn-group-size 128 \
      --router-rank 32 --sparsity 0.5 --lr 2e-3 --train-dtype bf16 --json --run-dir "runs/init/$name" "$@" \
      > "$OUT/router-init-$name.json"
}

for step in "$@"; do
  case $step in
    demo) time make demo ;;
    levers-paper-loss) lever base60 --sparsity-attention 0.3 --sparsity-ffn 0.3 ;;
    levers-standin) lever standin60 --cost-target 0.78 --standin trained ;;
    levers-standin-distill) lever levers60 --cost-target 0.78 --distill 0.5 --standin trained ;;
    levers-table) $PY benchmarks/demo_recipe_levers.py runs/abl base60 levers60 standin60 > "$OUT/levers.json" ;;
    router-init-kaiming-shuffled) init kaiming-shuffled ;;
    router-init-kaiming) init kaiming --no-shuffle-documents ;;
    router-init-calibration) init calibration --no-shuffle-documents --router-init calibration ;;
    text-data) $WIDE prune smollm2-135m --recipe recipes/smollm2-135m-cpu.toml --self-generated-text 480 \
        --run-dir runs/demo-text --out runs/demo-text/export --threads 1 --json > "$OUT/text-data.json" ;;
    text-data-eval) $WIDE eval smollm2-135m runs/demo/export runs/demo-text/export --tasks wikitext --limit 16 \
        --seq-len 256 --threads 1 --json > "$OUT/text-data-eval.json" ;;
    *) echo "error: unknown step '$step'; the steps are listed in the header of $0" >&2; exit 2 ;;
  esac
done
