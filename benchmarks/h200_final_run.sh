#!/usr/bin/env bash
# One device call: engine throughput with the unrolled layer loop, the MoE benchmark and the
# load-time benchmark. Usage on the GPU machine: bash benchmarks/h200_final_run.sh "$OUT"
source "$(dirname "$0")/h200_setup.sh"
timeout 210 python3 benchmarks/offline_throughput.py --model-config llama3-8b --dtype bfloat16 --layer-loop unroll \
  --max-num-seqs 256 --max-num-batched-tokens 512 --latency-tokens 64 --out "$OUT" 2>&1 | grep -v "^compiling" | tee "$OUT/throughput.txt"
timeout 200 python3 benchmarks/moe.py --out "$OUT" 2>&1 | tail -30 | tee "$OUT/moe.txt"
timeout 140 python3 benchmarks/load_time.py --out "$OUT" --work-dir /tmp/loadtime --no-smollm2 2>&1 | tail -15 | tee "$OUT/load_time.txt"
