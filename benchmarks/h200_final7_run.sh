#!/usr/bin/env bash
# One device call (2026-12-01, seventh session, last): the K-major GEMV at two rows against XLA (is
# KMAJOR_GEMV_MAX_ROWS = 2 worth it?), then the 8B-shaped offline serving run of the Mosaic and Triton
# attention with the submitted code (the 2,368 tok/s figure was measured before the last two layout changes).
# Usage on the GPU machine: bash benchmarks/h200_final7_run.sh "$OUT"
source "$(dirname "$0")/h200_setup.sh"
timeout 100 python3 benchmarks/kernels.py --skip-checks --trials 20 --sections gemv --gemv-rows 2 \
  --gemv-shapes 4096x14336,14336x4096,4096x28672,4096x6144,4096x4096,4096x128256 \
  --gemv-filter "K-major weights|kmajor gemv default" --out "$OUT" > "$OUT/kernels.txt" 2>&1
echo "kernels.py exit $?"
grep -E " us |ERROR" "$OUT/kernels.txt" | awk '!seen[$0]++' | sed -E 's/  +/ /g; s/w8a16 //' | cut -c1-130
E2E_IMPLS="mosaic triton"
for impl in $E2E_IMPLS; do
  timeout 150 python3 benchmarks/offline_throughput.py --model-config llama3-8b --dtype bfloat16 \
    --layer-loop unroll --attention-impl $impl --num-requests 64 --input-len 1536 2048 --output-len 256 256 \
    --max-num-seqs 64 --max-model-len 4096 --min-token-bucket 64 --latency-tokens 0 --out "$OUT" > "$OUT/e2e_$impl.txt" 2>&1
  echo "e2e $impl exit $?"; grep -E "engine ready|requests,|per-step|Error" "$OUT/e2e_$impl.txt" | cut -c1-300
done
