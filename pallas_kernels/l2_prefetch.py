"""Prefetch the next matmuls' weights into the GPU's L2 cache while small kernels run.

In a batch-1 decode step the HBM sits nearly idle between the matmuls: after the q/k/v matmul come
RoPE, the K/V writes, the attention and a slice (about 11 us of the H200 step, docs/BENCHMARKS.md),
then the wo matmul, whose 17 MB of int8 weights read at only ~2.6 TB/s (ramp-up and tail). A kernel
that issues TMA prefetches (`cp.async.bulk.prefetch.L2`) of wo's weights, and of the start of
gate/up's, right after q/k/v returns at once; the copies go on while the small kernels run, and
the matmuls then find their first bytes in L2 (50 MB on the H200).

`prefetch(x, weights)` returns x. On a GPU (Mosaic GPU) it launches that kernel, which takes x only
to run after x's producer, and ties its result to x (lax.optimization_barrier), so that x's
consumers run after it. Weights are taken whole, in order, until `max_bytes`; the last one in part
(its first rows). It is a hint: nothing it does changes a result. Off the GPU, for steps of more
than MAX_ROWS rows (prefill is not bound by the weight reads) and when ENABLED is off it does
nothing; Mosaic GPU's interpreter has no prefetch, so CPU tests check the CUDA lowering.

NOT MEASURED YET (2026-12-01, tenth session: no GPU was lent after the idea came up). ENABLED is
off until a device run shows it pays: `benchmarks/l2_prefetch.py` times an int8 matmul after small
kernels with and without it; `decode_latency.py --variants int8-auto-b8,int8-auto-b8-l2` the step.
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jlight.pallas_kernels.tiling import NUM_SMS

ENABLED = False  # read when a step is traced (benchmarks switch it on)
MAX_BYTES = 40 << 20  # what the ~11 us after q/k/v can bring in at ~3.7 TB/s, under the 50 MB L2
MAX_ROWS = 64
_BOX = 256  # a TMA box spans at most 256 elements per dimension


def _matrix(w):
    """The 2-D array of a weight container (a plain array, QuantizedWeight(T), FusedWeight): its
    largest leaf. None if that is not a matrix."""
    leaf = max(jax.tree.leaves(w), key=lambda a: a.size)
    return leaf if leaf.ndim == 2 else None


def plan(weights, max_bytes: int) -> list[tuple[int, int, int]]:
    """(rows, box_rows, box_cols) to prefetch of each matrix, in order, within max_bytes: whole
    matrices, then the first rows of the one that no longer fits (whole boxes of rows)."""
    out, left = [], max_bytes
    for m in weights:
        rows, cols = m.shape
        box_rows, box_cols = min(_BOX, rows), min(_BOX, cols)
        if rows % box_rows or cols % box_cols or left <= 0:
            out.append((0, box_rows, box_cols))
            continue
        row_bytes = cols * m.dtype.itemsize
        take = min(rows, left // row_bytes // box_rows * box_rows)
        out.append((take, box_rows, box_cols))
        left -= take * row_bytes
    return out


def _prefetch_kernel(*refs, plans, num_programs):
    *w_refs, _x_ref, token_ref = refs
    program = lax.axis_index("program")
    for w_ref, (rows, box_rows, box_cols) in zip(w_refs, plans):
        if rows == 0:
            continue
        col_boxes = w_ref.shape[1] // box_cols
        num_boxes = rows // box_rows * col_boxes

        @pl.loop(program, num_boxes, step=num_programs)  # programs take boxes round-robin
        def _(i, w_ref=w_ref, col_boxes=col_boxes, box_rows=box_rows, box_cols=box_cols):
            r, c = i // col_boxes, lax.rem(i, col_boxes)
            plgpu.async_prefetch(w_ref.at[pl.ds(r * box_rows, box_rows), pl.ds(c * box_cols, box_cols)])

    @pl.when(program == 0)
    def _():
        token_ref[...] = jnp.zeros(token_ref.shape, token_ref.dtype)


def prefetch(x, weights, *, max_bytes: int | None = None, num_programs: int = NUM_SMS, force: bool = False):
    """x, unchanged; on a GPU, after launching the L2 prefetch of `weights` (see the module doc).
    force: launch even if ENABLED is off (benchmarks, lowering tests)."""
    wanted = force or (ENABLED and jax.default_backend() == "gpu")
    rows = x.size // x.shape[-1] if x.ndim else 0
    if not wanted or rows > MAX_ROWS:
        return x
    matrices = [m for m in (_matrix(w) for w in weights) if m is not None]
    plans = plan(matrices, MAX_BYTES if max_bytes is None else max_bytes)
    if not any(taken for taken, _, _ in plans):
        return x
    token = plgpu.kernel(
        functools.partial(_prefetch_kernel, plans=tuple(plans), num_programs=num_programs),
        out_type=jax.ShapeDtypeStruct((128,), jnp.int32),  # a warpgroup stores 128 at a time
        grid=(num_programs,),
        grid_names=("program",),
    )(*matrices, x)
    x, _ = lax.optimization_barrier((x, token))
    return x
