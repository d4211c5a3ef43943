#!/usr/bin/env bash
# Gemma 3 270M end to end on a 2-core CPU (docs/results/gemma3-270m.md): dense `wide eval` against
# transformers' own forward of the same weights; the recipe `gemma3-270m-cpu` (2 layers removed,
# width routed in the other 16) at $COST of dense FLOPs, trained on the general text of
# $TRAIN_DATA, against static depth at the same FLOPs target (the first layer count at or under
# it) healed with the same LoRA budget, distillation and data; quality on WikiText-2
# (token level, 256-token windows, first $PAGES pages) and the seven tasks (first $LIMIT items
# each, bf16); speed with `wide compare`'s protocol (native decode step, fp32, 1 thread, round-robin,
# median, dense first); `wide bench` against llama.cpp on the embedded GGUF. A benchmark, not a test:
# each training run is about an hour at 1 thread.
#
# Usage: benchmarks/gemma3_270m.sh STEP [STEP ...]
#   parity        dense: wide eval vs transformers (first $PAGES pages)
#   wide          train the recipe (runs/gemma3-wide)
#   static-depth  static depth to the same FLOPs + LoRA, same budget (runs/gemma3-sd)
#   quality       WikiText-2 and the seven tasks for dense, wide, static depth
#   speed         decode / prefill speed of the three, one run per dtype of $SPEED_DTYPES (default
#                 "fp32 bf16"; run it on a quiet machine)
#   bench         `wide bench` of both exports: the runtime's dense mode and routed model in fp32, bf16,
#                 int8 and int4 against llama.cpp on the original Q4_K_M GGUF (prefill of 1,024 tokens,
#                 decode at batch 1; 1 thread; run it on a quiet machine)
#   text          greedy continuations of the three (`wide generate`)
#   routing       how varied the routed export's masks are (`wide inspect --text` on the start of
#                 WikiText-2's test text: distinct masks per router, measured sparsity)
#   report        docs/results/gemma3-270m.md from the files above
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || { sed -n '12,25p' "$0"; exit 2; }
WIDE=${WIDE:-.venv/bin/wide}
PY=${PY:-.venv/bin/python}
DATA_DIR=${DATA_DIR:-../shared/data}
OUT=${OUT:-docs/results/gemma3-270m}
PAGES=${PAGES:-8}
LIMIT=${LIMIT:-50}
STEPS=${STEPS:-120}
COST=${COST:-0.92}                        # of dense FLOPs, the tied head included
TRAIN_DATA=${TRAIN_DATA:-$DATA_DIR/corpus}  # general web and encyclopedia text (never WikiText)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=${MKL_NUM_THREADS:-1}
mkdir -p runs "$OUT"
# the models `quality` evaluates (TARGETS="..." evaluates some of them, e.g. while another trains)
read -ra TARGETS <<< "${TARGETS:-gemma3-270m runs/gemma3-wide/export runs/gemma3-sd/export}"

prune() {  # $1 = run name, rest = flags; a finished run is kept
  local name=$1; shift
  [ -f "runs/$name/export/manifest.json" ] && return 0
  $WIDE prune gemma3-270m --recipe gemma3-270m-cpu --steps "$STEPS" --run-dir "runs/$name" \
      --out "runs/$name/export" --data "$TRAIN_DATA" --shuffle-documents --max-train-tokens 400000 \
      --eval-max-tokens 16384 --cost-target "$COST" --json "$@" > "runs/$name.json"
  cp "runs/$name.json" "$OUT/prune-$name.json"
}

quality() {  # $1 = tasks, $2 = limit, $3 = output name; one process per target
  for t in "${TARGETS[@]}"; do
    local slug=${t#runs/}; slug=${slug%/export}
    $PY - "$t" "$DATA_DIR" "$2" "$1" "$OUT/quality-$3-$slug.json" <<'PYEOF'
import json, sys
from pathlib import Path
from wide_cli.eval.run import evaluate_targets
target, data_dir, limit, tasks, out = sys.argv[1:]
rep = evaluate_targets([target], tasks=tasks.split(","), data_dir=Path(data_dir), limit=int(limit), seq_len=256,
                       batch_size=4, dtype="bf16", device="cpu", cache_dir=Path("runs/eval-cache-gemma3"),
                       wikitext_protocols=("token",))
Path(out).write_text(json.dumps(rep, indent=1) + "\n")
PYEOF
  done
}

for step in "$@"; do
  case $step in
    parity) $PY benchmarks/gemma3_parity.py "$DATA_DIR" "$PAGES" 256 "$OUT/parity.json" ;;
    wide) prune gemma3-wide ;;
    static-depth)  # the first layer count at or under $COST of dense FLOPs; healed like the routed run is trained
      prune gemma3-sd --method static-depth --drop-layers 0 --lora --lora-steps "$STEPS" \
          --lora-lr 1e-3 --distill 1.0 ;;
    quality)
      quality wikitext "$PAGES" wikitext
      quality arc_easy,arc_challenge,piqa,hellaswag,boolq,winogrande,openbookqa "$LIMIT" tasks ;;
    speed)
      printf '{"rows": [\n {"name": "gemma3-270m", "label": "dense"},\n {"name": "runs/gemma3-wide/export", "label": "wide (recipe)"},\n {"name": "runs/gemma3-sd/export", "label": "static depth + LoRA"}\n]}\n' > "$OUT/speed-targets.json"
      for dt in ${SPEED_DTYPES:-fp32 bf16}; do  # bf16 halves the tied head's bytes, most of a decode step's
        case $dt in
          fp32) $PY benchmarks/speed_round_robin.py "$OUT/speed-targets.json" "$OUT/speed.json" --repeats 5 ;;
          *) $PY benchmarks/speed_round_robin.py "$OUT/speed-targets.json" "$OUT/speed-$dt.json" --repeats 5 --dtype "$dt" ;;
        esac
      done ;;
    bench)
      for name in gemma3-wide gemma3-sd; do
        $WIDE bench "runs/$name/export" --systems dense,cpu,llama.cpp --weights fp32,bf16,int8,int4 \
            --prefill-lengths 1024 --decode-batches 1 --new-tokens 64 --threads 1 --repeats 3 \
            --json-out "$OUT/bench-$name.json" > /dev/null
      done ;;
    text)
      $WIDE generate gemma3-270m runs/gemma3-wide/export runs/gemma3-sd/export --max-new-tokens 24 --json \
          -p "Water boils at" -p "The capital of France is" -p "The history of the Roman Empire" > "$OUT/text.json" ;;
    routing)
      $PY -c 'import sys; from pathlib import Path; from wide_cli.eval import wikitext
print("\n\n".join(wikitext.rows(wikitext.read_raw(Path(sys.argv[1]), "test")))[:6000])' "$DATA_DIR" > runs/gemma3-wikitext-head.txt
      $WIDE inspect runs/gemma3-wide/export --text runs/gemma3-wikitext-head.txt --json > "$OUT/routing-gemma3-wide.json" ;;
    report) $PY benchmarks/gemma3_270m_report.py "$OUT" ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
