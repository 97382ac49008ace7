#!/usr/bin/env bash
# One device call (2026-12-01, last): the Mosaic GPU attention with token-major outputs (no gather
# for decode): kernel checks and timings (kernels.py), batch-1 decode of the Llama-3-8B shape in
# bf16 and int8 with either attention kernel (decode_latency.py), and the engine check.
# Usage on the GPU machine: bash benchmarks/h200_mosaic_final_run.sh "$OUT"
source "$(dirname "$0")/h200_setup.sh"
timeout 200 python3 benchmarks/kernels.py --check-impls mosaic --skip-matmul-checks --trials 20 \
  --sections decode,prefill --decode-batches 64,8 --out "$OUT" > "$OUT/kernels.txt" 2>&1
echo "kernels.py exit $?"
grep -E "check attention" "$OUT/kernels.txt" | grep -v "written=True" | cut -c1-300 | head -20
echo "$(grep -c "written=True" "$OUT/kernels.txt") checks passed"
grep -E " us |ERROR" "$OUT/kernels.txt" | awk '!seen[$0]++' | cut -c1-170
timeout 200 python3 benchmarks/decode_latency.py --model-config llama3-8b \
  --variants bf16-b8,int8-auto-b8,bf16-b8-triton,int8-auto-b8-triton --kernel-breakdown --out "$OUT" > "$OUT/decode.txt" 2>&1
echo "decode_latency.py exit $?"; grep -E "ms/token|device time|speed-up|mosaic|paged_attention|gather|select|FAILED" "$OUT/decode.txt" | cut -c1-150
timeout 100 python3 benchmarks/attention_engine_check.py --out "$OUT" > "$OUT/engine_check.txt" 2>&1
echo "attention_engine_check.py exit $?"; grep -E "^(mosaic|triton)|Error" "$OUT/engine_check.txt" | cut -c1-300
