#!/usr/bin/env bash
# One device call on 4 H200s (nvidia-h200-x4): tensor parallelism at tp=4 and expert parallelism at
# ep=4 with benchmarks/mesh_sweep.py (random bf16 weights made on the GPUs, unrolled layers, decode at
# batch 1 and 64 with a 512-token context, TTFT = one prefill step of a 2048-token prompt, median of 5
# steps after a compile call). The 2-GPU counterpart is h200_mesh_run.sh; both use h200_sweep_lib.sh.
# Usage on the GPU machine: bash benchmarks/h200_x4_run.sh "$OUT"     (BUDGET=440 s by default)
#
# Most important first; each run has its own timeout, cut to what is left of BUDGET (a run with
# < 45 s left is skipped). Estimates from the 2-GPU run (compile ~8-13 s per step shape for 40
# unrolled layers, ~27 s for the collective-matmul prefill; ~20 s / ~55 s for 80 layers; a few s
# for DeepSeek's 7 layers, whose 2048-token prefill takes ~0.5-0.8 s a step):
#   1. llama70b_l40_x4   Llama-3-70B shape, 40 of 80 layers, tp=4 (18.2 GB weights + 1.3 GB KV per GPU)
#                        with every comm variant (collective matmul on/off x int8 all-reduce off/on),
#                        then tp=1 (72.7 + 5.4 GB) and tp=2 (36.3 + 2.7 GB): tp scaling on one layer
#                        count in one run. tp=4 first so that the cap cuts tp=2's variants (measured in
#                        the 2-GPU run), not the new mesh. ~200 s
#   2. llama70b_l80_tp4  all 80 layers at tp=4 (35.3 GB weights + 2.7 GB KV per GPU), the default comm
#                        (collective matmul on, int8 all-reduce off) only: the variants are run 1's. ~120 s
#   3. deepseek_v3_l7_x4 DeepSeek-V3 shape, 7 of 61 layers (3 dense + 4 MoE, 49.6B params, as the 2-GPU
#                        run's rows): ep=4 (~32 GB per GPU), tp=4 (~25 GB), tp=2,ep=2, collective matmul
#                        off then on. Gets what is left of the budget (~100 s).
# Files in OUT: run.log (everything printed), gpu.txt, <run>.json for each run above.
source "$(dirname "$0")/h200_sweep_lib.sh" "${1:-}" 440  # OUT, BUDGET, T0; sweep NAME CAP ARGS..., sweep_summary

speedups() {  # batch-1 / batch-64 decode and TTFT of each tp over tp=1, from run 1's JSON
  python3 - "$OUT/llama70b_l40_x4.json" <<'PYEOF'
import json, os, sys
if not os.path.exists(sys.argv[1]):
    sys.exit()
rows = {r["label"]: r for r in json.load(open(sys.argv[1]))["results"] if "error" not in r}
base = rows.get("tp=1")
print("== speed-up over tp=1, 40 layers (host-timed / pipelined)")
for label, r in rows.items():
    if base is None or label == "tp=1":
        continue
    cells = []
    for step in ("decode_b1", "decode_b64", "ttft_2048"):
        if f"{step}_ms" in r and f"{step}_ms" in base:
            cells.append(f"{step} {base[step + '_ms'] / r[step + '_ms']:.2f}x / "
                         f"{base[step + '_pipelined_ms'] / r[step + '_pipelined_ms']:.2f}x")
    print(f"  {label:<16} " + "  ".join(cells))
PYEOF
}

main() {
  source "$(dirname "$0")/h200_setup.sh" "$OUT"  # PYTHONUNBUFFERED, jlight installed from this tree
  export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92  # ~137 GB of each GPU for JAX (tp=1 on 40 layers needs ~78 GB)
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
  sweep llama70b_l40_x4 200 --model-config llama3-70b --num-layers 40 --meshes tp=4 tp=1 tp=2 \
    --collective-matmul 1 0 --int8-all-reduce 0 1
  sweep llama70b_l80_tp4 140 --model-config llama3-70b --meshes tp=4
  sweep deepseek_v3_l7_x4 120 --model-config deepseek-v3 --num-layers 7 --meshes ep=4 tp=4 "tp=2,ep=2" \
    --collective-matmul 0 1
  sweep_summary
  speedups
}

main 2>&1 | tee "$OUT/run.log"
