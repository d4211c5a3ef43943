#!/usr/bin/env bash
# Quality at equal measured speed on SmolLM2-135M (docs/results/quality-at-equal-speed.md): every
# pruning method at two cost points (~1.2x and ~1.35x measured decode), one training budget (400
# steps x 4 x 256 corpus tokens per trained method), one quality protocol (WikiText-2 test, all 62
# pages, 256-token windows; the seven tasks at --limit 500; bf16) and `wide compare`'s speed
# protocol (native decode step, fp32, 1 thread, 1 warm-up + 7 rounds, median, against dense in the
# same run). Hours per trained model on a 2-core CPU: a benchmark, not a test.
#
# Usage: benchmarks/quality_at_equal_speed.sh STEP [STEP ...]   (steps run in the order given)
#   training, one model per step (runs/NAME, its `wide prune --json` output runs/NAME.json):
#     hybrid-1.2x  static-depth-lora-1.2x  dynamic-depth-1.2x  static-depth-1.2x  static-width-1.2x
#     hybrid-1.35x static-depth-lora-1.35x dynamic-depth-1.35x dynamic-depth-1.35x-cost0.72
#     static-depth-1.35x static-width-1.35x
#     hybrid-1.35x-seed1 static-depth-lora-1.35x-seed1      (the ~1.35x pair again with --seed 1)
#     hybrid-1.35x-lowrank8                                 (the ~1.35x hybrid with rank-8 low-rank stand-ins)
#     demo-recipe                                           (`make demo`'s recipe, timed beside the pair)
#   measuring (each reads the exports the training steps left in runs/):
#     quality-pair    quality-others    quality-seed1-wikitext    quality-seed1    quality-lowrank
#     speed-pair      speed-others      speed-seed1      speed-lowrank    (run these on a quiet machine)
#     rows-pair       rows-others       rows-seed1       rows-lowrank     (quality + training report + speed -> one JSON)
#     report          the page's table, report.json and pareto.png from the rows files
# The committed numbers: the training steps (two side by side, one thread each), then quality-pair,
# speed-pair, rows-pair for the ~1.35x pair and dense, quality-others, speed-others, rows-others for
# the other rows, then report. The seed-1 pair: its two training steps, then quality-seed1-wikitext.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || { sed -n '9,24p' "$0"; exit 2; }
WIDE=${WIDE:-.venv/bin/wide}
PY=${PY:-.venv/bin/python}
STEPS=${STEPS:-400}
DATA_DIR=${DATA_DIR:-../shared/data}
OUT=${OUT:-docs/results/quality-at-equal-speed}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=${MKL_NUM_THREADS:-1}
mkdir -p runs "$OUT/prune"
# The demo recipe's settings (attention group 3, FFN group 128, router rank 32, frozen bf16
# backbone) on the shared corpus with 160 self-generated chat transcripts packed in; the recipe's
# own `drop_layers` is cleared (`--drop-layers 0`) so that only the hybrid steps remove layers
# (a later `--drop-layers N` on the same command line wins).
COMMON=(--recipe smollm2-135m-cpu --data "$DATA_DIR/corpus" --shuffle-documents --checkpoint-every 50
        --eval-max-tokens 16384 --self-generated 160 --drop-layers 0 --json)
# routers, trained stand-ins and LoRA together from step 1, 0.5 LM + 0.5 KL to the dense model
LEVERS=(--standin trained --distill 0.5 --lora-joint --steps "$STEPS" --lora-lr 1e-3)
# static depth healed with the same LoRA budget, learning rate and distillation
HEAL=(--lora --lora-steps "$STEPS" --lora-lr 1e-3 --distill 0.5)
ALL_TASKS=wikitext,arc_easy,arc_challenge,piqa,hellaswag,boolq,winogrande,openbookqa

prune() {  # $1 = run name, rest = flags; a finished run is kept
  local name=$1; shift
  [ -f "runs/$name/export/manifest.json" ] && return 0
  $WIDE prune smollm2-135m "${COMMON[@]}" --run-dir "runs/$name" --out "runs/$name/export" "$@" > "runs/$name.json"
  cp "runs/$name.json" "$OUT/prune/$name.json"
}

quality() {  # $1 = cache dir, rest = targets, one process each; QUALITY_TASKS narrows the task list
  local cache=$1; shift
  for t in "$@"; do
    # the `wide eval` / `wide compare` code path: token-level WikiText-2 and the tasks, bf16
    $PY - "$t" "$DATA_DIR" 500 "$cache" "${QUALITY_TASKS:-$ALL_TASKS}" <<'EOF'
import sys
from pathlib import Path
from wide_cli.eval.run import evaluate_targets
target, data_dir, limit, cache, tasks = sys.argv[1:]
evaluate_targets([target], tasks=tasks.split(","), data_dir=Path(data_dir), limit=int(limit), seq_len=256,
                 batch_size=4, dtype="bf16", device="cpu", cache_dir=Path(cache), wikitext_protocols=("token",))
EOF
  done
}

speed() {  # $1 = name of the targets/speed files in $OUT
  $PY benchmarks/speed_round_robin.py "$OUT/$1-targets.json" "$OUT/$1-speed.json" --repeats 7
}

rows() {  # $1 = name of the speed/rows files in $OUT, rest = runs (or the dense model spec) in table order
  local name=$1; shift
  $PY benchmarks/collect_rows.py "${EVAL_CACHE:-runs/eval-cache-500}" "$OUT/$name-speed.json" "$OUT/$name.json" "$@"
}

