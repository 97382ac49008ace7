#!/usr/bin/env bash
# Issue #4 in one device call: `jlight serve` on one H200 with a random Llama-3-8B-shaped bf16
# checkpoint, loaded by the serving benchmark (`jlight bench serve`: Poisson arrivals at each
# rate, streaming /v1/completions, TTFT/TPOT/ITL/E2EL, JSON + PNG).
#
#   bash benchmarks/h200_serving_run.sh "$OUT"        (device machine; carry .whl, made by benchmarks/fetch_server_wheels.sh)
#   SHAPE=small NUM_PROMPTS=24 INPUT_LEN=192 OUTPUT_LEN=48 WARMUP=2 \
#     SERVE_OPTS="--dtype bfloat16 --max-model-len 512 --max-num-seqs 32 --max-num-batched-tokens 256" \
#     bash benchmarks/h200_serving_run.sh /tmp/out     (the same steps on a 2-core CPU, ~1-2 min)
#
# Steps: install jlight (editable, offline) and the carried wheels (fastapi, uvicorn, pydantic...
# from .whl/, see benchmarks/install_carried_wheels.py); write the checkpoint
# (benchmarks/make_random_checkpoint.py); start `jlight serve` in the background and wait for
# /health (the engine compiles every step bucket before it listens); run the benchmark; stop the
# server with SIGTERM. Writes at most 8 files into OUT_DIR: gpu.txt, setup.log, server.log,
# bench.log, serving.json, serving.png, metrics.txt, summary.txt.
#
# H200 budget (~3,900 output tok/s at batch 256, ~12 s load, ~8 s compile per step bucket):
# checkpoint ~40 s, server start ~100 s (9 buckets 8..2048), benchmark ~170 s (rate 2 alone
# takes 100 s of arrivals for 200 prompts), so about 5-6 minutes in all.
set -u
OUT=${1:?usage: bash benchmarks/h200_serving_run.sh OUT_DIR}
SHAPE=${SHAPE:-llama3-8b}
RATES=${RATES:-2,8,32,inf}
NUM_PROMPTS=${NUM_PROMPTS:-200}
INPUT_LEN=${INPUT_LEN:-768}      # with RANGE_RATIO 0.3333: 512..1023 tokens
OUTPUT_LEN=${OUTPUT_LEN:-192}    # 128..255 tokens
RANGE_RATIO=${RANGE_RATIO:-0.3333}
WARMUP=${WARMUP:-4}
SERVE_OPTS=${SERVE_OPTS:---dtype bfloat16 --max-model-len 2048 --max-num-seqs 256 --max-num-batched-tokens 2048 --kv-cache-memory-fraction 0.8}
PORT=${PORT:-8123}
CKPT=${CKPT:-/tmp/jlight_random_${SHAPE}}
START_TIMEOUT=${START_TIMEOUT:-300}   # seconds for load + compile until /health answers
BENCH_TIMEOUT=${BENCH_TIMEOUT:-330}
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }

mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
SETUP="$OUT/setup.log"
: > "$SETUP"

# 1. jlight (models/, sharding/, ... map to jlight.* through pyproject's package-dir) and the wheels.
stamp "installing jlight and the carried wheels" | tee -a "$SETUP"
python3 -m pip install -q --no-deps --no-build-isolation -e . >> "$SETUP" 2>&1 || { tail -5 "$SETUP"; exit 1; }
if [ -d .whl ]; then
  rm -rf /tmp/site
  python3 benchmarks/install_carried_wheels.py .whl /tmp/site 2>&1 | tee -a "$SETUP"
  [ "${PIPESTATUS[0]}" = 0 ] || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -c "import sys, jax, fastapi, uvicorn, pydantic; print('python', sys.version.split()[0], '| jax', jax.__version__, jax.devices(), '| fastapi', fastapi.__version__, '| uvicorn', uvicorn.__version__, '| pydantic', pydantic.__version__)" 2>&1 | tee -a "$SETUP"
[ "${PIPESTATUS[0]}" = 0 ] || exit 1
if command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader > "$OUT/gpu.txt" 2>&1
else
  echo "no nvidia-smi: $(nproc) CPU cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)" > "$OUT/gpu.txt"
fi
cat "$OUT/gpu.txt"

