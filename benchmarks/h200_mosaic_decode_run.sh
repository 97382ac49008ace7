#!/usr/bin/env bash
# One device call (2026-12-01): batch-1 decode of the Llama-3-8B shape (random weights) in bf16 and
# int8 with the Mosaic GPU attention (the default) and with the Triton one, with the device time
# per kernel of one step (benchmarks/decode_latency.py).
# Usage on the GPU machine: bash benchmarks/h200_mosaic_decode_run.sh "$OUT"
source "$(dirname "$0")/h200_setup.sh"
timeout ${DECODE_TIMEOUT:-400} python3 benchmarks/decode_latency.py --model-config llama3-8b \
  --variants ${VARIANTS:-bf16-b8,int8-auto-b8,bf16-b8-triton,int8-auto-b8-triton} --kernel-breakdown --out "$OUT" > "$OUT/decode.txt" 2>&1
echo "decode_latency.py exit $?"; grep -vE "^\s*$|^W1201|hlo_rematerialization" "$OUT/decode.txt" | tail -75
