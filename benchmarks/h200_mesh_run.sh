#!/usr/bin/env bash
# One device call on 2 H200s: tensor and expert parallelism with benchmarks/mesh_sweep.py (random bf16
# weights made on the GPUs, unrolled layers, decode at batch 1 and 64 with a 512-token context, TTFT =
# one prefill step of a 2048-token prompt, median of 5 steps after a compile call).
# Usage on the GPU machine: bash benchmarks/h200_mesh_run.sh "$OUT"     (BUDGET=350 s by default)
#
# Most important first; each run has its own timeout, cut to what is left of BUDGET (a run with
# < 45 s left is skipped). mesh_sweep.py rewrites its JSON after every timed step, so a run cut by
# its timeout keeps what it measured. Estimates (compile ~12 s per step shape for 40 unrolled
# layers, ~25 s for 80, a few s for the MoE models; ~20 s to start JAX; weights per GPU from
# param_shapes, KV pools for 64 x 512 tokens):
#   1. llama70b_l40      Llama-3-70B shape, 40 of 80 layers: tp=1 (72.7 GB weights + 5.4 GB KV)
#                        and tp=2 (36.3 + 2.7 GB per GPU); then tp=2 with collective matmul off and
#                        int8 all-reduce on (only the 4 step shapes whose collectives differ). ~150 s
#   2. deepseek_v3_l7    DeepSeek-V3 shape, 7 of 61 layers (3 dense + 4 MoE, 49.6B params): ep=1
#                        (99.3 GB), ep=2 (54.2 GB per GPU), tp=2 (49.7 GB per GPU). tp=2 collective
#                        matmul off first: on (only the TTFT step differs) it fails when tracing as
#                        of 2026-11-29 (MLA's replicated wkv_a sees the token-split input). ~80 s
#   3. llama70b_l80_tp2  Llama-3-70B shape, all 80 layers, tp=2 (70.6 GB weights + 2.7 GB KV per GPU). ~100 s
#   4. mixtral_l8        Mixtral-8x7B shape, 8 of 32 layers: ep=1 (23.7 GB), ep=2, tp=2 (~12 GB per GPU),
#                        as benchmarks/moe.py's step rows. Usually skipped for lack of budget. ~60 s
# Files in OUT: run.log (everything printed), gpu.txt, <run>.json for each run above.
source "$(dirname "$0")/h200_sweep_lib.sh" "${1:-}" 350  # OUT, BUDGET, T0; sweep NAME CAP ARGS..., sweep_summary

main() {
  source "$(dirname "$0")/h200_setup.sh" "$OUT"  # PYTHONUNBUFFERED, jlight installed from this tree
  export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92  # ~137 GB of each GPU for JAX (DeepSeek ep=1 needs ~100 GB)
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
  sweep llama70b_l40 170 --model-config llama3-70b --num-layers 40 --meshes tp=1 tp=2 \
    --collective-matmul 1 0 --int8-all-reduce 0 1
  sweep deepseek_v3_l7 120 --model-config deepseek-v3 --num-layers 7 --meshes ep=1 ep=2 tp=2 \
    --collective-matmul 0 1
  sweep llama70b_l80_tp2 120 --model-config llama3-70b --meshes tp=2
  sweep mixtral_l8 90 --model-config mixtral-8x7b --num-layers 8 --meshes ep=1 ep=2 tp=2
  sweep_summary
}

main 2>&1 | tee "$OUT/run.log"
