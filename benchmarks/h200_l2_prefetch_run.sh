#!/usr/bin/env bash
# One device call (written 2026-12-01, tenth session, for the next one with a GPU): does the L2 prefetch
# hint (pallas_kernels/l2_prefetch.py) pay? First the matmul after small kernels, cold / prefetched / hot
# (benchmarks/l2_prefetch.py); then batch-1 decode of the Llama-3-8B shape with and without it, one
# process per row (as h200_pdl_run.sh), and a check that the greedy tokens did not change. Every row also
# times prefill steps of 32, 128 and 512 tokens (--step-tokens; the prefetch skips steps of more than 64): at which rows
# do int8 weights stop paying? (int8 served slower than bf16 at 32 sequences in the ninth session.)
# Usage on the GPU machine: bash benchmarks/h200_l2_prefetch_run.sh "$OUT"
source "$(dirname "$0")/h200_setup.sh"
timeout 150 python3 benchmarks/l2_prefetch.py --out "$OUT/micro" > "$OUT/micro.txt" 2>&1
echo "l2_prefetch.py exit $?"; grep -E " us|rror" "$OUT/micro.txt" | cut -c1-160
for v in int8-auto-b8 int8-auto-b8-l2 bf16-b8 bf16-b8-l2; do
  start=$(date +%s)
  timeout 100 python3 benchmarks/decode_latency.py --model-config llama3-8b --variants "$v" --tokens 96 \
    --kernel-breakdown --step-tokens 32,128,512 --out "$OUT/$v" > "$OUT/$v.txt" 2>&1
  echo "== $v: exit $?, $(( $(date +%s) - start )) s"
  grep -E "ms/token|device time of one|back to back|rror" "$OUT/$v.txt" | cut -c1-220 | head -7
done
python3 - "$OUT" <<'PY'
import json, sys
tokens = {}
for v in ("int8-auto-b8", "int8-auto-b8-l2", "bf16-b8", "bf16-b8-l2"):
    try:
        tokens[v] = json.load(open(f"{sys.argv[1]}/{v}/decode_latency.json"))["variants"][v]["greedy_tokens"]
    except Exception as e:  # noqa: BLE001
        tokens[v] = repr(e)
for base in ("int8-auto-b8", "bf16-b8"):
    print(f"greedy tokens {base} vs {base}-l2:", "identical" if tokens[base] == tokens[base + "-l2"] else "DIFFERENT")
PY
