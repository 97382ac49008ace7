#!/usr/bin/env bash
# One device call on 2 H200s: (1) W8A16 at M=1 and M=8 against JAX's bundled Mosaic GPU mixed-type
# matmul; (2) the engine itself at tp=1 and tp=2 (unrolled layers under a mesh), batch-1 decode of a
# Llama-3-8B-shaped model; (3) DeepSeek-V3 shape at tp=2 with collective matmul on, 2048-token prefill
# (the MLA sequence-parallel fix). Usage on the GPU machine: bash benchmarks/h200_final_x2_run.sh "$OUT"
source "$(dirname "$0")/h200_setup.sh"
timeout 110 python3 benchmarks/kernels.py --skip-checks --sections gemv --gemv-shapes 4096x14336,4096x28672 \
  --gemv-rows 1,8 --out "$OUT" > "$OUT/kernels.txt" 2>&1
echo "kernels.py exit $?"; grep -E " us |ERROR" "$OUT/kernels.txt" | grep -vE "split|bn(32|64)|cvt" | awk '!seen[$0]++' | cut -c1-200 | head -30
for mesh in none tp=2; do
  arg=(); [ "$mesh" != none ] && arg=(--mesh "$mesh")
  dir="$OUT/engine_${mesh/=/}"  # no '=' in names that come back
  timeout 130 python3 benchmarks/offline_throughput.py --model-config llama3-8b --dtype bfloat16 --num-requests 0 \
    --latency-tokens 96 --max-num-seqs 8 --max-num-batched-tokens 64 --max-model-len 1024 "${arg[@]}" \
    --out "$dir" > "/tmp/engine_$mesh.txt" 2>&1
  echo "== engine mesh=$mesh exit $?"; grep -E "ready|decode|rror" "/tmp/engine_$mesh.txt" | tail -3
done
timeout 90 python3 benchmarks/mesh_sweep.py --model-config deepseek-v3 --num-layers 5 --meshes tp=2 --steps ttft \
  --collective-matmul 1 --layer-loop unroll --trials 3 --plot 0 --name deepseek_tp2_cm --out "$OUT" > /tmp/ds.txt 2>&1
echo "== deepseek tp=2 cm=1 exit $?"; grep -E "ttft|FAILED|rror" /tmp/ds.txt | tail -4
