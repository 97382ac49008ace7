#!/usr/bin/env bash
# One device call: kernel checks and launch-knob sweeps (benchmarks/kernels.py, CUPTI timing),
# then Llama-3-8B-shaped batch-1 decode latency: bf16 vs int8 weights through XLA's fused
# dequantize-dot vs the Pallas W8A16 GEMV (unrolled layer loop).
# Usage on the GPU machine: bash benchmarks/h200_kernels_run.sh "$OUT"
source "$(dirname "$0")/h200_setup.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
timeout 330 python3 benchmarks/kernels.py --out "$OUT" --trials 20 > "$OUT/kernels.txt" 2>&1
echo "kernels.py exit $?"; grep -v "^check" "$OUT/kernels.txt" | sed -n '/=== summary/,$p' | head -70
for variant in "bf16:none:auto" "int8-xla:int8:auto" "int8-pallas:int8:pallas"; do
  IFS=: read name quant mimpl <<< "$variant"
  q=""; [ "$quant" != none ] && q="--quantization $quant"
  echo "== $name"
  timeout 100 python3 benchmarks/offline_throughput.py --model-config llama3-8b --dtype bfloat16 $q --matmul-impl $mimpl \
    --layer-loop unroll --num-requests 0 --max-num-seqs 4 --max-num-batched-tokens 16 --latency-tokens 96 2>&1 \
    | grep -E "ready|decode|Error|error" | tee -a "$OUT/latency.txt"
done
