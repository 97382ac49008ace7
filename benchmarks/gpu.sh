#!/usr/bin/env bash
# One runner for the GPU machine (Python 3.12, JAX 0.11.2; no fastapi, grain or gguf in its image):
#
#   bash benchmarks/gpu.sh SUITE [ARGS...] [SUITE [ARGS...]] ...
#
# e.g.  bash benchmarks/gpu.sh decode throughput
#       bash benchmarks/gpu.sh decode --variants int8-auto-b8 context --lengths 1024,8192
#       bash benchmarks/gpu.sh peer vllm_growth.py          (the vLLM peer, from a carried .peerN folder)
#
# Other model families (issues 31, 32): random bf16 weights of benchmarks/family_shapes.py's shapes, MODEL=gemma3-12b,
# gpt-oss-20b or qwen3-next-16l (Qwen3-Next cut to 16 layers); one suite a call (the engine compiles every bucket;
# gpt-oss-20b was ready in 144 s on an H100, give its throughput run 400 s). Beside vLLM (gpu_memory_utilization 0.9)
# pass --gpu-memory-utilization 0.9: the same share of the card, the pool sized as vLLM sizes its own (JAX's default
# is 75% of the card, of which the pool takes 80% of what the weights leave; qwen3-next-16l's 54 GB leave none there):
#       MODEL=gemma3-12b FIXED= SUITE_TIMEOUT=570 bash benchmarks/gpu.sh throughput --gpu-memory-utilization 0.9
#                   (nano-vllm workload and batch-1 decode, for MoE shapes also against the active weights' roofline;
#                   FIXED= drops the 1000 x 1000 run)
#       MODEL=gpt-oss-20b VARIANTS=bf16-b8 bash benchmarks/gpu.sh decode              (batch-1 against its bandwidth line)
#       MODEL=gpt-oss-20b FIXED= bash benchmarks/gpu.sh throughput --bs1-tokens 0 --profile-steps 400 8
#                   (a jax.profiler trace of 8 steps of the nano run: OUT/throughput/profile, its largest events printed)
#       MODEL=gpt-oss-20b FIXED= SUITE_TIMEOUT=400 bash benchmarks/gpu.sh throughput --quantization mxfp4
#                   (the experts as random MXFP4, kept as stored: quantization="mxfp4")
#       MODEL=gemma4-smoke FIXED= bash benchmarks/gpu.sh throughput   (Gemma 4 on the GPU at all: head_dim 256 / 512
#                   through the Triton attention kernel, per-layer embeddings, KV sharing; a small shape, no peer)
#       MODEL=qwen3-next-16l SUITE_TIMEOUT=570 bash benchmarks/gpu.sh context --lengths 2048,8192,32000 --gpu-memory-utilization 0.9
#                   (TTFT up to 32k: 32k context, 64 sequences, prefix caching off, as vllm_growth.py)
# and their vLLM peer, benchmarks/vllm_families.py (the same shapes, load_format="dummy", vllm_bench.py's requests):
#       bash benchmarks/gpu.sh peer ../benchmarks/vllm_families.py --shape gemma3-12b
#       bash benchmarks/gpu.sh peer ../benchmarks/vllm_families.py --shape gpt-oss-20b --quantization mxfp4
#       bash benchmarks/gpu.sh peer ../benchmarks/vllm_families.py --shape qwen3-next-16l --ttft 2048 8192 32000
#
# Words after a suite name go to that suite's script, after its defaults (argparse: the last value wins).
# A suite name starts the next suite when it follows a word that is not an option (-x, --x); after an
# option that takes no value, write `--` first (`kernels --skip-checks -- decode`).
#
# Suites, named after what they measure (the script and its defaults; MODEL=llama3-8b, random bf16 weights):
#   throughput  offline_throughput.py: the peer's nano-vllm workload, batch-1 decode (the peer's method) and
#               the peer's 1000 in / 1000 out x 1000 requests ($FIXED, default "1000 1000 1000"; FIXED= for
#               none), one engine (vllm_bench.py's measurements)
#   steps       offline_throughput.py --step-trace: every step of the nano workload against its own roofline
#   decode      decode_latency.py --tokens 96 --kernel-breakdown, one process per variant in $VARIANTS
#               (default "bf16-b8 int8-auto-b8"; with --variants in ARGS, those in one process): batch-1
#               ms/token, the step back to back, CUPTI's kernel list
#   context     context_sweep.py --model-config $MODEL: TTFT and batch-1 / batch-16 decode vs context
#               (vllm_growth.py's measurements)
#   spec        spec_decode.py: batch-1 verify steps of k = 0..8 drafts at 128 and 2048 tokens of context, and n-gram
#               speculation off / on over a repetitive prompt (its vLLM peer: .peerN/device.sh ../benchmarks/vllm_spec.py);
#               `--sections batch`: n-gram off / on at batches 1..64 (where disable_by_batch_size belongs)
#   batch       batch_decode_profile.py --batches 64,256 --context 1024 --kernel-breakdown
#   serving     `jlight serve` on a random checkpoint (make_random_checkpoint.py), then `jlight bench serve`
#               (needs .whl carried: bash benchmarks/fetch_server_wheels.sh); knobs below
#   chaos       chaos.py run --scale 4 against chaos.py serve of the same checkpoint (the server's promises under
#               abuse: benchmarks/chaos_cases.py; needs .whl carried too); knobs below
#   kernels     kernel_bench.py --trials 20: attention and int8 matmul kernels checked and timed against XLA
#   kv_int8     kv_int8_attention.py --impls triton,mosaic --page-sizes 16,32: the int8 KV pages
#   attention   attention_engine_check.py: each attention kernel in the engine against the XLA reference
#   decode_attention  attention_decode.py: decode attention alone across batch and context (work items or not,
#               Triton, fp8 pages)
#   moe         moe.py: Mixtral- and DeepSeek-V3-shaped layers, per expert implementation
#   mesh        mesh_sweep.py (a machine of 2+ GPUs): default --model-config llama3-70b --num-layers 40
#               --meshes tp=1 tp=<GPUs>
#   load        load_time.py --no-smollm2: safetensors against an orbax checkpoint of the same weights
#   structured  structured_output.py on a tiny random Llama (needs llguidance in .whl)
#   multiturn   multi_turn.py: 64 conversations x 4 turns (system 1024, user 256, reply 128 tokens), 16 at once, over a
#               device pool of ~half their history, the host KV tier off, on, on with its pages copied by device_put,
#               and all on the device (one process each): TTFT median / P99 / by turn, output tok/s, hits by tier,
#               pages copied each way, the slowest step() calls by phase, host copy rate beside PCIe Gen5 x16
#   tests       pytest on the GPU: tests/test_engine.py tests/test_kernels_attention.py tests/test_mosaic_attention.py
#               tests/test_split_kv.py tests/test_kv_cache_fp8.py tests/test_grouped_matmul.py tests/test_gpt_oss.py
#               (ARGS replace the file list)
#   peer        bash .peerN/device.sh ARGS (../shared/peer/README.md: one .peerN folder carried per call)
#
# Results: $OUT (the device tool's output folder; ./bench_out when unset): SUITE.txt (the script's output)
# and SUITE/ (its JSON) for each suite, gpu.log (this runner's log); a suite named again in one call (an A/B:
# `throughput --engine-options A throughput --engine-options B`) writes into $OUT/SUITE_2/ (then _3 ...), so
# no run overwrites another's. The device tool brings back at most
# 8 files, so when there are more, everything but gpu.log is packed into results.tgz.
# Environment: MODEL, VARIANTS, FIXED, SUITE_TIMEOUT (seconds per suite, else each suite's own default),
# JLIGHT_GIT_COMMIT (the commit the results name where the tree travelled without .git), NO_INSTALL=1 (jlight is
# importable already: skip `pip install -e .`), DRY_RUN=1 (print each suite's command, run none).
# Carried wheels: a .whl folder in the tree is installed first (install_carried_wheels.py, into /tmp/site).
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/bench_out}
mkdir -p "$OUT"
LOG=$OUT/gpu.log
MODEL=${MODEL:-llama3-8b}
export PYTHONUNBUFFERED=1
T0=$(date +%s)
say() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$LOG"; }

