#!/usr/bin/env bash
# Issue #11 at the issue's reference budget (200 steps x 4 x 256 corpus tokens per trained method)
# on SmolLM2-135M at ~0.79 of dense FLOPs (~1.3x measured decode): wide with the chosen levers at
# two LoRA learning rates, the wide+depth hybrid, and static depth healed with LoRA at the same
# budget and learning rate. Then the run's quality protocol (WikiText-2 test, first 32 pages,
# 256-token windows, the seven tasks at --limit 32, bf16) and `wide compare`'s speed protocol.
# Results: docs/results/pareto-smollm2/budget200.md. Hours on a 2-core CPU: a benchmark, not a test.
# QUEUE=a|b (session 8), c|d (session 9) and e|f (session 10, STEPS=400) run the training jobs (two
# queues side by side, one thread each); QUEUE=eval (200 steps) and QUEUE=eval400 (400 steps)
# evaluate and measure speed. Session 11: QUEUE=g|h train the ~1.2x pair at 400 steps, QUEUE=u
# builds and evaluates the untrained baselines (static depth without healing, static width) at both
# cost points, QUEUE=eval12 evaluates the pair and measures speed of everything session 11 built.
# Session 12: QUEUE=i|j train dynamic depth at both cost points (400 steps), QUEUE=eval13 evaluates
# them and measures their speed. Session 13: QUEUE=k trains and evaluates dynamic depth at 0.72,
# QUEUE=uq evaluates the untrained rows, QUEUE=eval14 times dense and every export on disk in one
# quiet run and writes the table. Session 14: QUEUE=l|m train the ~1.35x pair again with seed 1;
# QUEUE=eval15 scores them on WikiText-2 and times them against dense in one run, QUEUE=q15 runs the
# full quality protocol on them.
set -euo pipefail
cd "$(dirname "$0")/.."
WIDE=${WIDE:-.venv/bin/wide}
PY=${PY:-.venv/bin/python}
STEPS=${STEPS:-200}
DATA_DIR=${DATA_DIR:-../shared/data}
QUEUE=${QUEUE:-a}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=${MKL_NUM_THREADS:-1}
mkdir -p runs
# The demo recipe's settings (attention group 3, FFN group 128, router rank 32, 160 self-generated
# chat transcripts packed with the corpus, frozen bf16 backbone), on the shared corpus. The recipe
# drops 4 layers since session 10: `--drop-layers 0` keeps these runs as they were (a later
# `--drop-layers N` on the same command line wins).
COMMON=(--recipe smollm2-135m-cpu --data "$DATA_DIR/corpus" --shuffle-documents --checkpoint-every 50
        --eval-max-tokens 16384 --self-generated 160 --drop-layers 0 --json)
LEVERS=(--standin trained --distill 0.5 --lora-joint --steps "$STEPS")  # + --lora-lr below (recipe: 1e-3)

prune() {  # $1 = run name, rest = flags
  local name=$1; shift
  [ -f "runs/$name/export/manifest.json" ] && return 0
  $WIDE prune smollm2-135m "${COMMON[@]}" --run-dir "runs/$name" --out "runs/$name/export" "$@" \
      > "runs/$name.json"
}

quality() {  # $1 = --limit (tasks; WikiText-2 pages too), $2 = cache dir, rest = targets, one process each
  local limit=$1 cache=$2; shift 2
  for t in "$@"; do
    $PY - "$t" "$DATA_DIR" "$limit" "$cache" <<'EOF'
import os
import sys
from pathlib import Path
from wide_cli.eval.run import evaluate_targets
tasks = os.environ.get("QUALITY_TASKS", "wikitext,arc_easy,arc_challenge,piqa,hellaswag,boolq,winogrande,openbookqa").split(",")
evaluate_targets([sys.argv[1]], tasks=tasks, data_dir=Path(sys.argv[2]), limit=int(sys.argv[3]), seq_len=256,
                 batch_size=4, dtype="bf16", device="cpu", cache_dir=Path(sys.argv[4]), wikitext_protocols=("token",))
EOF
  done
}

