#!/usr/bin/env bash
# One device call (2026-12-02, thirteenth session): the cost of a grid-wide barrier inside one Mosaic GPU
# kernel (benchmarks/grid_barrier.py), under a timeout in case a design deadlocks.
# Usage on the GPU machine: bash benchmarks/h200_grid_barrier_run.sh "$OUT"
source "$(dirname "$0")/h200_setup.sh"
timeout 150 python3 benchmarks/grid_barrier.py --out "$OUT" > "$OUT/grid_barrier.txt" 2>&1
echo "== grid_barrier: exit $?"
grep -vE "^\s*$" "$OUT/grid_barrier.txt" | tail -6 | cut -c1-300
