"""What a grid-wide barrier costs inside one Mosaic GPU kernel (one program per SM), on the H200.

  python benchmarks/grid_barrier.py --out DIR           # GPU
  python benchmarks/grid_barrier.py --lower-only        # CPU: the kernels lower for CUDA

Why (docs/BENCHMARKS.md, thirteenth session): a decode layer's matmuls lose ~3 us each to their kernel
boundary. A persistent kernel that runs several dependent phases (e.g. gate/up, then down) avoids the
boundaries but needs a barrier between phases, when every program's part of one phase is written
before any program reads it in the next. This script times `--barriers` barriers in a row in one
kernel, minus the same kernel with none, so the figure is per barrier. Two designs on GMEM semaphores:
- counter: every program adds 1 to one counter, then waits until it reads programs x (i + 1)
  (the counter only grows within a launch; program 0 resets it at the end);
- gather: every program signals program 0, which waits for them all, then signals each one back.
On the H200 (JAX 0.11.2, 132 programs): counter 0.78 us a barrier (gpu scope; 1.16 at sys scope),
gather 39.7 us (program 0's 132 signals, each with its fence, in a row). docs/BENCHMARKS.md has the run.
"""
import argparse
import datetime
import functools
import json
import os
import statistics
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jlight.pallas_kernels.tiling import NUM_SMS


def _barrier_kernel(x_ref, o_ref, *, design, num_barriers, num_programs, scope):
    # Kernel-global semaphores (pl.get_global, as JAX's collective matmul uses): a barrier on a
    # scratch_types semaphore waited forever on the H200 (thirteenth session; each program has its own,
    # presumably). A global one persists across launches, so each design leaves every count at zero.
    sem = pl.get_global(plgpu.SemaphoreType.REGULAR((2 + num_programs,)))
    program = lax.axis_index("program")

    def counter(i, carry):
        plgpu.semaphore_signal(sem.at[0], 1, memory_scope=scope)
        plgpu.semaphore_wait(sem.at[0], num_programs * (i + 1), decrement=False, memory_scope=scope)
        return carry

    def gather(i, carry):
        plgpu.semaphore_signal(sem.at[0], 1, memory_scope=scope)

        @pl.when(program == 0)
        def _():
            plgpu.semaphore_wait(sem.at[0], num_programs, memory_scope=scope)
            for p in range(num_programs):
                plgpu.semaphore_signal(sem.at[2 + p], 1, memory_scope=scope)

        plgpu.semaphore_wait(sem.at[2 + program], 1, memory_scope=scope)
        return carry

    lax.fori_loop(0, num_barriers, counter if design == "counter" else gather, 0)
    if design == "counter" and num_barriers:
        # Reset the counter for the next launch, once every program has seen its last value.
        plgpu.semaphore_signal(sem.at[1], 1, memory_scope=scope)

        @pl.when(program == 0)
        def _():
            plgpu.semaphore_wait(sem.at[1], num_programs, memory_scope=scope)
            plgpu.semaphore_wait(sem.at[0], num_programs * num_barriers, memory_scope=scope)

    @pl.when(program == 0)
    def _():
        o_ref[...] = x_ref[...] + 1.0


@functools.partial(jax.jit, static_argnames=("design", "num_barriers", "num_programs", "scope"))
def barriers(x, *, design: str, num_barriers: int, num_programs: int = NUM_SMS, scope: str = "gpu"):
    """x [128] float32 -> x + 1, after num_barriers grid barriers among num_programs programs."""
    kernel = functools.partial(_barrier_kernel, design=design, num_barriers=num_barriers,
                               num_programs=num_programs, scope=scope)
    return plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(num_programs,), grid_names=("program",))(x)


def kernel_us(fn, x, trials):
    from jax.experimental.mosaic.gpu import profiler

    jax.block_until_ready(fn(x))
    _, per_call = profiler.measure(fn, aggregate=False, iterations=trials)(x)
    return statistics.median(sum(ms for _, ms in kernels) for kernels in per_call) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--barriers", type=int, default=200)
    ap.add_argument("--designs", default="counter,gather")
    ap.add_argument("--scopes", default="gpu,sys")
    ap.add_argument("--programs", type=int, default=NUM_SMS, help="programs in the grid (at most one per SM)")
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--lower-only", action="store_true", help="only lower each kernel for CUDA (runs on a CPU)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    x = jnp.zeros((128,), jnp.float32)
    rows = []
    for design in a.designs.split(","):
        for scope in a.scopes.split(","):
            row = dict(design=design, scope=scope, programs=a.programs, barriers=a.barriers)
            make = lambda n: functools.partial(barriers, design=design, num_barriers=n, scope=scope,
                                               num_programs=a.programs)
            if a.lower_only:
                text = jax.jit(make(2)).trace(x).lower(lowering_platforms=("cuda",)).as_text()
                row["lowered_chars"] = len(text)
            else:
                print(f"{design}/{scope}: running {a.barriers} barriers, {a.programs} programs", flush=True)
                assert float(make(a.barriers)(x)[0]) == 1.0  # the kernel ran to its end
                print("  it returned; timing with CUPTI", flush=True)
                empty, full = kernel_us(make(0), x, a.trials), kernel_us(make(a.barriers), x, a.trials)
                row.update(empty_us=empty, total_us=full, us_per_barrier=(full - empty) / a.barriers)
            rows.append(row)
            print(row, flush=True)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "grid_barrier.json"), "w") as f:
            json.dump(dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(), jax=jax.__version__,
                           device=str(jax.devices()[0].device_kind), command=" ".join(sys.argv), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
