#!/usr/bin/env bash
# Device calls (2026-12-02, thirteenth session): a decode layer's four matmuls back to back
# (benchmarks/matmul_chain.py), 16 layers of distinct weights, 8 rows: the fixed cost per matmul
# kernel, XLA against the Mosaic GPU W8A16 kernel with and without programmatic dependent launch.
# A row VARIANT:concat streams the same weights in one matmul per K instead (--concat).
# One process per row. Usage on the GPU machine: bash benchmarks/h200_matmul_chain_run.sh "$OUT" [ROW...]
source "$(dirname "$0")/h200_setup.sh"
shift || true
ROWS=("$@")
[ ${#ROWS[@]} -eq 0 ] && ROWS=(mosaic-i8-layer-nobarrier mosaic-i8-layer xla-int8 mosaic-i8)
for r in "${ROWS[@]}"; do
  v=${r%:concat}; extra=""; [ "$v" != "$r" ] && extra="--concat"
  start=$(date +%s)
  timeout 100 python3 benchmarks/matmul_chain.py --variants "$v" --layers 16 $extra --out "$OUT/${r/:/_}" > "$OUT/${r/:/_}.txt" 2>&1
  echo "== $r: exit $?, $(( $(date +%s) - start )) s"
  grep -vE "^\s*$|Warning|warn" "$OUT/${r/:/_}.txt" | tail -3 | cut -c1-300
done
