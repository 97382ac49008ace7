#!/usr/bin/env bash
# One device call (2026-12-01, seventh session): the K-major W8A16 kernel (matmul_pallas.w8a16_kmajor_matmul)
# against XLA's dequantize-dot at the Llama-3-8B decode shapes (1 and 8 rows), then batch-1 decode with
# it in the engine, with every kernel of one step listed and the step's optimized HLO kept.
# Usage on the GPU machine: bash benchmarks/h200_kmajor_run.sh "$OUT"
source "$(dirname "$0")/h200_setup.sh"
timeout 260 python3 benchmarks/kernels.py --skip-checks --trials 20 --sections gemv --gemv-rows 1,8 \
  --gemv-shapes 4096x14336,4096x6144,4096x4096,14336x4096,4096x28672 --gemv-filter "xla|kmajor|pallas default" \
  --out "$OUT" > "$OUT/kernels.txt" 2>&1
echo "kernels.py exit $?"
grep -E " us |ERROR" "$OUT/kernels.txt" | awk '!seen[$0]++' | sed -E 's/  +/ /g' | cut -c1-120
XLA_FLAGS="--xla_dump_to=$OUT/hlo --xla_dump_hlo_module_re=.*packed_step.* --xla_dump_hlo_as_text" \
timeout 240 python3 benchmarks/decode_latency.py --model-config llama3-8b \
  --variants bf16-b8,int8-auto-b8,int8-auto-b8-pkm,int8-auto-b1-pkm --kernel-breakdown --out "$OUT" > "$OUT/decode.txt" 2>&1
echo "decode_latency.py exit $?"; grep -E "ms/token|device time|speed-up|FAILED" "$OUT/decode.txt" | cut -c1-150
find "$OUT/hlo" -type f ! -name "*after_optimizations.txt" -delete 2>/dev/null; gzip -r "$OUT/hlo" 2>/dev/null; du -sh "$OUT"/hlo
