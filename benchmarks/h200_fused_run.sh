#!/usr/bin/env bash
# One device call: batch-1 decode of a Llama-3-8B-shaped model with fused q/k/v and gate/up
# projections (the default since 2026-11-29's fourth session) against separate ones ("-sep"), with
# each step's device time per kernel (benchmarks/decode_latency.py); an XLA dump of the step
# executables (why a 1-token step takes the host 9-13 ms to dispatch, against 2.9 ms at 8 tokens);
# and the same two buckets with XLA's command buffers (CUDA graphs) turned off.
# Usage on the GPU machine: bash benchmarks/h200_fused_run.sh "$OUT"
source "$(dirname "$0")/h200_setup.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
DUMP=/tmp/xla_dump
XLA_FLAGS="--xla_dump_to=$DUMP --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*step_impl.*" \
  timeout 380 python3 benchmarks/decode_latency.py --model-config llama3-8b --kernel-breakdown \
  --variants bf16-b8,bf16-b8-sep,int8-xla-b8,int8-xla-b8-sep,int8-pallas-b1,int8-pallas-b1-sep,bf16-b1 \
  --out "$OUT" > "$OUT/latency.txt" 2>&1
echo "decode_latency.py exit $?"; grep -vE "^(W|I)1" "$OUT/latency.txt" | grep -v "^    " | tail -40
(cd "$DUMP" 2>/dev/null && ls | grep -E "after_optimizations.txt$|thunk" | head -40 | tar czf "$OUT/xla_dump.tgz" -T -)
ls -la "$OUT"
mkdir -p "$OUT/nocmdbuf"
XLA_FLAGS="--xla_gpu_enable_command_buffer=" timeout 150 python3 benchmarks/decode_latency.py --model-config llama3-8b \
  --variants bf16-b8,bf16-b1 --out "$OUT/nocmdbuf" > "$OUT/nocmdbuf/latency.txt" 2>&1
echo "no command buffers: exit $?"; grep -E "ms/token|dispatch" "$OUT/nocmdbuf/latency.txt"
