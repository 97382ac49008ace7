# Sourced first by the benchmarks/h200_*_run.sh device scripts (h200_serving_run.sh logs its own
# set-up): OUT (the first argument, or /tmp/out) exists, Python output is unbuffered, and jlight
# is installed from this tree; run NAME TIMEOUT COMMAND... keeps a command's output in $OUT/NAME.txt.
set -u
OUT=${1:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
run() {  # NAME TIMEOUT COMMAND...: the command's output to $OUT/NAME.txt, a few lines of it here
  local name=$1 limit=$2; shift 2
  local start=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  echo "== $name: exit $?, $(( $(date +%s) - start )) s"
  grep -vE "^compiling|Warning|warn|^\s*$" "$OUT/$name.txt" | tail -14 | cut -c1-240
}
