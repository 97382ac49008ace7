#!/usr/bin/env bash
# One device call for issues #5 and #7: batch-1 decode of a Llama-3-8B-shaped model per W8A16
# variant (incl. the 1-token step bucket), the W8A16 kernel variants (int8 conversion by exponent
# bits, TF32 tensor-core dots, the GEMV path at 8 rows) and the decode-attention launch order at
# kernel level, then the MoE Pallas grouped matmul's decode-shape tile sweep.
# Usage on the GPU machine: bash benchmarks/h200_w8a16_run.sh "$OUT"
set -u
OUT=${1:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
timeout 230 python3 benchmarks/decode_latency.py --model-config llama3-8b \
  --variants bf16-b8,bf16-b1,int8-xla-b8,int8-xla-b1,int8-pallas-b1,int8-pallas-b1-magic,int8-pallas-b8-gemv8-magic,int8-pallas-b8-tf32-magic \
  --out "$OUT" > "$OUT/latency.txt" 2>&1
echo "decode_latency.py exit $?"; grep -E "ms/token|FAILED|speed-up|Error" "$OUT/latency.txt" | tail -20
timeout 200 python3 benchmarks/kernels.py --skip-checks --sections gemv,decode --out "$OUT" > "$OUT/kernels.txt" 2>&1
echo "kernels.py exit $?"; grep -v "^=== summary" "$OUT/kernels.txt" | grep -E " us |ERROR" | awk '!seen[$0]++' | head -80
mkdir -p "$OUT/moe"
timeout 120 python3 benchmarks/moe.py --sections decode_tiles --out "$OUT/moe" > "$OUT/moe/moe.txt" 2>&1
echo "moe.py exit $?"; grep "decode tiles" "$OUT/moe/moe.txt" | cut -c1-160
