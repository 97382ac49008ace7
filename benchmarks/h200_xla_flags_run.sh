#!/usr/bin/env bash
# One device call (2026-12-01, eighth session): batch-1 decode of the Llama-3-8B shape (bf16 and int8,
# the engine's default 8-token bucket) under XLA flags that might shorten the ~0.7 ms of small kernels
# (programmatic dependent launch, concurrent regions in the CUDA graph) or speed up the int8
# dequantize-dot fusions (exhaustive tiling search, TMA in XLA's Triton gemms). One process per setting,
# so an unknown flag costs only its own row.
# Usage on the GPU machine: [VARIANTS=int8-auto-b8] bash benchmarks/h200_xla_flags_run.sh "$OUT" [SETTING...]
source "$(dirname "$0")/h200_setup.sh"
shift || true
declare -A FLAGS=(
  [baseline]=""
  [pdl]="--xla_gpu_enable_pdl=true"
  [concurrent]="--xla_gpu_graph_enable_concurrent_region=true"
  [exhaustive]="--xla_gpu_exhaustive_tiling_search=true"
  [tma]="--xla_gpu_experimental_enable_triton_tma=true"
  [pdl_concurrent]="--xla_gpu_enable_pdl=true --xla_gpu_graph_enable_concurrent_region=true"
  [tma_ws]="--xla_gpu_experimental_enable_triton_tma=true --xla_gpu_experimental_enable_triton_warp_specialization=true"
  [tma_exhaustive]="--xla_gpu_experimental_enable_triton_tma=true --xla_gpu_exhaustive_tiling_search=true"
  # twelfth session: might XLA's fusion heuristics merge the residual add into the RMSNorm's kernel?
  [heroless]="--xla_gpu_experimental_enable_triton_heroless_priority_fusion=true"
  [all_triton]="--xla_gpu_experimental_all_fusions_with_triton=true"
)
SETTINGS=("$@")
[ ${#SETTINGS[@]} -eq 0 ] && SETTINGS=(baseline pdl concurrent exhaustive)
for s in "${SETTINGS[@]}"; do
  start=$(date +%s)
  XLA_FLAGS="${FLAGS[$s]}" timeout 170 python3 benchmarks/decode_latency.py --model-config llama3-8b \
    --variants ${VARIANTS:-bf16-b8,int8-auto-b8} --tokens 64 --kernel-breakdown --out "$OUT/$s" > "$OUT/$s.txt" 2>&1
  echo "== $s (${FLAGS[$s]:-no flags}): exit $?, $(( $(date +%s) - start )) s"
  grep -E "^== |ms/token|device time of one|dispatch one|Unknown|rror" "$OUT/$s.txt" | cut -c1-160 | head -12
done
