#!/usr/bin/env bash
# One device call for issue #5's int8-weight and decode-attention work: the W8A16 GEMV variants
# (weight tiles loaded ahead, launch knobs) and the decode-attention variants (KV heads launched
# next to each other; int8 pages converted by exponent bits) at kernel level, then batch-1 decode
# of a Llama-3-8B-shaped model per engine variant (incl. the 1-token step bucket).
# Usage on the GPU machine: bash benchmarks/h200_w8a16_run.sh "$OUT"
set -u
OUT=${1:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
timeout 210 python3 benchmarks/kernels.py --skip-checks --sections gemv,decode --out "$OUT" > "$OUT/kernels.txt" 2>&1
echo "kernels.py exit $?"; grep -v "^=== summary" "$OUT/kernels.txt" | grep -E " us |ERROR" | awk '!seen[$0]++' | cut -c1-150 | head -70
timeout 210 python3 benchmarks/decode_latency.py --model-config llama3-8b --out "$OUT" > "$OUT/latency.txt" 2>&1
echo "decode_latency.py exit $?"; grep -E "ms/token|FAILED|speed-up|Error" "$OUT/latency.txt" | tail -20
