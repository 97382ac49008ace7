#!/usr/bin/env bash
# One device call (2026-12-01, seventh session): the Mosaic GPU attention at KV page sizes 8, 32 and 64
# (paged_attention_mosaic.PAGE_SIZES widened for the run): the check grid against the XLA reference, then
# batch-64 decode at 4k context against the Triton kernel at the same page size.
# Usage on the GPU machine: bash benchmarks/h200_page_sizes_run.sh "$OUT"
source "$(dirname "$0")/h200_setup.sh"
timeout 330 python3 benchmarks/kernels.py --check-impls mosaic --skip-matmul-checks --trials 20 --sections decode \
  --decode-batches 64 --page-sizes 8,32,64 --mosaic-page-sizes 8,16,32,64 --out "$OUT" > "$OUT/kernels.txt" 2>&1
echo "kernels.py exit $?"
grep -E "^check attention" "$OUT/kernels.txt" | grep -v "written=True" | cut -c1-300 | head -20
echo "$(grep -c "^check attention.*written=True" "$OUT/kernels.txt") checks written; worst rel_err per page size:"
for p in 8 32 64; do grep -E "^check attention.* p$p " "$OUT/kernels.txt" | sed -E 's/.*rel_err=([0-9.e+-]+).*/\1/' | sort -g | tail -1; done
grep -E "failed|Error" "$OUT/kernels.txt" | head -5 | cut -c1-300
grep -E " us |ERROR" "$OUT/kernels.txt" | awk '!seen[$0]++' | sed -E 's/  +/ /g' | cut -c1-150
