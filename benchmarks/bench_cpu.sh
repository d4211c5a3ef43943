#!/usr/bin/env bash
# CPU speed against llama.cpp (docs/results/bench-cpu.{json,md}): `wide bench` on the demo export
# (every system, both thread counts, perplexity per format and path) and on a cost-0.5 export
# (HF, the runtime and llama.cpp Q8_0 / Q4_0: prefill at 128 and 1,024 tokens, decode batches of 1,
# 4 and 16 rows, and perplexity per format and path); then the cost-0.5 export's int4 rows beside int8, fp32
# and llama.cpp Q8_0 / Q4_0 (prefill 128, decode batches 1 and 4, perplexity per format and path), and
# long contexts: prefill of 2,048 / 8,000 tokens and decode after them (bf16, int4, llama.cpp Q4_0 at 2,048);
# then decode batches of 1, 4 and 16 rows on the native step, every format, on both exports, prefill
# of 4,096 tokens on the cost-0.5 export, and its prefill of 128 / 1,024 / 4,096 tokens at 2 threads.
# Usage: benchmarks/bench_cpu.sh DEMO_EXPORT COST05_EXPORT [OUT_DIR]   (needs `make llama-setup`)
# DEMO_EXPORT '-' skips the demo run; C05_THREADS=1 limits the cost-0.5 run to one thread (a machine where another job holds a core).
# SECTIONS=amx runs only the runs of the first section of bench-cpu.md (a CPU with AMX: prefill of
# 128 / 1,024 / 4,096 tokens, decode batches and llama.cpp on both exports, 1 and 2 threads);
# SECTIONS=avx512 the same two exports with llama.cpp Q8_0 / Q4_0 beside them (a CPU with AVX-512
# VNNI / BF16 and no AMX: prefill 128 / 1,024, decode batches of 1, 4 and 16 rows, 1 and 2 threads;
# then prefill of 4,096 tokens with HF and the runtime);
# SECTIONS=long the cost-0.5 export after 8,000 tokens of context (the runtime's dense mode and routed
# model in fp32, bf16, int8 and int4; one timed round, no warm-up) and its WikiText-2 perplexity per format
# on both paths (prefill and the native decode step);
# SECTIONS=int4ppl the int4 cost in perplexity on both exports, each export's plain int4 (quantized at
# load) against the int4 export of the same run with scales chosen by the importance matrix
# (DEMO_INT4 / C05_INT4: `wide export --run-dir RUN --weights int4`), WikiText-2 on both paths;
# the speed rows of this section are a one-round by-product, not a measurement;
# SECTIONS=rest the others; the default runs amx and rest.
# Run it on a quiet machine: the 2-thread rows measure whatever else holds a core.
set -euo pipefail
demo=$1
c05=$2
out=${3:-docs/results}
wide=${WIDE:-.venv/bin/wide}
sections=${SECTIONS:-amx,rest}
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
if [[ $sections == *amx* ]]; then
  # The cost-0.5 export: every system and format at prefill 128 / 1,024 and decode batches of 1, 4
  # and 16 rows; then prefill of 4,096 tokens, the runtime only; then the demo export like the first.
  $wide bench "$c05" --systems hf,dense,cpu --weights fp32,bf16,int8,int4 \
    --prefill-lengths 128,1024 --decode-batches 1,4,16 --new-tokens 32 --decode-prompt-len 64 --threads 1,2 \
    --json-out "$out/bench-cpu-amx-cost05.json"
  $wide bench "$c05" --systems dense,cpu --weights fp32,bf16,int8,int4 --prefill-lengths 4096 --decode-batches 1 \
    --new-tokens 8 --decode-prompt-len 64 --threads 1,2 --json-out "$out/bench-cpu-amx-prefill4k.json"
  if [ "$demo" != "-" ]; then
    $wide bench "$demo" --systems hf,dense,cpu --weights fp32,bf16,int8,int4 \
      --prefill-lengths 128,1024 --decode-batches 1,4,16 --new-tokens 32 --decode-prompt-len 64 --threads 1,2 \
      --json-out "$out/bench-cpu-amx-demo.json"
  fi
fi
if [[ $sections == *avx512* ]]; then
  for e in "$c05:cost05" "$demo:demo"; do
    [ "${e%%:*}" = "-" ] && continue
    $wide bench "${e%%:*}" --systems hf,dense,cpu,llama.cpp --weights fp32,bf16,int8,int4 --llama-cpp-types Q8_0,Q4_0 \
      --prefill-lengths 128,1024 --decode-batches 1,4,16 --new-tokens 32 --decode-prompt-len 64 --threads 1,2 \
      --json-out "$out/bench-cpu-avx512-${e##*:}.json"
    $wide bench "${e%%:*}" --systems hf,dense,cpu --weights fp32,bf16,int8,int4 --prefill-lengths 4096 --decode-batches 1 \
      --new-tokens 8 --decode-prompt-len 64 --threads 1,2 --json-out "$out/bench-cpu-avx512-prefill4k-${e##*:}.json"
  done
