#!/usr/bin/env bash
# Device call (2026-12-02, fourteenth session): the engine's step compiled without XLA's CUB sorts
# (model_runner.STEP_COMPILER_OPTIONS): issue #3's throughput workload, 64 sequences decoding with
# top-p (every step sorts) with and without CUB, batch-1 decode (8- and 1-token buckets), 256 sequences.
# Usage on the GPU machine: bash benchmarks/h200_cub_sort_run.sh "$OUT"
source "$(dirname "$0")/h200_setup.sh"
run() {  # NAME TIMEOUT COMMAND...: the command's output to $OUT/NAME.txt, its result lines here
  local name=$1 limit=$2; shift 2
  local start=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  echo "== $name: exit $?, $(( $(date +%s) - start )) s"
  grep -E "^B=|tok/s|ms/token|back to back|host ms|rror" "$OUT/$name.txt" | cut -c1-260 | tail -5
}
run throughput_2048 200 python3 benchmarks/offline_throughput.py --model-config llama3-8b --dtype bfloat16 \
  --max-num-seqs 256 --max-num-batched-tokens 2048 --latency-tokens 0
P="python3 benchmarks/batch_decode_profile.py --model-config llama3-8b --context 1024"
run b64_topp 80 $P --batches 64 --top-p 0.9
run b64_topp_cub 80 $P --batches 64 --top-p 0.9 --cub-sort
for v in bf16-b8 int8-auto-b8 bf16-b1; do
  run "decode_$v" 80 python3 benchmarks/decode_latency.py --model-config llama3-8b --variants "$v" --tokens 64
done
run b256 100 $P --batches 256
