#!/usr/bin/env bash
# One device call (2026-12-01, seventh session, second): the K-major W8A16 kernel's CUDA-core GEMV path
# (gemv=True) at one row against the [in, out] GEMV and XLA's dequantize-dot, at the Llama-3-8B shapes;
# then batch-1 decode with XLA's Triton multi-output fusion switched on (does the residual add join the
# RMSNorm's fusion?).
# Usage on the GPU machine: bash benchmarks/h200_kmajor_gemv_run.sh "$OUT"
source "$(dirname "$0")/h200_setup.sh"
timeout 250 python3 benchmarks/kernels.py --skip-checks --trials 20 --sections gemv --gemv-rows 1 \
  --gemv-shapes 4096x14336,14336x4096,4096x28672,4096x6144,4096x4096,4096x128256 \
  --gemv-filter "K-major weights|kmajor gemv|pallas default" --out "$OUT" > "$OUT/kernels.txt" 2>&1
echo "kernels.py exit $?"
grep -E " us |ERROR" "$OUT/kernels.txt" | awk '!seen[$0]++' | sed -E 's/  +/ /g; s/w8a16 M=1 //; s/rel_err [0-9.e-]+ //; s/pallas kmajor gemv/km/' | cut -c1-110
mkdir -p "$OUT/mof"
XLA_FLAGS="--xla_gpu_unsupported_enable_triton_multi_output_fusion=true" \
timeout 150 python3 benchmarks/decode_latency.py --model-config llama3-8b \
  --variants bf16-b8,int8-auto-b8 --kernel-breakdown --out "$OUT/mof" > "$OUT/decode_mof.txt" 2>&1
echo "decode_latency.py (multi-output fusion) exit $?"; grep -E "ms/token|device time|speed-up|FAILED" "$OUT/decode_mof.txt" | cut -c1-150
sed -n '/int8-auto-b8/,$p' "$OUT/decode_mof.txt" | grep -A26 "launch order" | head -27
