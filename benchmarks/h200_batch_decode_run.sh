#!/usr/bin/env bash
# Device call (2026-12-02, fourteenth session): large-batch decode steps (benchmarks/batch_decode_profile.py),
# the engine's sampler against a plain argmax and against XLA without CUB sorts, to find why the host
# waits inside the jitted call at these batches. One process per row.
# Usage on the GPU machine: bash benchmarks/h200_batch_decode_run.sh "$OUT" [ROW...]
source "$(dirname "$0")/h200_setup.sh"
shift || true
declare -A ARGS=([b64]="--batches 64" [b64_argmax]="--batches 64 --sampler argmax" [b64_nocub]="--batches 64"
  [b64_greedy]="--batches 64 --temperature 0" [b256]="--batches 256" [b256_argmax]="--batches 256 --sampler argmax")
declare -A FLAGS=([b64_nocub]="--xla_gpu_enable_cub_radix_sort=false")
ROWS=("$@")
[ ${#ROWS[@]} -eq 0 ] && ROWS=(b64 b64_argmax b64_nocub b256)
for r in "${ROWS[@]}"; do
  start=$(date +%s)
  XLA_FLAGS="${FLAGS[$r]:-}" timeout 150 python3 benchmarks/batch_decode_profile.py --model-config llama3-8b --context 1024 \
    ${ARGS[$r]} --out "$OUT/$r" > "$OUT/$r.txt" 2>&1
  echo "== $r (${ARGS[$r]} ${FLAGS[$r]:-}): exit $?, $(( $(date +%s) - start )) s"
  grep -E "^B=|rror" "$OUT/$r.txt" | cut -c1-300 | tail -4
done
