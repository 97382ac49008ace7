#!/usr/bin/env bash
# One device call (2026-12-02, fourteenth session): the engine's throughput on issue #3's nano-vllm
# workload (256 requests, 100-1024 tokens in and out) with today's defaults (Mosaic GPU attention,
# 2048-token steps), last measured in the first session (3,920 output tok/s, Triton attention,
# 512-token steps); then batch-1 decode in bf16 and int8, each in its own process; then the thirteenth
# session's prepared split_factor rows of the one-kernel-per-layer probe.
# Usage on the GPU machine: bash benchmarks/h200_throughput_recheck_run.sh "$OUT"
source "$(dirname "$0")/h200_setup.sh"
run throughput_2048 230 python3 benchmarks/offline_throughput.py --model-config llama3-8b --dtype bfloat16 \
  --max-num-seqs 256 --max-num-batched-tokens 2048 --latency-tokens 0 --out "$OUT/throughput_2048"
for v in bf16-b8 int8-auto-b8; do
  run "decode_$v" 110 python3 benchmarks/decode_latency.py --model-config llama3-8b --variants "$v" --tokens 64 --out "$OUT/decode_$v"
done
for r in mosaic-i8-layer mosaic-i8-layer-s2; do
  run "chain_$r" 90 python3 benchmarks/matmul_chain.py --variants "$r" --layers 16 --out "$OUT/chain_$r"
done
