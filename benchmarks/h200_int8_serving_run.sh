#!/usr/bin/env bash
# Prepared in the eleventh session, run in the twelfth (docs/BENCHMARKS.md: the kernel lost, 1,878 against XLA's
# 2,173 output tok/s). At 32 sequences int8 weights
# served 9% slower than bf16 (1,988 vs 2,181 output tok/s): XLA's int8 matmuls at 32 rows read no faster than
# bf16's. The Mosaic GPU W8A16 kernel with bf16 activations (no activation-split kernels, 2 programs per SM)
# beat XLA's int8 at 32 rows in isolation (ninth session: gate/up 44.5 vs 56.8 us, down 23.6 vs 28.1) but was
# never run in the engine. First its check and time at 16/32 rows, then serving: int8 through XLA, int8 with
# the kernel for decode steps of 9-32 rows, bf16. (The ninth session's int8-activation mode lost: 1,650 tok/s.)
# Usage on the GPU machine: bash benchmarks/h200_int8_serving_run.sh "$OUT"
source "$(dirname "$0")/h200_setup.sh"
timeout 100 python3 benchmarks/w8a16_mosaic.py --rows 16,32 --shapes 4096x6144,4096x4096,4096x28672,14336x4096 \
  --variants "tk256 s4 c2" --trials 10 --out "$OUT/micro" > "$OUT/micro.txt" 2>&1
echo "micro exit $?"; grep -E " us|rror" "$OUT/micro.txt" | cut -c1-150
run() {  # name extra-args...
  local name=$1; shift
  timeout 140 python3 benchmarks/offline_throughput.py --model-config llama3-8b --dtype bfloat16 --layer-loop unroll \
    --num-requests 64 --input-len 1024 1536 --output-len 256 256 --max-num-seqs 32 --max-num-batched-tokens 2048 \
    --max-model-len 2048 --min-token-bucket 32 --latency-tokens 0 "$@" --out "$OUT/$name" > "$OUT/e2e_$name.txt" 2>&1
  echo "$name exit $? ($SECONDS s)"; grep -E "requests,|Error" "$OUT/e2e_$name.txt" | cut -c1-300
}
run int8_mosaic_bf16 --quantization int8 --mosaic-w8a16-rows 32 --mosaic-w8a16-bf16 --mosaic-w8a16-ctas-per-sm 2
run int8_xla --quantization int8
run bf16
