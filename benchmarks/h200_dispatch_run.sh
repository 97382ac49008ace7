#!/usr/bin/env bash
# One device call: does an XLA command-buffer update mode cut the host's dispatch time of a decode
# step? (XLA re-records/updates a step's CUDA graph when buffer addresses change; newer XLA can keep
# temporaries, or all buffers, at stable virtual addresses instead.) Lists the XLA flags about command
# buffers that this jaxlib knows, then times batch-1 decode (benchmarks/decode_latency.py) with each.
# Usage on the GPU machine: bash benchmarks/h200_dispatch_run.sh "$OUT"
source "$(dirname "$0")/h200_setup.sh"
LIBS=$(python3 -c "import glob, site; print(' '.join(f for d in site.getsitepackages() for f in glob.glob(d + '/jax*/**/*.so', recursive=True)))")
[ -n "$LIBS" ] || LIBS=/dev/null
echo "searched: $LIBS" | cut -c1-300
strings $LIBS 2>/dev/null | grep -E "^xla_gpu_(command_buffer|enable_command_buffer|graph)" | sort -u | tee "$OUT/flags.txt"
MODES="SKIP_TEMP|NEVER_UPDATE|CAPTURE_CMD_NEVER_UPDATE|FULL_UPDATE_FREE|CUSTOM_LIBRARY_UPDATE_FREE"
strings $LIBS 2>/dev/null | grep -E "^(ALWAYS_UPDATE|FULL_UPDATE|$MODES)$" | sort -u | tee -a "$OUT/flags.txt"
run() {  # run NAME XLA_FLAGS
  mkdir -p "$OUT/$1"
  XLA_FLAGS="$2" timeout 150 python3 benchmarks/decode_latency.py --model-config llama3-8b \
    --variants int8-xla-b8,bf16-b8 --out "$OUT/$1" > "/tmp/$1.txt" 2>&1
  echo "== $1 ($2): exit $?"; grep -E "ms/token|dispatch|FAILED|rror" "/tmp/$1.txt" | head -6
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print('  greedy', k, v.get('greedy_tokens')) for k, v in d['variants'].items()]" "$OUT/$1/decode_latency.json"
}
run default ""
if grep -q "^xla_gpu_command_buffer_update_mode$" "$OUT/flags.txt"; then
  for mode in $(grep -E "^($MODES)$" "$OUT/flags.txt"); do
    run "mode_$mode" "--xla_gpu_command_buffer_update_mode=$mode"
  done
elif grep -q "^xla_gpu_enable_command_buffer_va_remapping$" "$OUT/flags.txt"; then
  run va_remapping "--xla_gpu_enable_command_buffer_va_remapping=true"
fi
