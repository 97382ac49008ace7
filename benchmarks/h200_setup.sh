# Sourced first by the benchmarks/h200_*_run.sh device scripts (h200_serving_run.sh logs its own
# set-up): OUT (the first argument, or /tmp/out) exists, Python output is unbuffered, and jlight
# is installed from this tree.
set -u
OUT=${1:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
