#!/usr/bin/env bash
# One device call (eleventh session): int8 weights made prefill slower than bf16 (a 512-token step
# 22.68 against 15.37 ms; XLA's fused dequantize-dot at 512 x 4096 x 28672: 264 against 180 us).
# 1. the Pallas W8A16 kernel for many rows (matmul_pallas.w8a16_rows_matmul), a tile sweep at 512 and
#    2048 rows of the Llama-3-8B shape, against XLA's bf16 dot and int8 dequantize-dot;
# 2. engine prefill steps of 512 and 2048 tokens: int8 (XLA), int8 with the kernel from 128 rows at the
#    sweep's best tiles (summed over the shapes at 512 rows), bf16.
# Usage on the GPU machine: bash benchmarks/h200_rows_kernel_run.sh "$OUT"
source "$(dirname "$0")/h200_setup.sh"
timeout 230 python3 benchmarks/w8a16_mosaic.py --rows 512,2048 --shapes 4096x6144,4096x4096,4096x28672,14336x4096 \
  --variants none --rows-tiles sweep --trials 10 --out "$OUT/micro" > "$OUT/micro.txt" 2>&1
echo "micro exit $?"
BEST=$(python3 - "$OUT/micro/w8a16_mosaic.json" <<'PY'
import collections, json, sys
try:
    rows = json.load(open(sys.argv[1]))["rows"]
except Exception:  # noqa: BLE001
    rows = []
total = collections.defaultdict(float)
count = collections.Counter()
for r in rows:
    if r["impl"].startswith("pallas rows") and r["shape"].startswith("512x") and "us" in r:
        total[r["impl"]] += r["us"]; count[r["impl"]] += 1
full = [i for i in total if count[i] == max(count.values())]
best = min(full, key=total.get) if full else None
bm, bn, bk = (int(v) for v in best.split()[2].split("x")) if best else (128, 128, 64)
warps, stages = (int(best.split()[3][1:]), int(best.split()[4][1:])) if best else (4, 4)
print(json.dumps(dict(rows=dict(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages))))
PY
)
echo "best tiles at 512 rows: $BEST"
for v in int8-auto-b8-rows int8-auto-b8 bf16-b8; do
  start=$(date +%s)
  timeout 110 python3 benchmarks/decode_latency.py --model-config llama3-8b --variants "$v" --tokens 16 \
    --step-tokens 512,2048 --w8a16-options "$BEST" --out "$OUT/$v" > "$OUT/$v.txt" 2>&1
  echo "== $v: exit $?, $(( $(date +%s) - start )) s"
  grep -E "ms/token|prefill step|rror" "$OUT/$v.txt" | cut -c1-260 | head -4
done