SUITES=" throughput steps decode context spec batch serving chaos kernels kv_int8 attention decode_attention moe mesh load structured multiturn tests peer "
is_suite() { [[ "$SUITES" == *" $1 "* ]]; }

run() {  # NAME DEFAULT_TIMEOUT COMMAND...: the command's output to $OUT/NAME.txt, its end here
  local name=$1 limit=${SUITE_TIMEOUT:-$2}; shift 2
  local start=$(date +%s)
  say "$name: $* (timeout $limit s)"
  [ -n "${DRY_RUN:-}" ] && return 0
  timeout -k 10 "$limit" "$@" > "$OUT/$name.txt" 2>&1
  local rc=$?
  say "$name: exit $rc$([ $rc = 124 ] && echo ' (timed out)'), $(( $(date +%s) - start )) s"
  grep -vE "^compiling|[Ww]arning|^\s*$" "$OUT/$name.txt" | tail -15 | cut -c1-240
  return $rc
}

setup() {
  if [ -z "${NO_INSTALL:-}" ]; then
    say "installing jlight from this tree"
    python3 -m pip install -q --no-deps --no-build-isolation -e . >> "$LOG" 2>&1 || { tail -5 "$LOG"; exit 1; }
  fi
  if [ -d .whl ]; then
    rm -rf /tmp/site
    python3 benchmarks/install_carried_wheels.py .whl /tmp/site 2>&1 | tee -a "$LOG"
    [ "${PIPESTATUS[0]}" = 0 ] || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  { command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import sys, jax; print('python', sys.version.split()[0], '| jax', jax.__version__, jax.devices())"
  } 2>&1 | tee -a "$LOG"
}

