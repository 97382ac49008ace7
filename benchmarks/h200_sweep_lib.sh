# Shared by the mesh_sweep.py device scripts (h200_mesh_run.sh on 2 GPUs, h200_x4_run.sh on 4):
#   source h200_sweep_lib.sh OUT_DIR DEFAULT_BUDGET
# sets OUT (OUT_DIR, or /tmp/out; created), BUDGET (seconds for all runs: $BUDGET if set, else
# DEFAULT_BUDGET) and T0 (the start, date +%s), turns on pipefail, and defines:
#   sweep NAME CAP_SECONDS MESH_SWEEP_ARGS...   one mesh_sweep.py run, writing $OUT/NAME.json, under a
#       timeout of CAP_SECONDS cut to what is left of BUDGET; skipped when < 45 s are left. The common
#       flags: unrolled layers, 5 trials, decode at batch 1 and 64 with a 512-token context, TTFT of a
#       2048-token prompt, no PNG. mesh_sweep.py rewrites its JSON after every timed step, so a run
#       cut by its timeout keeps what it measured.
#   sweep_summary   one line per row of every $OUT/*.json, oldest file first: ms (pipelined ms).

set -o pipefail
OUT=${1:-/tmp/out}
mkdir -p "$OUT"
BUDGET=${BUDGET:-$2}
T0=$(date +%s)

sweep() {  # sweep NAME CAP_SECONDS MESH_SWEEP_ARGS...
  local name=$1 cap=$2
  shift 2
  local left=$(( BUDGET - ($(date +%s) - T0) ))
  local limit=$(( cap < left ? cap : left ))
  if [ "$limit" -lt 45 ]; then
    echo "== $name skipped: $left s of the $BUDGET s budget left"
    return
  fi
  echo "== $name: timeout $limit s, at $(( $(date +%s) - T0 )) s"
  timeout -k 10 "$limit" python3 benchmarks/mesh_sweep.py --out "$OUT" --name "$name" --plot 0 \
    --layer-loop unroll --trials 5 --batch 64 --context 512 --prompt-len 2048 "$@"
  echo "== $name exit $? at $(( $(date +%s) - T0 )) s"
}

sweep_summary() {
  echo "== summary (ms; pipelined = steps launched back to back)"
  python3 - "$OUT" <<'PYEOF'
import glob, json, os, sys
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.json")), key=os.path.getmtime):
    d = json.load(open(path))
    print(f"{os.path.basename(path)}: {d['model_config']}, {d['num_layers']} layers, {d['num_params_b']}B params, {d['layer_loop']}")
    for r in d["results"]:
        cells = [f"{k[:-3]} {r[k]:.2f} ({r[k[:-3] + '_pipelined_ms']:.2f})" for k in r if k.endswith("_ms") and "pipelined" not in k]
        errors = [f"{k}: {v}" for k, v in r.items() if k.endswith("error")]
        print(f"  {r['label']:<16} {r.get('param_gb_per_device', '?')} GB/dev  " + "  ".join(cells + errors))
PYEOF
}
