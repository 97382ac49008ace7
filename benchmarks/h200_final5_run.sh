#!/usr/bin/env bash
# One device call (2026-11-29, fifth session, last): weight-only int8 stored K-major ([out, in]) for
# XLA's dequantize-dot at the engine's 8-row decode shapes (benchmarks/kernels.py), the fp8 prefill
# through the engine now that fp8 matmuls go to XLA, and batch-1 decode with int8 weights in either
# layout (benchmarks/decode_latency.py, with the device time per kernel).
# Usage on the GPU machine: bash benchmarks/h200_final5_run.sh "$OUT"
source "$(dirname "$0")/h200_setup.sh"
timeout 120 python3 benchmarks/kernels.py --skip-checks --trials 20 --sections gemv --gemv-rows 8 \
  --gemv-shapes 4096x6144,4096x4096,4096x28672,14336x4096,4096x128256 --out "$OUT" > "$OUT/kernels.txt" 2>&1
echo "kernels.py exit $?"; grep -E " us |ERROR" "$OUT/kernels.txt" | grep -v "^copy" | awk '!seen[$0]++' | cut -c1-200
timeout 80 python3 benchmarks/offline_throughput.py --model-config llama3-8b --dtype bfloat16 --quantization fp8 \
  --layer-loop unroll --num-requests 16 --input-len 2048 2048 --output-len 1 1 --max-num-seqs 16 \
  --max-num-batched-tokens 2048 --min-token-bucket 1024 --max-model-len 4096 --latency-tokens 0 --out "$OUT/prefill_fp8-xla" \
  > /tmp/prefill_fp8.txt 2>&1
echo "== prefill fp8 (XLA) exit $?"; grep -E "ready|requests|rror" /tmp/prefill_fp8.txt | tail -3
timeout ${DECODE_TIMEOUT:-170} python3 benchmarks/decode_latency.py --model-config llama3-8b \
  --variants bf16-b8,int8-auto-b8-inout,int8-auto-b8 --kernel-breakdown --out "$OUT" > "$OUT/decode.txt" 2>&1
echo "decode_latency.py exit $?"; grep -vE "^\s*$" "$OUT/decode.txt" | tail -45
