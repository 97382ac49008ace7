#!/usr/bin/env bash
# One device call for issue #5's int8-weight work: the W8A16 kernel variants and decode attention
# at kernel level (benchmarks/kernels.py), then batch-1 decode of a Llama-3-8B-shaped model per
# engine variant with each step's device time per kernel (benchmarks/decode_latency.py).
# Usage on the GPU machine: bash benchmarks/h200_w8a16_run.sh "$OUT"
source "$(dirname "$0")/h200_setup.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
timeout 210 python3 benchmarks/kernels.py --skip-checks --sections gemv,decode --out "$OUT" > "$OUT/kernels.txt" 2>&1
echo "kernels.py exit $?"; grep -v "^=== summary" "$OUT/kernels.txt" | grep -E " us |ERROR" | awk '!seen[$0]++' | cut -c1-150 | head -70
timeout 210 python3 benchmarks/decode_latency.py --model-config llama3-8b --kernel-breakdown --out "$OUT" > "$OUT/latency.txt" 2>&1
echo "decode_latency.py exit $?"; grep -vE "^(W|I)1" "$OUT/latency.txt" | tail -60
