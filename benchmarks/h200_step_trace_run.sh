#!/usr/bin/env bash
# One device call (2026-12-02, fifteenth session): issue #3's nano-vllm workload (256 requests, 100-1024
# tokens in and out) with every step timed against its own roofline (offline_throughput.py --step-trace,
# step_trace.py), in bf16 and with the int8 KV cache, each in its own process: where the 15.6 ms/step
# of the fourteenth session goes (8,709 output tok/s against the issue's 10,000).
# Usage on the GPU machine: bash benchmarks/h200_step_trace_run.sh "$OUT"
source "$(dirname "$0")/h200_setup.sh"
run() {  # NAME TIMEOUT COMMAND...: the command's output to $OUT/NAME.txt, a few lines of it here
  local name=$1 limit=$2; shift 2
  local start=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  echo "== $name: exit $?, $(( $(date +%s) - start )) s"
  grep -vE "^compiling|Warning|warn|^\s*$" "$OUT/$name.txt" | tail -14 | cut -c1-240
}
for kv in auto int8; do
  run "trace_kv_$kv" 250 python3 benchmarks/offline_throughput.py --model-config llama3-8b --dtype bfloat16 \
    --max-num-seqs 256 --max-num-batched-tokens 2048 --latency-tokens 0 --kv-cache-dtype "$kv" --step-trace \
    --out "$OUT/trace_kv_$kv"
done