suite_throughput() {
  local fixed=()
  [ -n "${FIXED-1000 1000 1000}" ] && read -ra fixed <<< "--fixed ${FIXED-1000 1000 1000}"
  run throughput 480 python3 benchmarks/offline_throughput.py --model-config "$MODEL" --dtype bfloat16 \
    "${fixed[@]}" --out "$OUT/throughput" "$@"
}

suite_steps() {
  run steps 300 python3 benchmarks/offline_throughput.py --model-config "$MODEL" --dtype bfloat16 --bs1-tokens 0 \
    --step-trace --out "$OUT/steps" "$@"
}

suite_decode() {
  local v rc=0
  if [[ " $* " == *" --variants "* ]]; then  # the variants named in ARGS, in one process
    run decode 400 python3 benchmarks/decode_latency.py --model-config "$MODEL" --tokens 96 --kernel-breakdown \
      --out "$OUT/decode" "$@"
    return
  fi
  for v in ${VARIANTS:-bf16-b8 int8-auto-b8}; do  # one process each: an engine built after another dispatches slower
    run "decode_$v" 200 python3 benchmarks/decode_latency.py --model-config "$MODEL" --variants "$v" --tokens 96 \
      --kernel-breakdown --out "$OUT/decode/$v" "$@" || rc=$?
  done
  return $rc
}

suite_context() {
  run context 540 python3 benchmarks/context_sweep.py --model-config "$MODEL" --out "$OUT/context" "$@"
}

suite_spec() {
  run spec 300 python3 benchmarks/spec_decode.py --model-config "$MODEL" --out "$OUT/spec" "$@"
}

suite_batch() {
  run batch 300 python3 benchmarks/batch_decode_profile.py --model-config "$MODEL" --batches 64,256 --context 1024 \
    --kernel-breakdown --out "$OUT/batch" "$@"
}

suite_kernels() {
  run kernels 480 python3 benchmarks/kernel_bench.py --trials 20 --out "$OUT/kernels" "$@"
}

suite_kv_int8() {
  run kv_int8 300 python3 benchmarks/kv_int8_attention.py --impls triton,mosaic --page-sizes 16,32 --out "$OUT/kv_int8" "$@"
}

suite_decode_attention() {
  run decode_attention 330 python3 benchmarks/attention_decode.py --out "$OUT/decode_attention" "$@"
}

suite_attention() {
  run attention 300 python3 benchmarks/attention_engine_check.py --out "$OUT/attention" "$@"
}

suite_moe() {
  run moe 480 python3 benchmarks/moe.py --out "$OUT/moe" "$@"
}

