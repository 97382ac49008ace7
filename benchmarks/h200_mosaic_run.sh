#!/usr/bin/env bash
# One device call (2026-12-01): the Mosaic GPU paged attention (paged_attention_mosaic.py) checked
# against the XLA reference on the kernel-test grid, then timed against the Triton kernel, JAX's
# bundled kernel and the copy roofline (benchmarks/kernels.py, CUPTI device time).
# Usage on the GPU machine: bash benchmarks/h200_mosaic_run.sh "$OUT"
source "$(dirname "$0")/h200_setup.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
timeout ${KERNELS_TIMEOUT:-330} python3 benchmarks/kernels.py --check-impls mosaic --skip-matmul-checks --trials 20 \
  --sections ${SECTIONS:-decode,prefill} --out "$OUT" > "$OUT/kernels.txt" 2>&1
echo "kernels.py exit $?"
grep -E "check attention|failed" "$OUT/kernels.txt" | cut -c1-400 | head -40
grep -E " us |ERROR" "$OUT/kernels.txt" | awk '!seen[$0]++' | cut -c1-260
# The engine with each attention kernel: greedy tokens and prompt logprobs against the reference.
timeout ${ENGINE_TIMEOUT:-150} python3 benchmarks/attention_engine_check.py --out "$OUT" > "$OUT/engine_check.txt" 2>&1
echo "attention_engine_check.py exit $?"; grep -E "identical|Error" "$OUT/engine_check.txt" | cut -c1-400
