#!/usr/bin/env bash
# One device call (2026-12-02, fifteenth session): issue #3's nano-vllm workload (256 requests, 100-1024
# tokens in and out) with every step timed against its own roofline (offline_throughput.py --step-trace,
# step_trace.py), in bf16 and with the int8 KV cache, each in its own process: where the 15.6 ms/step
# of the fourteenth session goes (8,709 output tok/s against the issue's 10,000).
# Usage on the GPU machine: bash benchmarks/h200_step_trace_run.sh "$OUT"
source "$(dirname "$0")/h200_setup.sh"
for kv in auto int8; do
  run "trace_kv_$kv" 250 python3 benchmarks/offline_throughput.py --model-config llama3-8b --dtype bfloat16 \
    --max-num-seqs 256 --max-num-batched-tokens 2048 --latency-tokens 0 --kv-cache-dtype "$kv" --step-trace \
    --out "$OUT/trace_kv_$kv"
done
