#!/usr/bin/env bash
# One device call: the MoE benchmark (dense / ragged_dot / Pallas grouped / gathered experts),
# the W8A16 GEMV conversion variants, and the int8 KV cache in the Pallas decode attention.
# Usage on the GPU machine: bash benchmarks/h200_moe_kv_run.sh "$OUT"
source "$(dirname "$0")/h200_setup.sh"
mkdir -p "$OUT/moe" "$OUT/gemv" "$OUT/kv"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 timeout 250 python3 benchmarks/moe.py --out "$OUT/moe" > "$OUT/moe/moe.txt" 2>&1
echo "moe.py exit $?"
timeout 100 python3 benchmarks/kernels.py --skip-checks --sections gemv --out "$OUT/gemv" --trials 20 > "$OUT/gemv/gemv.txt" 2>&1
echo "kernels.py gemv exit $?"; sed -n '/=== summary/,$p' "$OUT/gemv/gemv.txt" | grep -v "^copy"
timeout 120 python3 benchmarks/kv_int8_attention.py --out "$OUT/kv" > "$OUT/kv/kv.txt" 2>&1
echo "kv_int8_attention.py exit $?"; grep -v "^check" "$OUT/kv/kv.txt" | tail -25
echo "== moe summary"; sed -n '/^## /,$p' "$OUT/moe/moe.txt" | head -90
