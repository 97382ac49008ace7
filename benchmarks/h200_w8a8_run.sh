#!/usr/bin/env bash
# One device call (2026-11-29, fifth session): (1) W8A8 on K-major weights against XLA's int8 dot
# at prefill and decode row counts, and the W8A16 GEMV split-K rule (benchmarks/kernels.py);
# (2) prefill throughput of the Llama-3-8B shape through the engine: bf16, W8A8 on the Pallas
# kernel (the default on GPU), W8A8 on XLA's int8 dot, fp8 on the kernel (16 prompts of 2048 tokens, 1 output
# token each, 2048-token steps); (3) batch-1 decode latency with the packed step inputs and the
# host's dispatch breakdown (benchmarks/decode_latency.py).
# Usage on the GPU machine: bash benchmarks/h200_w8a8_run.sh "$OUT"
source "$(dirname "$0")/h200_setup.sh"
timeout 140 python3 benchmarks/kernels.py --skip-checks --trials 20 --sections gemm,gemv --gemm-rows 4096,512,64,8 \
  --gemv-shapes 14336x4096,4096x6144 --gemv-rows 1 --gemv-splits 4,6,8,9 --out "$OUT" > "$OUT/kernels.txt" 2>&1
echo "kernels.py exit $?"; grep -E " us |ERROR" "$OUT/kernels.txt" | grep -v "^copy" | awk '!seen[$0]++' | cut -c1-200
for variant in "bf16:none:auto" "w8a8-pallas:w8a8:auto" "w8a8-xla:w8a8:reference" "fp8-pallas:fp8:auto"; do
  IFS=: read name quant mimpl <<< "$variant"
  q=(); [ "$quant" != none ] && q=(--quantization "$quant")
  timeout 80 python3 benchmarks/offline_throughput.py --model-config llama3-8b --dtype bfloat16 "${q[@]}" --matmul-impl "$mimpl" \
    --layer-loop unroll --num-requests 16 --input-len 2048 2048 --output-len 1 1 --max-num-seqs 16 \
    --max-num-batched-tokens 2048 --min-token-bucket 1024 --max-model-len 4096 --latency-tokens 0 --out "$OUT/prefill_$name" \
    > "/tmp/prefill_$name.txt" 2>&1
  echo "== prefill $name exit $?"; grep -E "ready|requests|rror" "/tmp/prefill_$name.txt" | tail -3
done
timeout ${DECODE_TIMEOUT:-120} python3 benchmarks/decode_latency.py --model-config llama3-8b --variants bf16-b8,int8-xla-b8 \
  --out "$OUT" > "$OUT/decode.txt" 2>&1
echo "decode_latency.py exit $?"; grep -vE "^\s*$" "$OUT/decode.txt" | tail -20
