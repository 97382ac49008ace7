#!/usr/bin/env bash
# One device call: engine throughput with the unrolled layer loop, the MoE benchmark and the
# load-time benchmark. Usage on the GPU machine: bash benchmarks/h200_final_run.sh "$OUT"
set -u
OUT=${1:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
timeout 210 python3 benchmarks/offline_throughput.py --model-config llama3-8b --dtype bfloat16 --layer-loop unroll \
  --max-num-seqs 256 --max-num-batched-tokens 512 --latency-tokens 64 --out "$OUT" 2>&1 | grep -v "^compiling" | tee "$OUT/throughput.txt"
timeout 200 python3 benchmarks/moe.py --out "$OUT" 2>&1 | tail -30 | tee "$OUT/moe.txt"
timeout 140 python3 benchmarks/load_time.py --out "$OUT" --work-dir /tmp/loadtime --no-smollm2 2>&1 | tail -15 | tee "$OUT/load_time.txt"
