#!/usr/bin/env bash
# One device call (2026-12-01, ninth session): the Mosaic GPU W8A16 kernel (pallas_kernels/w8a16_mosaic.py)
# at the Llama-3-8B decode shapes, 8 rows, against XLA's int8 dequantize-dot and bf16 dot (a sweep of
# tiles, stages and programs per SM); then batch-1 decode of the 8B shape with it in the engine.
# Usage on the GPU machine: bash benchmarks/h200_w8a16_mosaic_run.sh "$OUT" [variants] [decode variants]
source "$(dirname "$0")/h200_setup.sh"
VARIANTS=${2:-i8 tk256 s4,i8 tk256 s6,i8 tk128 s8,i8 tk512 s3,i8 tk256 s4 c2,i8 tk128 s4 c2,default,tk256 s4 c2,tk128 s4 c2}
DECODE=${3:-bf16-b8,int8-auto-b8,int8-auto-b8-mosaic-i8,int8-auto-b8-mosaic-i8c2}
timeout 300 python3 benchmarks/w8a16_mosaic.py --rows 8 --variants "$VARIANTS" --trials 10 --out "$OUT" > "$OUT/w8a16_mosaic.txt" 2>&1
echo "w8a16_mosaic.py exit $?"
sed -E 's/  +/ /g' "$OUT/w8a16_mosaic.txt" | grep -E "us |FAILED|Error" | cut -c1-150
timeout 270 python3 benchmarks/decode_latency.py --model-config llama3-8b --variants "$DECODE" --tokens 64 --kernel-breakdown \
  --out "$OUT" > "$OUT/decode.txt" 2>&1
echo "decode_latency.py exit $?"
grep -E "ms/token|device time of one step|speed-up|FAILED|Error" "$OUT/decode.txt" | cut -c1-200
