#!/usr/bin/env bash
# One device call (eleventh session): int8 weights prefill 512-token steps at 1.33-1.48x bf16's time but
# 2048-token steps at 1.10x. Does 8B-shaped offline serving with int8 weights overtake bf16 when prefill
# runs in 2048-token steps (the engine's GPU default) instead of 512 (jlight batch's default)? The ninth
# session's setting otherwise (int8 1,962 and bf16 2,111 output tok/s at 512): 64 requests of 1024-1536
# prompt tokens and 256 output tokens, 32 sequences.
# Usage on the GPU machine: bash benchmarks/h200_prefill_chunk_run.sh "$OUT"
source "$(dirname "$0")/h200_setup.sh"
run() {  # name step-tokens extra-args...
  local name=$1 tokens=$2; shift 2
  timeout 150 python3 benchmarks/offline_throughput.py --model-config llama3-8b --dtype bfloat16 --layer-loop unroll \
    --num-requests 64 --input-len 1024 1536 --output-len 256 256 --max-num-seqs 32 --max-num-batched-tokens $tokens \
    --max-model-len 2048 --min-token-bucket 32 --latency-tokens 0 "$@" --out "$OUT/$name" > "$OUT/e2e_$name.txt" 2>&1
  echo "$name exit $? ($SECONDS s)"; grep -E "requests,|Error" "$OUT/e2e_$name.txt" | cut -c1-300
}
run int8_2048 2048 --quantization int8
run bf16_2048 2048
