#!/usr/bin/env bash
# One device call (2026-12-01, ninth session): the Mosaic GPU W8A16 kernel at decode batches of 16-64
# rows against XLA's dequantize-dot, then 8B-shaped offline serving with int8 weights (64 requests,
# 64-row decode steps) through XLA and through the kernel (int8 activations).
# Usage on the GPU machine: bash benchmarks/h200_w8a16_mosaic_batch_run.sh "$OUT"
source "$(dirname "$0")/h200_setup.sh"
timeout 200 python3 benchmarks/w8a16_mosaic.py --rows 16,32,64 --variants "i8 tk256 s6,default" --trials 10 --out "$OUT" \
  > "$OUT/w8a16_mosaic.txt" 2>&1
echo "w8a16_mosaic.py exit $?"
sed -E 's/  +/ /g' "$OUT/w8a16_mosaic.txt" | grep -E "us |FAILED|Error" | cut -c1-150
for mode in xla mosaic; do
  extra=""; [ $mode = mosaic ] && extra="--mosaic-w8a16-rows 64 --mosaic-w8a16-int8-activations"
  timeout 170 python3 benchmarks/offline_throughput.py --model-config llama3-8b --dtype bfloat16 --quantization int8 \
    --layer-loop unroll --num-requests 64 --input-len 1536 2048 --output-len 256 256 --max-num-seqs 64 \
    --max-model-len 4096 --min-token-bucket 64 --latency-tokens 0 $extra --out "$OUT/$mode" > "$OUT/e2e_$mode.txt" 2>&1
  echo "e2e $mode exit $?"; grep -E "engine ready|requests,|per-step|Error" "$OUT/e2e_$mode.txt" | cut -c1-300
done
