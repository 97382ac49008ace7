#!/usr/bin/env bash
# One device call (2026-12-01, eighth session): 8B-shaped offline serving with int8 KV pages of 32 tokens,
# the Mosaic GPU attention against the Triton one (the command of "07:38-08:31 UTC" call 3, plus the
# int8 cache and the page size).
# Usage on the GPU machine: bash benchmarks/h200_int8_kv_serving_run.sh "$OUT"
source "$(dirname "$0")/h200_setup.sh"
for impl in mosaic triton; do
  timeout 200 python3 benchmarks/offline_throughput.py --model-config llama3-8b --dtype bfloat16 \
    --layer-loop unroll --attention-impl $impl --kv-cache-dtype int8 --page-size 32 --num-requests 64 \
    --input-len 1536 2048 --output-len 256 256 --max-num-seqs 64 --max-model-len 4096 --min-token-bucket 64 \
    --latency-tokens 0 --out "$OUT/$impl" > "$OUT/e2e_$impl.txt" 2>&1
  echo "e2e $impl exit $?"; grep -E "engine ready|requests,|per-step|Error" "$OUT/e2e_$impl.txt" | cut -c1-300
done
