#!/usr/bin/env bash
# One device call (2026-12-01, ninth session): 8B-shaped offline serving at 32 and 16 concurrent sequences
# (decode steps of 32 / 16 rows): bf16 weights, int8 weights through XLA's dequantize-dot, and int8 weights
# through the Mosaic GPU W8A16 kernel (two-term int8 activations) for steps of 9-32 rows.
# Usage on the GPU machine: bash benchmarks/h200_w8a16_mosaic_serving_run.sh "$OUT"
source "$(dirname "$0")/h200_setup.sh"
run() {  # name seqs extra-args...
  local name=$1 seqs=$2; shift 2
  timeout 115 python3 benchmarks/offline_throughput.py --model-config llama3-8b --dtype bfloat16 --layer-loop unroll \
    --num-requests 64 --input-len 1024 1536 --output-len 256 256 --max-num-seqs $seqs --max-num-batched-tokens 512 \
    --max-model-len 2048 --min-token-bucket $seqs --latency-tokens 0 "$@" --out "$OUT/$name" > "$OUT/e2e_$name.txt" 2>&1
  echo "$name exit $? ($SECONDS s)"; grep -E "requests,|Error" "$OUT/e2e_$name.txt" | cut -c1-300
}
run s32_int8_xla 32 --quantization int8
run s32_int8_mosaic 32 --quantization int8 --mosaic-w8a16-rows 32
run s32_bf16 32
run s16_int8_xla 16 --quantization int8
[ $SECONDS -lt 470 ] && run s16_int8_mosaic 16 --quantization int8 --mosaic-w8a16-rows 32
