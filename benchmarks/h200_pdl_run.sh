#!/usr/bin/env bash
# One device call (2026-12-01, tenth session): programmatic dependent launch (PDL) in batch-1 decode of
# the Llama-3-8B shape. One process per row, so no engine runs after another in its process (which
# slowed the host's dispatch in earlier sessions). Each row reports ms/token by the host clock, the
# device's back-to-back wall time per step and CUPTI's per-kernel sum. The int8 row also dumps XLA's
# PTX to count the fusions that use PDL (griddepcontrol).
# Usage on the GPU machine: bash benchmarks/h200_pdl_run.sh "$OUT" [ROW...]
source "$(dirname "$0")/h200_setup.sh"
shift || true
declare -A VARIANT=([bf16]=bf16-b8 [bf16_nopdl]=bf16-b8 [int8]=int8-auto-b8 [int8_nopdl]=int8-auto-b8
  [mosaic]=int8-auto-b8-mosaic-i8 [mosaic_pdl]=int8-auto-b8-mosaic-i8-pdl [mosaic_pdl_cb]=int8-auto-b8-mosaic-i8-pdl)
declare -A FLAGS=([bf16_nopdl]="--xla_gpu_enable_pdl=false" [int8]="--xla_dump_to=/tmp/dump_int8"
  [int8_nopdl]="--xla_gpu_enable_pdl=false" [mosaic_pdl_cb]="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUDNN,CUSTOM_CALL")
ROWS=("$@")
[ ${#ROWS[@]} -eq 0 ] && ROWS=(bf16 int8 int8_nopdl mosaic mosaic_pdl mosaic_pdl_cb)
for r in "${ROWS[@]}"; do
  start=$(date +%s)
  XLA_FLAGS="${FLAGS[$r]:-}" timeout 150 python3 benchmarks/decode_latency.py --model-config llama3-8b \
    --variants "${VARIANT[$r]}" --tokens 96 --kernel-breakdown --out "$OUT/$r" > "$OUT/$r.txt" 2>&1
  echo "== $r (${VARIANT[$r]}, ${FLAGS[$r]:-no flags}): exit $?, $(( $(date +%s) - start )) s"
  grep -E "ms/token|device time of one|back to back|Unknown|rror" "$OUT/$r.txt" | cut -c1-200 | head -8
done
if [ -d /tmp/dump_int8 ]; then
  echo "XLA PTX files: $(ls /tmp/dump_int8/*.ptx 2>/dev/null | wc -l); griddepcontrol.wait: $(cat /tmp/dump_int8/*.ptx 2>/dev/null | grep -c griddepcontrol.wait); launch_dependents: $(cat /tmp/dump_int8/*.ptx 2>/dev/null | grep -c griddepcontrol.launch_dependents)"
  ls /tmp/dump_int8 | head -5; ls /tmp/dump_int8 | wc -l
fi