for step in "$@"; do
  case $step in
    hybrid-1.2x)  # Block Influence removes 3 layers, width routed in the other 27 to 0.87 of dense FLOPs
      prune h3c87s400 --method wide --drop-layers 3 --cost-target 0.87 "${LEVERS[@]}" ;;
    static-depth-lora-1.2x)  # 5 layers removed, LoRA healing
      prune sd87s400 --method static-depth --cost-target 0.87 "${HEAL[@]}" ;;
    dynamic-depth-1.2x)  # a router per layer skips whole attention / FFN modules per token
      prune dd87s400 --method dynamic-depth --cost-target 0.87 "${LEVERS[@]}" ;;
    static-depth-1.2x)  # untrained: nothing is trained, so no transcripts
      prune sd87 --method static-depth --cost-target 0.87 --self-generated 0 ;;
    static-width-1.2x)
      prune sw18 --method static-width --sparsity 0.18 --self-generated 0 ;;
    hybrid-1.35x)  # 4 layers removed, width routed in the other 26 to 0.83
      prune h4c83s400 --method wide --drop-layers 4 --cost-target 0.83 "${LEVERS[@]}" ;;
    static-depth-lora-1.35x)  # 8 layers removed, LoRA healing
      prune sd79s400 --method static-depth --cost-target 0.79 "${HEAL[@]}" ;;
    dynamic-depth-1.35x)  # asked for static depth's FLOPs; measured ~1.22x
      prune dd79s400 --method dynamic-depth --cost-target 0.79 "${LEVERS[@]}" ;;
    dynamic-depth-1.35x-cost0.72)  # the cost that brings dynamic depth's measured decode to the point
      prune dd72s400 --method dynamic-depth --cost-target 0.72 "${LEVERS[@]}" ;;
    static-depth-1.35x)
      prune sd79 --method static-depth --cost-target 0.79 --self-generated 0 ;;
    static-width-1.35x)
      prune sw29 --method static-width --sparsity 0.29 --self-generated 0 ;;
    hybrid-1.35x-seed1)  # seed 1: data order, Gumbel noise, init and held-out split
      prune h4c83s400r1 --method wide --drop-layers 4 --cost-target 0.83 "${LEVERS[@]}" --seed 1 ;;
    static-depth-lora-1.35x-seed1)
      prune sd79s400r1 --method static-depth --cost-target 0.79 "${HEAL[@]}" --seed 1 ;;
    hybrid-1.35x-lowrank8)  # the same with low-rank stand-ins: the trained mean plus a rank-8 map of the input
      prune h4c83s400lr8 --method wide --drop-layers 4 --cost-target 0.83 "${LEVERS[@]}" --standin lowrank:8 ;;
    demo-recipe)  # `make demo`'s training on its own data (pydoc + 480 transcripts), timed with the pair
      [ -f runs/demo-h4/export/manifest.json ] ||
        $WIDE prune smollm2-135m --recipe recipes/smollm2-135m-cpu.toml --run-dir runs/demo-h4 --out runs/demo-h4/export ;;
    quality-pair)
      quality runs/eval-cache-500 smollm2-135m runs/sd79s400/export runs/h4c83s400/export ;;
    quality-others)
      quality runs/eval-cache-500 runs/h3c87s400/export runs/sd87s400/export runs/dd87s400/export \
          runs/dd79s400/export runs/dd72s400/export runs/sd87/export runs/sd79/export runs/sw18/export runs/sw29/export ;;
    quality-seed1-wikitext)  # WikiText-2 alone: minutes instead of an hour (its own cache: the key covers the tasks)
      QUALITY_TASKS=wikitext quality runs/eval-cache-wt runs/h4c83s400r1/export runs/sd79s400r1/export ;;
    quality-seed1)
      quality runs/eval-cache-500 runs/h4c83s400r1/export runs/sd79s400r1/export ;;
    quality-lowrank)  # QUALITY_TASKS=wikitext EVAL_CACHE=runs/eval-cache-wt: WikiText-2 alone (rows-lowrank then reads it)
      quality "${EVAL_CACHE:-runs/eval-cache-500}" runs/h4c83s400lr8/export ;;
    speed-lowrank)  # dense, the low-rank hybrid and `make demo`'s export (the demo recipe, as in speed-pair)
      speed lowrank ;;
    rows-lowrank)
      rows lowrank h4c83s400lr8 ;;
    speed-pair)  # dense, the ~1.35x pair and the demo recipe's export
      speed pair-1.35x ;;
    speed-others)  # dense and the other nine models
      speed other-methods ;;
    speed-seed1)  # dense, the seed-1 pair and the models nearest them
      speed seed-1 ;;
    rows-pair)
      rows pair-1.35x smollm2-135m sd79s400 h4c83s400 ;;
    rows-others)
      rows other-methods dd72s400 dd79s400 dd87s400 h3c87s400 sd87s400 sd87 sd79 sw18 sw29 ;;
    rows-seed1)
      rows seed-1 h4c83s400r1 sd79s400r1 sd79 dd72s400 dd79s400 ;;
    report)
      $PY benchmarks/quality_at_equal_speed.py ;;
    *)
      echo "error: unknown step '$step'; the steps are listed in the header of $0" >&2; exit 2 ;;
  esac
done