# 2. The random checkpoint (config, bf16 safetensors, tokenizer covering the whole vocabulary).
stamp "writing the $SHAPE checkpoint to $CKPT" | tee -a "$SETUP"
rm -rf "$CKPT"
python3 benchmarks/make_random_checkpoint.py --shape "$SHAPE" --out "$CKPT" 2>&1 | tee -a "$SETUP"
[ "${PIPESTATUS[0]}" = 0 ] || exit 1
VOCAB=$(python3 -c "import json; print(json.load(open('$CKPT/config.json'))['vocab_size'])")

# 3. The server, exactly `jlight serve` (python3 -m jlight.cli is what the jlight command runs).
stamp "starting: jlight serve $CKPT --port $PORT $SERVE_OPTS" | tee -a "$SETUP"
# shellcheck disable=SC2086
python3 -m jlight.cli serve "$CKPT" --host 127.0.0.1 --port "$PORT" --served-model-name "random-$SHAPE" \
  $SERVE_OPTS > "$OUT/server.log" 2>&1 &
SERVER=$!
stop_server() {
  if kill -0 "$SERVER" 2> /dev/null; then
    kill -TERM "$SERVER"
    for _ in $(seq 60); do kill -0 "$SERVER" 2> /dev/null || break; sleep 1; done
    kill -0 "$SERVER" 2> /dev/null && { echo "server ignored SIGTERM for 60 s: SIGKILL"; kill -KILL "$SERVER"; }
  fi
  wait "$SERVER" 2> /dev/null
  echo "server exit status $?"
}
trap stop_server EXIT
python3 - "$PORT" "$START_TIMEOUT" "$SERVER" << 'EOF'
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
if [ $? != 0 ]; then
  stamp "server did not come up; last lines of server.log:"
  tail -40 "$OUT/server.log"
  exit 1
fi
stamp "server ready" | tee -a "$SETUP"
tr '\r' '\n' < "$OUT/server.log" | grep -E "compiled|KV|pages|serving " | tail -5

# 4. The benchmark.
stamp "benchmark: rates $RATES, $NUM_PROMPTS prompts each, input $INPUT_LEN, output $OUTPUT_LEN, +-$RANGE_RATIO" | tee -a "$SETUP"
timeout "$BENCH_TIMEOUT" python3 -m jlight.cli bench serve --base-url "http://127.0.0.1:$PORT" \
  --num-prompts "$NUM_PROMPTS" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --range-ratio "$RANGE_RATIO" \
  --vocab-size "$VOCAB" --request-rates "$RATES" --warmup-requests "$WARMUP" --out "$OUT/serving" \
  > "$OUT/bench.log" 2>&1
BENCH_RC=$?
[ $BENCH_RC = 0 ] || { stamp "benchmark exit status $BENCH_RC (124: cut at ${BENCH_TIMEOUT} s)"; tail -20 "$OUT/bench.log"; }
python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:$PORT/metrics', timeout=10).read().decode())" \
  > "$OUT/metrics.txt" 2>&1

# 5. Stop the server (SIGTERM: it drains, then exits 0), then the summary.
trap - EXIT
stop_server >> "$SETUP" 2>&1  # not in a pipeline: `wait` needs the shell that started the server
tail -1 "$SETUP"
stamp "done" | tee -a "$SETUP"
python3 - "$OUT/serving.json" << 'EOF' | tee "$OUT/summary.txt"
import json, sys
try:
    report = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    sys.exit(f"no benchmark results: {e}")
print(f"model {report['model']}: {report['num_prompts']} prompts per rate, input {report['input_len']} / output "
      f"{report['output_len']} tokens +-{report.get('range_ratio', 0):.0%}, prompts reused across rates: "
      f"{report.get('prompts_reused_across_rates')}")
print(f"{'rate':>5} {'ok/fail':>8} {'dur s':>6} {'req/s':>6} {'out tok/s':>9} {'TTFT med/p99 ms':>16} "
      f"{'TPOT med/p99 ms':>16} {'ITL med/p99 ms':>15} {'E2EL med/p99 ms':>16}")
for s in report["results"]:
    mp = lambda m: f"{s[f'median_{m}_ms']:.0f}/{s[f'p99_{m}_ms']:.0f}"
    print(f"{s['request_rate']:>5} {s['completed']:>4}/{s['failed']:<3} {s['duration_s']:6.1f} {s['request_throughput']:6.2f} "
          f"{s['output_throughput']:9.1f} {mp('ttft'):>16} {mp('tpot'):>16} {mp('itl'):>15} {mp('e2el'):>16}")
EOF
exit $BENCH_RC
