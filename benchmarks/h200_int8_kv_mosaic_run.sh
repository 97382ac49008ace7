#!/usr/bin/env bash
# One device call (2026-12-01, eighth session): the Mosaic GPU attention on int8 KV pools (pages of 32)
# against the Triton kernel (pages of 16 and 32) and the bf16 pools: the check grid against the XLA
# reference on the same int8 pools, decode at B=64 and 4k context, a 4096-token prefill; then the
# engine's greedy tokens with int8 pages through each kernel against attention_impl="reference".
# Usage on the GPU machine: bash benchmarks/h200_int8_kv_mosaic_run.sh "$OUT"
source "$(dirname "$0")/h200_setup.sh"
timeout 330 python3 benchmarks/kv_int8_attention.py --impls triton,mosaic --page-sizes 16,32 --out "$OUT" > "$OUT/kv_int8.txt" 2>&1
echo "kv_int8_attention.py exit $?"
grep -E "checks:|FAILED|us |ERROR" "$OUT/kv_int8.txt" | sed -E 's/  +/ /g' | cut -c1-170
timeout 200 python3 benchmarks/attention_engine_check.py --kv-cache-dtype int8 --page-size 32 --out "$OUT" > "$OUT/engine_check.txt" 2>&1
echo "attention_engine_check.py exit $?"; grep -E "identical|Error" "$OUT/engine_check.txt" | cut -c1-300
