#!/usr/bin/env bash
# One device call (2026-12-02, thirteenth session): a decode layer's four matmuls back to back
# (benchmarks/matmul_chain.py), 16 layers of distinct weights, 8 rows: the fixed cost per matmul
# kernel, XLA against the Mosaic GPU W8A16 kernel with and without programmatic dependent launch.
# One process per variant. Usage on the GPU machine: bash benchmarks/h200_matmul_chain_run.sh "$OUT" [VARIANT...]
source "$(dirname "$0")/h200_setup.sh"
shift || true
VARIANTS=("$@")
[ ${#VARIANTS[@]} -eq 0 ] && VARIANTS=(xla-bf16 xla-int8 mosaic-i8 mosaic-i8-pdl mosaic-bf16-c2 mosaic-bf16-c2-pdl)
for v in "${VARIANTS[@]}"; do
  start=$(date +%s)
  timeout 100 python3 benchmarks/matmul_chain.py --variants "$v" --layers 16 --out "$OUT/$v" > "$OUT/$v.txt" 2>&1
  echo "== $v: exit $?, $(( $(date +%s) - start )) s"
  grep -vE "^\s*$|Warning|warn" "$OUT/$v.txt" | tail -3 | cut -c1-300
done
