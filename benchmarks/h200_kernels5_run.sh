#!/usr/bin/env bash
# One device call (2026-11-29, fifth session): the W8A16 GEMV without its XLA glue (no pad of x,
# split 1 with narrow tiles), W8A8 with K-major weights (Hopper's 8-bit wgmma), fp8 in XLA, and
# decode-attention launch knobs (benchmarks/kernels.py, CUPTI device time).
# Usage on the GPU machine: bash benchmarks/h200_kernels5_run.sh "$OUT"
source "$(dirname "$0")/h200_setup.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
timeout ${KERNELS_TIMEOUT:-330} python3 benchmarks/kernels.py --skip-checks --trials 20 --sections gemm,gemv,decode \
  --gemv-shapes 4096x14336,14336x4096,4096x28672,4096x6144,4096x4096 --gemv-rows 1 --out "$OUT" > "$OUT/kernels.txt" 2>&1
echo "kernels.py exit $?"; grep -E " us |ERROR" "$OUT/kernels.txt" | awk '!seen[$0]++' | cut -c1-220
