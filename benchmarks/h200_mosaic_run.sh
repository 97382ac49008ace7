#!/usr/bin/env bash
# One device call (2026-12-01): the Mosaic GPU paged attention (paged_attention_mosaic.py)
#  1. checked against the XLA reference on the kernel-test grid, then timed against the Triton
#     kernel, JAX's bundled kernel and the copy roofline (benchmarks/kernels.py, CUPTI device time);
#  2. inside the engine: greedy tokens and prompt logprobs against the reference (attention_engine_check.py);
#  3. end to end: offline throughput of the Llama-3-8B shape (bf16, random weights) with each kernel.
# Usage on the GPU machine: bash benchmarks/h200_mosaic_run.sh "$OUT"
source "$(dirname "$0")/h200_setup.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
timeout ${KERNELS_TIMEOUT:-240} python3 benchmarks/kernels.py --check-impls mosaic --skip-matmul-checks --trials 20 \
  --sections ${SECTIONS:-decode,prefill} --decode-batches 64,8 --out "$OUT" > "$OUT/kernels.txt" 2>&1
echo "kernels.py exit $?"
grep -E "check attention" "$OUT/kernels.txt" | grep -v "written=True" | cut -c1-300 | head -20
echo "$(grep -c "written=True" "$OUT/kernels.txt") checks passed"
grep -E " us |ERROR" "$OUT/kernels.txt" | awk '!seen[$0]++' | cut -c1-200
timeout ${ENGINE_TIMEOUT:-120} python3 benchmarks/attention_engine_check.py --out "$OUT" > "$OUT/engine_check.txt" 2>&1
echo "attention_engine_check.py exit $?"; grep -E "identical|Error" "$OUT/engine_check.txt" | cut -c1-300
for impl in ${E2E_IMPLS:-triton mosaic}; do
  timeout ${E2E_TIMEOUT:-130} python3 benchmarks/offline_throughput.py --model-config llama3-8b --dtype bfloat16 \
    --layer-loop unroll --attention-impl $impl --num-requests 64 --input-len 1536 2048 --output-len 256 256 \
    --max-num-seqs 64 --max-model-len 4096 --min-token-bucket 64 --latency-tokens 0 --out "$OUT" > "$OUT/e2e_$impl.txt" 2>&1
  echo "e2e $impl exit $?"; grep -E "engine ready|requests,|per-step|Error" "$OUT/e2e_$impl.txt" | cut -c1-300
done