suite_mesh() {
  local gpus defaults=()
  gpus=$(nvidia-smi -L 2> /dev/null | wc -l)
  [ $# -eq 0 ] && defaults=(--model-config llama3-70b --num-layers 40 --meshes tp=1)
  [ $# -eq 0 ] && [ "${gpus:-1}" -gt 1 ] && defaults+=("tp=$gpus")
  run mesh 540 python3 benchmarks/mesh_sweep.py --out "$OUT/mesh" --plot 0 --layer-loop unroll --trials 5 --batch 64 \
    --context 512 --prompt-len 2048 "${defaults[@]}" "$@"
}

suite_load() {
  run load 300 python3 benchmarks/load_time.py --out "$OUT/load" --work-dir /tmp/loadtime --no-smollm2 "$@"
}

suite_structured() {
  local tiny
  tiny=$(python3 -c "import sys; sys.path.insert(0, 'tests'); from tiny_models import make_tiny_model; print(make_tiny_model('/tmp/tiny', 'LlamaForCausalLM'))" 2>> "$LOG" | tail -1)
  run structured 200 python3 benchmarks/structured_output.py --model "$tiny" --num-requests 32 --max-tokens 48 \
    --mask-rows 1 32 --out "$OUT/structured" "$@"
}

suite_multiturn() {
  run multiturn 540 python3 benchmarks/multi_turn.py --model-config "$MODEL" --out "$OUT/multiturn" "$@"
}

suite_tests() {
  local files=(tests/test_engine.py tests/test_kernels_attention.py tests/test_mosaic_attention.py tests/test_split_kv.py
               tests/test_kv_cache_fp8.py tests/test_grouped_matmul.py tests/test_gpt_oss.py)
  [ $# -gt 0 ] && files=("$@")
  run tests 560 python3 -m pytest -q -p no:cacheprovider "${files[@]}"
}

suite_peer() {
  local dirs=(.peer[0-9]*)
  [ -f "${dirs[0]}/device.sh" ] || { say "peer: no .peerN folder here (carry one; ../shared/peer/README.md)"; return 1; }
  run peer 540 bash "${dirs[0]}/device.sh" "$@"
}

# A random checkpoint served on 127.0.0.1 (the serving and chaos suites): random_server NAME SERVER_COMMAND...
# writes the SHAPE checkpoint (make_random_checkpoint.py, seed 0) to CKPT unless an earlier suite wrote it, runs `SERVER_COMMAND CKPT --host --port
# --served-model-name SERVE_OPTS` into $OUT/NAME/server.log and waits up to START_TIMEOUT for /health.
# Sets server (its pid), port and vocab; returns 1 if it never answered.
random_server() {
  local name=$1; shift
  local shape=${SHAPE:-llama3-8b} dir="$OUT/$name"
  local ckpt=${CKPT:-/tmp/jlight_random_${shape}}
  local serve_opts=${SERVE_OPTS:---dtype bfloat16 --max-model-len 2048 --max-num-seqs 256 --max-num-batched-tokens 2048 --kv-cache-memory-fraction 0.8}
  port=${PORT:-8123}
  mkdir -p "$dir"
  if [ -f "$ckpt/.written-$shape" ]; then  # the same seed's weights: written by an earlier suite of this machine
    say "$name: the $shape checkpoint in $ckpt is there"
  else
    say "$name: writing the $shape checkpoint to $ckpt"
    rm -rf "$ckpt"
    python3 benchmarks/make_random_checkpoint.py --shape "$shape" --out "$ckpt" >> "$LOG" 2>&1 || { say "$name: checkpoint failed"; return 1; }
    touch "$ckpt/.written-$shape"
  fi
  vocab=$(python3 -c "import json; print(json.load(open('$ckpt/config.json'))['vocab_size'])")
  say "$name: $* $ckpt --port $port $serve_opts"
  # shellcheck disable=SC2086
  "$@" "$ckpt" --host 127.0.0.1 --port "$port" --served-model-name "random-$shape" $serve_opts > "$dir/server.log" 2>&1 &
  server=$!
  python3 - "$port" "${START_TIMEOUT:-300}" "$server" << 'EOF'
import os, sys, time, urllib.request
port, timeout, pid = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
deadline = time.time() + timeout
while time.time() < deadline:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("server process exited before /health answered")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            if r.status == 200:
                sys.exit(0)
    except OSError:
        pass
    time.sleep(1)
sys.exit(f"/health did not answer within {timeout:.0f} s")
EOF
  local rc=$?
  if [ $rc = 0 ]; then say "$name: server ready"; else say "$name: the server did not come up"; tail -30 "$dir/server.log"; fi
  return $rc
}

stop_server() {  # SIGTERM (the server drains), then SIGKILL after 60 s
  kill -TERM "$server" 2> /dev/null
  for _ in $(seq 60); do kill -0 "$server" 2> /dev/null || break; sleep 1; done
  kill -0 "$server" 2> /dev/null && kill -KILL "$server"
  wait "$server" 2> /dev/null
}

# Serving: SHAPE, RATES, NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN (+-RANGE_RATIO), WARMUP, SERVE_OPTS, PORT, CKPT,
# START_TIMEOUT, BENCH_TIMEOUT; ARGS go to `jlight bench serve`. The defaults are the 2026-11-29 H200 run's:
# 200 prompts a rate, 512-1023 tokens in, 128-255 out (ignore_eos), rates 2, 8, 32 and inf.
suite_serving() {
  [ -n "${DRY_RUN:-}" ] && { run serving 330 jlight serve + jlight bench serve "$@"; return; }
  local server port vocab rc
  random_server serving python3 -m jlight.cli serve || { stop_server; return 1; }
  SUITE_TIMEOUT=${BENCH_TIMEOUT:-${SUITE_TIMEOUT:-330}} run serving 330 python3 -m jlight.cli bench serve \
    --base-url "http://127.0.0.1:$port" --num-prompts "${NUM_PROMPTS:-200}" --input-len "${INPUT_LEN:-768}" \
    --output-len "${OUTPUT_LEN:-192}" --range-ratio "${RANGE_RATIO:-0.3333}" --vocab-size "$vocab" \
    --request-rates "${RATES:-2,8,32,inf}" --warmup-requests "${WARMUP:-4}" --out "$OUT/serving/serving" "$@"
  rc=$?
  python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:$port/metrics', timeout=10).read().decode())" \
    > "$OUT/serving/metrics.txt" 2>&1
  stop_server
  return $rc
}

# Chaos: chaos.py run (scaled by CHAOS_SCALE, default 4) against chaos.py serve of the random checkpoint (`jlight
# serve` plus the suite's one injected step fault), drain deadline DRAIN_TIMEOUT (default 10 s); SHAPE, SERVE_OPTS,
# PORT, CKPT, START_TIMEOUT as for serving; ARGS go to `chaos.py run` (e.g. --cases bad_inputs,step_failure).
# Its last case SIGTERMs the server; the server's log after the drain began must hold no traceback.
suite_chaos() {
  local drain=${DRAIN_TIMEOUT:-10}
  [ -n "${DRY_RUN:-}" ] && { run chaos 600 chaos.py serve + chaos.py run --scale "${CHAOS_SCALE:-4}" "$@"; return; }
  local server port vocab rc
  random_server chaos python3 benchmarks/chaos.py serve --shutdown-timeout "$drain" || { stop_server; return 1; }
  run chaos 600 python3 benchmarks/chaos.py run --base-url "http://127.0.0.1:$port" --server-pid "$server" \
    --shutdown-timeout "$drain" --scale "${CHAOS_SCALE:-4}" --out "$OUT/chaos/chaos.json" "$@"
  rc=$?
  stop_server
  if sed -n '/draining:/,$p' "$OUT/chaos/server.log" | grep -q Traceback; then
    say "chaos: a traceback in the server log after the drain began"; rc=1
  fi
  return $rc
}

# Split the words into suites and their arguments, then run them in order.
[ $# -eq 0 ] && { sed -n '2,/^set -u/p' "$0" | sed '$d'; exit 2; }
names=() args=() prev=""
for word in "$@"; do
  if [ "$word" = "--" ]; then prev=""; continue; fi
  if is_suite "$word" && { [ ${#names[@]} -eq 0 ] || [[ "$prev" != -* ]]; }; then
    names+=("$word"); args+=("")
  elif [ ${#names[@]} -eq 0 ]; then
    echo "gpu.sh: unknown suite '$word'; suites:$SUITES" >&2; exit 2
  else
    args[${#args[@]} - 1]+=" $(printf '%q' "$word")"
  fi
  prev=$word
done
[ -z "${DRY_RUN:-}" ] && setup
status=0
root=$OUT
declare -A times_named=()
for i in "${!names[@]}"; do
  name=${names[$i]}
  times_named[$name]=$(( ${times_named[$name]:-0} + 1 ))
  OUT=$root
  if [ "${times_named[$name]}" -gt 1 ]; then OUT=$root/${name}_${times_named[$name]}; mkdir -p "$OUT"; fi
  eval "suite_$name ${args[$i]}" || status=1
done
OUT=$root
files=$(find "$OUT" -type f ! -name gpu.log | wc -l)
if [ "$files" -gt 7 ]; then  # the device tool brings back at most 8 files
  (cd "$OUT" && find . -type f ! -name gpu.log ! -name results.tgz -print0 | tar czf /tmp/results.tgz --null -T - \
    && find . -mindepth 1 ! -name gpu.log -delete && mv /tmp/results.tgz .)
  say "packed $files files into $OUT/results.tgz"
fi
say "done: ${names[*]} (exit $status)"
exit $status
