#!/usr/bin/env bash
# Device calls (2026-12-02, thirteenth session): the cost of a grid-wide barrier inside one Mosaic GPU
# kernel (benchmarks/grid_barrier.py). The first two calls hung on semaphores from scratch_types (even
# 2 programs and 1 barrier), so the kernel now uses pl.get_global ones, and the call climbs a ladder of
# small cases first, each in its own process under a short timeout.
# Usage on the GPU machine: bash benchmarks/h200_grid_barrier_run.sh "$OUT"
source "$(dirname "$0")/h200_setup.sh"
i=0
for args in "--designs counter --scopes gpu --programs 2 --barriers 1" \
            "--designs gather --scopes gpu --programs 2 --barriers 1" \
            "--designs counter,gather --scopes gpu,sys --programs 132 --barriers 200"; do
  i=$((i + 1))
  timeout 40 python3 benchmarks/grid_barrier.py $args --out "$OUT/run$i" > "$OUT/run$i.txt" 2>&1
  echo "== $args: exit $?"
  grep -vE "^\s*$" "$OUT/run$i.txt" | tail -5 | cut -c1-300
done
