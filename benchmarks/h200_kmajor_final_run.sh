#!/usr/bin/env bash
# One device call (2026-12-01, seventh session, third): the K-major GEMV with its default tiles at the
# Llama-3-8B shapes (one row), the engine's batch-1 int8 decode through it against XLA on a tiny model
# (int8_gemv_engine_check.py), and the 8B-shaped decode step at the 1-token bucket.
# Usage on the GPU machine: bash benchmarks/h200_kmajor_final_run.sh "$OUT"
source "$(dirname "$0")/h200_setup.sh"
timeout 150 python3 benchmarks/kernels.py --skip-checks --trials 20 --sections gemv --gemv-rows 1 \
  --gemv-shapes 4096x14336,14336x4096,4096x28672,4096x6144,4096x4096,4096x128256 \
  --gemv-filter "K-major weights|kmajor gemv default|pallas default" --out "$OUT" > "$OUT/kernels.txt" 2>&1
echo "kernels.py exit $?"
grep -E " us |ERROR" "$OUT/kernels.txt" | awk '!seen[$0]++' | sed -E 's/  +/ /g; s/w8a16 M=1 //' | cut -c1-130
timeout 150 python3 benchmarks/int8_gemv_engine_check.py --out "$OUT" > "$OUT/engine_check.txt" 2>&1
echo "int8_gemv_engine_check.py exit $?"; grep -E "GEMV|Error" "$OUT/engine_check.txt" | cut -c1-300
timeout 120 python3 benchmarks/decode_latency.py --model-config llama3-8b --variants int8-auto-b8,int8-auto-b1 \
  --kernel-breakdown --out "$OUT" > "$OUT/decode.txt" 2>&1
echo "decode_latency.py exit $?"; grep -E "ms/token|device time|dispatch|w8a16|FAILED" "$OUT/decode.txt" | cut -c1-150
