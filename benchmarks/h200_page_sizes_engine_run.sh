#!/usr/bin/env bash
# One device call (2026-12-01, seventh session): the engine's greedy tokens and prompt logprobs with the
# Mosaic GPU and Triton attention at pages of 8 and 32 tokens, against attention_impl="reference".
# Usage on the GPU machine: bash benchmarks/h200_page_sizes_engine_run.sh "$OUT"
source "$(dirname "$0")/h200_setup.sh"
for p in 8 32; do
  timeout 150 python3 benchmarks/attention_engine_check.py --impls triton,mosaic --page-size $p --out "$OUT" > "$OUT/engine_check_p$p.txt" 2>&1
  echo "attention_engine_check.py --page-size $p exit $?"; grep -E "^(mosaic|triton)|Error" "$OUT/engine_check_p$p.txt" | cut -c1-300
done
