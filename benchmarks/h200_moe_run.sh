#!/usr/bin/env bash
# One device call for issue #7's open measurements: benchmarks/moe.py per model (the two together
# overran 250 s on 2026-11-29: Mixtral's sections took most of it), so each gets its own limit.
# Usage on the GPU machine: bash benchmarks/h200_moe_run.sh "$OUT"
source "$(dirname "$0")/h200_setup.sh"
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
for model in deepseek mixtral; do  # DeepSeek first: its prefill (ragged_dot OOM, Pallas untimed) is the open question
  mkdir -p "$OUT/$model"
  timeout 270 python3 benchmarks/moe.py --models "$model" --out "$OUT/$model" > "$OUT/$model/moe.txt" 2>&1
  echo "moe.py --models $model exit $?"
  sed -n '/^## /,$p' "$OUT/$model/moe.txt" | head -60
done
