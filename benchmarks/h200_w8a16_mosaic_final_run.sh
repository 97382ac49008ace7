#!/usr/bin/env bash
# One device call (2026-12-01, ninth session, last): after the Mosaic kernels' shared helpers moved to
# pallas_kernels/mosaic_common.py, the engine's Mosaic GPU attention against the XLA reference (greedy
# tokens, logprobs), and batch-1 decode of the 8B shape with the final W8A16 kernel (two int8 inputs).
# Usage on the GPU machine: bash benchmarks/h200_w8a16_mosaic_final_run.sh "$OUT"
source "$(dirname "$0")/h200_setup.sh"
timeout 110 python3 benchmarks/attention_engine_check.py --impls mosaic --out "$OUT" > "$OUT/engine_check.txt" 2>&1
echo "attention_engine_check.py exit $?"; grep -E "identical|max|Error" "$OUT/engine_check.txt" | cut -c1-300
timeout 160 python3 benchmarks/decode_latency.py --model-config llama3-8b --variants int8-auto-b8,int8-auto-b8-mosaic-i8 \
  --tokens 48 --kernel-breakdown --out "$OUT" > "$OUT/decode.txt" 2>&1
echo "decode_latency.py exit $?"
grep -E "ms/token|device time of one step|FAILED|Error" "$OUT/decode.txt" | cut -c1-200
