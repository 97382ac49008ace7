#!/usr/bin/env bash
# One device call: Llama-3-8B-shaped batch-1 decode latency, bf16 vs int8 weights, scanned vs
# unrolled layer loop. Usage on the GPU machine: bash benchmarks/h200_latency_run.sh "$OUT"
source "$(dirname "$0")/h200_setup.sh"
for quant in none int8; do
  for loop in scan unroll; do
    q=""; [ "$quant" = int8 ] && q="--quantization int8"
    echo "== $quant $loop"
    timeout 110 python3 benchmarks/offline_throughput.py --model-config llama3-8b --dtype bfloat16 $q --layer-loop $loop \
      --num-requests 0 --max-num-seqs 4 --max-num-batched-tokens 16 --latency-tokens 96 --out "$OUT" 2>&1 | grep -E "ready|decode|Error|error" | tee -a "$OUT/latency.txt"
  done
done