fi
if [[ $sections == *long* ]]; then
  $wide bench "$c05" --systems dense,cpu --weights fp32,bf16,int8,int4 --prefill-lengths 128 --decode-batches 1 \
    --new-tokens 32 --decode-prompt-len 8000 --threads 1,2 --repeats 1 --warmup 0 \
    --ppl-tokens 2048 --ppl-seq-len 512 --data-dir ../shared/data --json-out "$out/bench-cpu-avx512-long8k-cost05.json"
fi
if [[ $sections == *int4ppl* ]]; then
  for e in "$demo:${DEMO_INT4:--}:demo" "$c05:${C05_INT4:--}:cost05"; do
    IFS=: read -r fp int4 name <<< "$e"
    [ "$fp" = "-" ] && continue
    ppl=(--prefill-lengths 128 --decode-batches 1 --new-tokens 4 --decode-prompt-len 16 --threads 1 --repeats 1
         --warmup 0 --ppl-tokens 2048 --ppl-seq-len 512 --data-dir ../shared/data)
    $wide bench "$fp" --systems cpu --weights fp32,int4 "${ppl[@]}" --json-out "$out/bench-cpu-int4ppl-$name.json"
    [ "$int4" = "-" ] || $wide bench "$int4" --systems cpu --weights int4 "${ppl[@]}" \
      --json-out "$out/bench-cpu-int4ppl-$name-importance.json"
  done
fi
[[ $sections == *rest* ]] || exit 0
if [ "$demo" != "-" ]; then
  $wide bench "$demo" --systems hf,dense,cpu,dense-torch,cpu-torch,llama.cpp --weights fp32,bf16,int8 \
    --prefill-lengths 1024 --decode-batches 1 --new-tokens 128 --decode-prompt-len 64 --threads 1,2 \
    --ppl-tokens 4096 --ppl-seq-len 512 --data-dir ../shared/data --json-out "$out/bench-cpu.json"
fi
$wide bench "$c05" --systems hf,dense,cpu,llama.cpp --weights fp32,bf16,int8 --llama-cpp-types Q8_0,Q4_0 \
  --prefill-lengths 128,1024 --decode-batches 1,4,16 --new-tokens 32 --decode-prompt-len 64 --threads ${C05_THREADS:-1,2} \
  --ppl-tokens 2048 --ppl-seq-len 512 --data-dir ../shared/data --json-out "$out/bench-cpu-cost05.json"
$wide bench "$c05" --systems dense,cpu,llama.cpp --weights fp32,int8,int4 --llama-cpp-types Q8_0,Q4_0 \
  --prefill-lengths 128 --decode-batches 1,4 --new-tokens 32 --decode-prompt-len 64 --threads ${C05_THREADS:-1,2} \
  --ppl-tokens 2048 --ppl-seq-len 512 --data-dir ../shared/data --json-out "$out/bench-cpu-int4.json"
$wide bench "$c05" --systems dense,cpu,llama.cpp --weights bf16,int4 --llama-cpp-types Q4_0 \
  --prefill-lengths 2048 --decode-batches 1 --new-tokens 32 --decode-prompt-len 2048 --threads ${C05_THREADS:-1,2} \
  --json-out "$out/bench-cpu-long2k.json"
# 8,000 tokens: one timed round without warm-up, int4 dense and routed only (a round of every system
# took ~17 minutes at 1 thread)
$wide bench "$c05" --systems dense,cpu --weights int4 --prefill-lengths 8000 --decode-batches 1 --new-tokens 32 \
  --decode-prompt-len 8000 --threads ${C05_THREADS:-1,2} --repeats 1 --warmup 0 --json-out "$out/bench-cpu-long8k.json"
# Decode batches on the native step (each row its own groups, a group read once per step), every
# format, both exports; llama.cpp at batch 1 on the same weights.
for e in "$demo:demo" "$c05:cost05"; do
  [ "${e%%:*}" = "-" ] && continue
  $wide bench "${e%%:*}" --systems dense,cpu,llama.cpp --weights fp32,bf16,int8,int4 --llama-cpp-types Q8_0,Q4_0 \
    --prefill-lengths 128 --decode-batches 1,4,16 --new-tokens 32 --decode-prompt-len 64 --threads ${C05_THREADS:-1,2} \
    --json-out "$out/bench-cpu-batches-${e##*:}.json"
done
$wide bench "$c05" --systems dense,cpu --weights fp32,bf16,int8,int4 --prefill-lengths 4096 --decode-batches 1 \
  --new-tokens 8 --decode-prompt-len 64 --threads ${C05_THREADS:-1,2} --json-out "$out/bench-cpu-prefill4k.json"
# Prefill of 128, 1,024 and 4,096 tokens at 2 threads, every format (the 1-thread rows of these
# lengths: bench-cpu-cost05.json, bench-cpu-batches-cost05.json, bench-cpu-prefill4k.json).
$wide bench "$c05" --systems dense,cpu --weights fp32,bf16,int8,int4 --prefill-lengths 128,1024,4096 --decode-batches 1 \
  --new-tokens 8 --decode-prompt-len 64 --threads 2 --json-out "$out/bench-cpu-prefill-2t.json"