table400c() {  # session 12's rows (a row is left out until its quality is in the cache)
  local runs=(dd87s400 dd79s400 sd87s400 h3c87s400 sd79)
  for r in sd87 sw29 sw18; do
    if grep -qs "\"runs/$r/export\"" runs/eval-cache-500/*.json; then runs+=("$r"); fi
  done
  $PY benchmarks/budget400_table.py runs/eval-cache-500 runs/budget400c-speed.json \
      docs/results/pareto-smollm2/budget400c.json "${runs[@]}"
}

table400d() {  # session 13's rows: every model on disk whose quality is in the cache
  local runs=()  # dense: its quality is in budget400.json (session 10), its speed is the 1.00 baseline
  for r in dd72s400 dd79s400 dd87s400 h3c87s400 sd87s400 sd87 sd79 sw18 sw29; do
    if grep -qs "\"runs/$r/export\"" runs/eval-cache-500/*.json; then runs+=("$r"); fi
  done
  $PY benchmarks/budget400_table.py runs/eval-cache-500 runs/budget400d-speed.json \
      docs/results/pareto-smollm2/budget400d.json "${runs[@]}"
}

case $QUEUE in
  a)
    prune w200 --method wide --cost-target 0.79 "${LEVERS[@]}" --lora-lr 2e-4
    prune sd200 --method static-depth --cost-target 0.79 --lora --lora-steps "$STEPS" --lora-lr 2e-4 --distill 0.5
    ;;
  b)
    prune w200lr --method wide --cost-target 0.79 "${LEVERS[@]}" --lora-lr 1e-3
    prune h4-200lr --method wide --drop-layers 4 --cost-target 0.79 "${LEVERS[@]}" --lora-lr 1e-3
    ;;
  c)  # session 9: static depth at the LoRA lr wide uses (after the teacher fix), and at ~0.71
    prune sd200lrfix --method static-depth --cost-target 0.79 --lora --lora-steps "$STEPS" --lora-lr 1e-3 --distill 0.5
    prune sd71lr --method static-depth --cost-target 0.71 --lora --lora-steps "$STEPS" --lora-lr 1e-3 --distill 0.5
    prune sd68lr --method static-depth --cost-target 0.68 --lora --lora-steps "$STEPS" --lora-lr 1e-3 --distill 0.5
    ;;
  d)  # session 9: the hybrid at two more cost points (0.83: ~static depth's measured speed; 0.71)
    prune h4c83lr --method wide --drop-layers 4 --cost-target 0.83 "${LEVERS[@]}" --lora-lr 1e-3
    prune h4c71lr --method wide --drop-layers 4 --cost-target 0.71 "${LEVERS[@]}" --lora-lr 1e-3
    ;;
  e)  # session 10: the issue's full budget (400 steps) for the ~1.3x pair: the hybrid at 0.83
    prune h4c83s400 --method wide --drop-layers 4 --cost-target 0.83 "${LEVERS[@]}" --lora-lr 1e-3
    ;;
  f)  # session 10: healed static depth (8 layers) at the same 400-step budget
    prune sd79s400 --method static-depth --cost-target 0.79 --lora --lora-steps "$STEPS" --lora-lr 1e-3 --distill 0.5
    ;;
  g)  # session 11: the hybrid at ~1.2x (3 layers + width to 0.87), 400 steps
    prune h3c87s400 --method wide --drop-layers 3 --cost-target 0.87 "${LEVERS[@]}" --lora-lr 1e-3
    ;;
  h)  # session 11: healed static depth at ~1.2x (cost 0.87: 5 layers), 400 steps
    prune sd87s400 --method static-depth --cost-target 0.87 --lora --lora-steps "$STEPS" --lora-lr 1e-3 --distill 0.5
    ;;
  i)  # session 12: dynamic depth (a router per layer skips the whole attention / FFN module per
      # token) with wide's levers at ~1.2x, 400 steps
    prune dd87s400 --method dynamic-depth --cost-target 0.87 "${LEVERS[@]}" --lora-lr 1e-3
    ;;
  j)  # session 12: dynamic depth at ~1.35x, 400 steps
    prune dd79s400 --method dynamic-depth --cost-target 0.79 "${LEVERS[@]}" --lora-lr 1e-3
    ;;
  k)  # session 13: dynamic depth asked for 0.79 measured 1.24x, short of the ~1.35x point; 0.72
      # aims at it (its decode gain has tracked 1/FLOPs), 400 steps, then its quality
    prune dd72s400 --method dynamic-depth --cost-target 0.72 "${LEVERS[@]}" --lora-lr 1e-3
    quality 500 runs/eval-cache-500 runs/dd72s400/export
    ;;
  l)  # session 14: the ~1.35x hybrid again with seed 1 (session 10's seed-0 export is gone, so it
      # could not be re-timed; a second seed also shows how far one run's perplexity moves)
    prune h4c83s400r1 --method wide --drop-layers 4 --cost-target 0.83 "${LEVERS[@]}" --lora-lr 1e-3 --seed 1
    ;;
  m)  # session 14: healed static depth (8 layers) at ~1.35x with seed 1, the hybrid's pair
    prune sd79s400r1 --method static-depth --cost-target 0.79 --lora --lora-steps "$STEPS" --lora-lr 1e-3 --distill 0.5 --seed 1
    ;;
  u)  # session 11: the untrained baselines at both cost points (no transcripts: nothing is trained)
    prune sd79 --method static-depth --cost-target 0.79 --self-generated 0
    prune sd87 --method static-depth --cost-target 0.87 --self-generated 0
    prune sw29 --method static-width --sparsity 0.29 --self-generated 0
    prune sw18 --method static-width --sparsity 0.18 --self-generated 0
    # session 11 evaluated sd79 only: sd87, sw29 and sw18 were built and timed but not evaluated
    # (no CPU time left); add them here to do so
    quality 500 runs/eval-cache-500 runs/sd79/export
    ;;
  eval)
    # quality: the same code path and settings as `wide compare` (token-level WikiText-2, 7 tasks)
    quality 32 runs/eval-cache smollm2-135m runs/w200lr/export runs/w200/export runs/sd200/export \
        runs/h4-200lr/export runs/sd200lrfix/export runs/h4c83lr/export runs/sd71lr/export runs/h4c71lr/export \
        runs/sd68lr/export
    # speed: decode batch 1 (64 tokens after a 64-token prompt) and prefill 1024, fp32, 1 thread,
    # round-robin, 1 warm-up + 3 rounds, median, against dense in the same rounds
    # (session 8 timed the static-depth row on the session-6 export with the same 8 layers removed)
    $PY benchmarks/pareto_speed.py docs/results/pareto-smollm2/budget200-targets.json runs/budget200-speed.json
    # session 9: every 200-step model of both cost points in one run, 7 rounds (speedups of one
    # 3-round run moved by up to 0.1x); sd200lrfix has sd200's architecture, so sd200 stands for it
    $PY benchmarks/pareto_speed.py docs/results/pareto-smollm2/budget200-s9-targets.json runs/budget200-s9-speed.json --repeats 7
    # sd68lr (trained last) against the ~0.71 pair, a second run
    $PY benchmarks/pareto_speed.py docs/results/pareto-smollm2/budget200-s9b-targets.json runs/budget200-s9b-speed.json --repeats 7
    ;;
  eval400)
    # session 10: the issue's full quality protocol on the 400-step pair and dense: all 62 pages of
    # WikiText-2 test (256-token windows) and the seven tasks at --limit 500, bf16, one model per
    # process (session 10 ran them two at a time, one thread each); then speed with the demo-recipe export
    # (`make demo`'s recipe as of session 10, run as runs/demo-h4), 7 rounds; then the table
    quality 500 runs/eval-cache-500 smollm2-135m runs/sd79s400/export runs/h4c83s400/export
    $PY benchmarks/pareto_speed.py docs/results/pareto-smollm2/budget400-targets.json runs/budget400-speed.json --repeats 7
    $PY benchmarks/budget400_table.py runs/eval-cache-500 runs/budget400-speed.json \
        docs/results/pareto-smollm2/budget400.json smollm2-135m sd79s400 h4c83s400
    ;;
  eval12)
    # session 11: the ~1.2x pair with the same protocol, then speed of dense and every model
    # session 11 built (its ~1.35x rows come from eval400's run), 7 rounds; then the table
    quality 500 runs/eval-cache-500 runs/h3c87s400/export runs/sd87s400/export
    $PY benchmarks/pareto_speed.py docs/results/pareto-smollm2/budget400b-targets.json runs/budget400b-speed.json --repeats 7
    $PY benchmarks/budget400_table.py runs/eval-cache-500 runs/budget400b-speed.json \
        docs/results/pareto-smollm2/budget400b.json sd87s400 h3c87s400 sd79
    ;;
  uq)  # session 12: quality of the untrained rows session 11 built and timed but did not evaluate
    quality 500 runs/eval-cache-500 runs/sw29/export runs/sw18/export runs/sd87/export
    ;;
  eval13)
    # session 12: dynamic depth's two models with the same protocol (two processes side by side, one
    # thread each), then, on a quiet machine, speed of dense, dynamic depth and everything session 11
    # built (a quiet re-time: session 11's run shared the machine with an evaluation), 7 rounds
    quality 500 runs/eval-cache-500 runs/dd87s400/export &
    quality 500 runs/eval-cache-500 runs/dd79s400/export
    wait
    $PY benchmarks/pareto_speed.py docs/results/pareto-smollm2/budget400c-targets.json runs/budget400c-speed.json --repeats 7
    table400c
    ;;
  table400c)
    table400c
    ;;
  eval14)
    # session 13: speed of dense and every 400-step and untrained export on disk (session 10's ~1.35x
    # pair is gone: its numbers stay in budget400.json), 7 rounds, on a quiet machine; then the table
    $PY benchmarks/pareto_speed.py docs/results/pareto-smollm2/budget400d-targets.json runs/budget400d-speed.json --repeats 7
    table400d
    ;;
  table400d)
    table400d
    ;;
  eval15)
    # session 14: WikiText-2 alone for the seed-1 ~1.35x pair (minutes; its own cache, as the key
    # covers the task list; a model already there is skipped), then, on a quiet machine, speed of
    # dense, the pair and the models nearest them in one run, 7 rounds
    QUALITY_TASKS=wikitext quality 500 runs/eval-cache-wt runs/sd79s400r1/export &
    QUALITY_TASKS=wikitext quality 500 runs/eval-cache-wt runs/h4c83s400r1/export
    wait
    $PY benchmarks/pareto_speed.py docs/results/pareto-smollm2/budget400e-targets.json runs/budget400e-speed.json --repeats 7
    ;;
  q15)
    # the seed-1 pair under the full protocol (the seven tasks too; ~1 h, two processes side by
    # side, one thread each), then its table
    quality 500 runs/eval-cache-500 runs/h4c83s400r1/export &
    quality 500 runs/eval-cache-500 runs/sd79s400r1/export
    wait
    $PY benchmarks/budget400_table.py runs/eval-cache-500 runs/budget400e-speed.json \
        docs/results/pareto-smollm2/budget400e.json h4c83s400r1 sd79s400r1 sd79 dd72s400 dd79s400
    ;;
esac
