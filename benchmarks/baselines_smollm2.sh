#!/usr/bin/env bash
# Issue #3 acceptance: dense vs wide vs static-width vs dynamic-depth on SmolLM2-135M with the same
# data and training budget (the demo recipe: builtin:pydoc, steps x 4 x 256 tokens, sparsity 0.5),
# then one `wide eval` table (WikiText-2 test + seven zero-shot tasks, --limit N items per task).
# Long-running (tens of minutes on 2 CPU cores): a benchmark, not a test.
set -euo pipefail
cd "$(dirname "$0")/.."
WIDE=.venv/bin/wide
RECIPE=${RECIPE:-smollm2-135m-cpu}
LIMIT=${LIMIT:-100}
DATA_DIR=${DATA_DIR:-../shared/data}
OUT=${OUT:-docs/results/baselines-smollm2}
[ -d runs/demo/export ] || $WIDE prune smollm2-135m --recipe "$RECIPE" --run-dir runs/demo --out runs/demo/export
$WIDE prune smollm2-135m --recipe "$RECIPE" --method dynamic-depth --run-dir runs/depth --out runs/depth/export
$WIDE prune smollm2-135m --recipe "$RECIPE" --method static-width --run-dir runs/static --out runs/static/export
$WIDE eval smollm2-135m runs/demo/export runs/static/export runs/depth/export \
    --tasks wikitext,arc_easy,arc_challenge,piqa,hellaswag,boolq,winogrande,openbookqa \
    --data-dir "$DATA_DIR" --limit "$LIMIT" --seq-len 256 --out "$OUT"
