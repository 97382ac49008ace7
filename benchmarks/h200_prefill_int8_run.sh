#!/usr/bin/env bash
# One device call (eleventh session): why do int8 weights make prefill slower than bf16 (tenth-session
# call: a 512-token step 22.68 ms with int8 against 15.37 with bf16), and does converting the weights
# apart and then running cuBLAS's dot (matmul_reference.dequantize_first_matmul) fix it?
# 1. the matmuls of the Llama-3-8B shape at 128, 512 and 2048 rows: XLA bf16, XLA's fused int8
#    dequantize-dot (K-major, the default), dequantize first, the fusion on [in, out] weights;
# 2. the same fusion at 512 rows with XLA's exhaustive tiling search;
# 3. engine steps of 32-2048 prefill tokens, bf16, int8 and int8 with dequantize-first from 16 rows.
# Usage on the GPU machine: bash benchmarks/h200_prefill_int8_run.sh "$OUT"
source "$(dirname "$0")/h200_setup.sh"
SHAPES=4096x6144,4096x4096,4096x28672,14336x4096
timeout 200 python3 benchmarks/w8a16_mosaic.py --rows 128,512,2048 --shapes $SHAPES --variants none --xla-layouts \
  --trials 10 --out "$OUT/micro" > "$OUT/micro.txt" 2>&1
echo "micro exit $?"; grep -E " us|rror" "$OUT/micro.txt" | cut -c1-140
XLA_FLAGS=--xla_gpu_exhaustive_tiling_search=true timeout 90 python3 benchmarks/w8a16_mosaic.py --rows 512 \
  --shapes 4096x28672,14336x4096 --variants none --trials 10 --out "$OUT/exhaustive" > "$OUT/exhaustive.txt" 2>&1
echo "exhaustive exit $?"; grep -E " us|rror" "$OUT/exhaustive.txt" | cut -c1-140
for v in int8-auto-b8 int8-auto-b8-dqf bf16-b8; do
  start=$(date +%s)
  timeout 110 python3 benchmarks/decode_latency.py --model-config llama3-8b --variants "$v" --tokens 48 \
    --step-tokens 32,64,128,256,512,1024,2048 --out "$OUT/$v" > "$OUT/$v.txt" 2>&1
  echo "== $v: exit $?, $(( $(date +%s) - start )) s"
  grep -E "ms/token|back to back|rror" "$OUT/$v.txt" | cut -c1-260 | head -5
done
