"""Grouped matmul (the MoE expert matmul) in Pallas, Triton backend (pallas_mode.py says why).

    grouped_matmul(x [M, K], w [G, K, N], group_sizes [G]) -> [M, N]

Same contract as `jax.lax.ragged_dot` (the reference, `grouped_matmul_reference`): the rows of
x are sorted by group, group g owns the next group_sizes[g] rows, and row r of the result is
x[r] @ w[group of r]. Rows past sum(group_sizes) are zeros.

Why a kernel: XLA's GPU lowering of ragged_dot (JAX 0.11.2) pads every group to a dense
contraction, so it does the FLOPs of running every expert on every row and runs out of memory on
DeepSeek-V3-sized prefill (docs/BENCHMARKS.md, MoE). Here each program owns one tile of at most
`block_m` rows of ONE group, so the work is sum over groups of ceil-ish(rows / block_m) tiles,
and a group with no rows costs nothing (its weights are never read).

Tiles. In XLA, a tile table of static length cdiv(M, block_m) + G is built: tile -> (group,
row_start, row_end). The rows of each group, and the zero tail [sum(group_sizes), M) as an
extra pseudo-group, are cut at the multiples of block_m; a tile that straddles a group boundary
is computed once per group and each copy stores only its own rows (masked store), so the stores
of two tiles sharing a block are disjoint. k contiguous intervals partitioning [0, M) cut into
at most cdiv(M, block_m) + k - 1 pieces, and k <= G + 1, hence the table length. Unused table
entries have row_start == row_end (no stores, no K loop).

Grid (tiles, N / block_n); tile index fastest, so programs that run together mostly share a
group's weight columns (L2). Each program loops over K in block_k steps: x[block rows, k-slice]
@ w[group, k-slice, n-block] accumulated in float32 on the tensor cores (float32 x: true float32
products, not Triton's default TF32, as a float32 model's other matmuls have them). int8 weights are
converted to x's dtype in registers (one byte per weight from HBM); their scales are the
caller's (models/moe.py multiplies rows by their expert's scales).

MXFP4 weights (core/quantization.Mxfp4Weight: byte b of a column holds rows 2b and 2b + 1, one
exponent per 32 rows) are expanded in registers as well (half a byte per weight from HBM, and only
the groups with rows are read): x's even and odd columns are split apart first, so that each
16-byte-row slice of a step multiplies its low nibbles with the even columns and its high nibbles
with the odd ones, times the slice's one exponent row.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from jlight.core.quantization import Mxfp4Weight, dequantize_mxfp4, e2m1_values
from jlight.pallas_kernels import pallas_mode
from jlight.pallas_kernels.tiling import largest_pow2_divisor


def grouped_matmul_reference(x, w, group_sizes, *, preferred_element_type=None):
    """The XLA reference: jax.lax.ragged_dot (float32 accumulation); MXFP4 weights expanded to x's dtype first."""
    w = dequantize_mxfp4(w, x.dtype) if isinstance(w, Mxfp4Weight) else w
    return jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=preferred_element_type)


def fits(k: int, n: int) -> bool:
    """The kernel's tiles need K and N to be multiples of 16 (tensor-core minimum)."""
    return k % 16 == 0 and n % 16 == 0


def default_tiles(m: int, k: int, n: int, num_groups: int) -> dict:
    """Tile sizes for Hopper bf16 (benchmarks/moe.py's decode_tiles sweep on the H200).

    block_m follows the average rows per group: with many small groups (DeepSeek: 256 experts)
    a 128-row tile would be mostly padding, and at decode the kernel is bound by reading the
    chosen experts' weights, so a 16-row tile is enough.
    With at most 16 rows (batch-1 decode: top-k rows) few programs have work, so each reads
    128-deep K steps: the expert FFN takes 0.512 instead of 0.602 ms (Mixtral-shaped) and 0.767
    instead of 0.904 ms (DeepSeek-V3-shaped) on the H200; at 64 tokens 64-deep steps stay best
    for Mixtral (1.24 vs 1.50 ms).
    """
    rows_per_group = m / max(num_groups, 1)
    block_m = 16 if rows_per_group <= 16 else 32 if rows_per_group <= 32 else 64 if rows_per_group <= 96 else 128
    block_n = largest_pow2_divisor(n, 64 if block_m <= 32 else 128)  # small tiles: more programs
    block_k = largest_pow2_divisor(k, 128 if m <= 16 else 64)
    num_warps = 8 if block_m * block_n >= 128 * 128 else 4
    num_stages = 3 if block_m * block_n >= 128 * 128 else 4
    return dict(block_m=block_m, block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages)


def tile_table(group_sizes, num_rows: int, block_m: int):
    """(group, row_start, row_end), each int32 [cdiv(num_rows, block_m) + G].

    group == G marks the zero tail (rows past sum(group_sizes)) and unused entries; the latter
    have row_start == row_end == 0. group_sizes summing past num_rows are cut at num_rows.
    """
    num_groups = group_sizes.shape[0]
    num_tiles = -(-num_rows // block_m) + num_groups
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), num_rows)  # [G]
    ends = jnp.concatenate([ends, jnp.full((1,), num_rows, jnp.int32)])  # [G + 1]: + the zero tail
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    nonempty = ends > starts
    first_block = starts // block_m
    tiles_per_group = jnp.where(nonempty, (ends - 1) // block_m - first_block + 1, 0)  # [G + 1]
    cu_tiles = jnp.cumsum(tiles_per_group)  # inclusive
    tile = jnp.arange(num_tiles, dtype=jnp.int32)
    used = tile < cu_tiles[-1]
    # compare_all, not the default while loop, which XLA:GPU would drive from the host.
    group = jnp.minimum(jnp.searchsorted(cu_tiles, tile, side="right", method="compare_all"), num_groups).astype(jnp.int32)
    block = first_block[group] + tile - (cu_tiles[group] - tiles_per_group[group])
    row_start = jnp.maximum(starts[group], block * block_m)
    row_end = jnp.minimum(ends[group], (block + 1) * block_m)
    zero = jnp.zeros_like(tile)
    return (jnp.where(used, group, num_groups).astype(jnp.int32), jnp.where(used, row_start, zero).astype(jnp.int32),
            jnp.where(used, row_end, zero).astype(jnp.int32))


def _tile(group_ref, start_ref, end_ref, *, block_m, num_k_steps, num_groups):
    """This program's tile: (its K steps, first row of its block, which of the block's rows are its own, its
    group's weights' index)."""
    tile = pl.program_id(0)
    group, start, end = group_ref[tile], start_ref[tile], end_ref[tile]
    row0 = (start // block_m) * block_m  # the block_m-aligned block holding this tile's rows
    rows = row0 + jnp.arange(block_m)
    mine = (rows >= start) & (rows < end)  # [block_m]
    w_group = jnp.minimum(group, num_groups - 1)  # the zero tail has no weights
    # int32 operands spelled out: with two Python ints, jnp.where's select was lowered to i1
    # operands on the GPU (JAX 0.11.2 Triton lowering), so the loop bounds had mismatched types.
    steps = jnp.where(group < num_groups, jnp.int32(num_k_steps), jnp.int32(0))
    return steps, row0, mine, w_group


def _kernel(group_ref, start_ref, end_ref, x_ref, w_ref, o_ref, *, block_m, block_k, num_k_steps, num_groups):
    steps, row0, mine, w_group = _tile(group_ref, start_ref, end_ref, block_m=block_m, num_k_steps=num_k_steps,
                                       num_groups=num_groups)
    block_n = o_ref.shape[1]

    def body(step, acc):
        ks = pl.ds(step * block_k, block_k)
        x = x_ref[pl.ds(row0, block_m), ks]  # [block_m, block_k]; other groups' rows are computed and dropped
        w = w_ref[w_group, ks, :]  # [block_k, block_n]
        return acc + pltr.dot(x, w.astype(x.dtype), allow_tf32=x.dtype != jnp.float32).astype(jnp.float32)

    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((block_m, block_n), jnp.float32))
    pltr.store(o_ref.at[pl.ds(row0, block_m), :], acc.astype(o_ref.dtype), mask=mine[:, None])


MXFP4_SLICE = 16  # byte rows a slice: the 32 weight rows one exponent scales


def _mxfp4_kernel(group_ref, start_ref, end_ref, x_even_ref, x_odd_ref, blocks_ref, scales_ref, o_ref, *, block_m,
                  block_k, num_k_steps, num_groups):
    """_kernel over MXFP4 weights: a step of block_k weight rows reads block_k / 2 byte rows, one 16-row slice
    (32 weight rows, one exponent row) at a time."""
    steps, row0, mine, w_group = _tile(group_ref, start_ref, end_ref, block_m=block_m, num_k_steps=num_k_steps,
                                       num_groups=num_groups)
    block_n = o_ref.shape[1]
    slices = block_k // (2 * MXFP4_SLICE)

    def body(step, acc):
        for j in range(slices):
            first = (step * slices + j) * MXFP4_SLICE  # byte row; x's even / odd column of the same index
            cols = pl.ds(first, MXFP4_SLICE)
            x_even = x_even_ref[pl.ds(row0, block_m), cols]  # [block_m, 16]: weight rows 2b
            x_odd = x_odd_ref[pl.ds(row0, block_m), cols]  # weight rows 2b + 1
            codes = blocks_ref[w_group, cols, :]  # [16, block_n] uint8
            exponent = scales_ref[w_group, pl.ds(step * slices + j, 1), :]  # [1, block_n] uint8
            scale = jnp.exp2(exponent.astype(jnp.float32) - 127.0)
            low = (e2m1_values(codes & 0x0F) * scale).astype(x_even.dtype)
            high = (e2m1_values(codes >> 4) * scale).astype(x_odd.dtype)
            tf32 = x_even.dtype != jnp.float32
            acc = acc + pltr.dot(x_even, low, allow_tf32=tf32).astype(jnp.float32) + \
                pltr.dot(x_odd, high, allow_tf32=tf32).astype(jnp.float32)
        return acc

    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((block_m, block_n), jnp.float32))
    pltr.store(o_ref.at[pl.ds(row0, block_m), :], acc.astype(o_ref.dtype), mask=mine[:, None])


@functools.partial(jax.jit, static_argnames=("preferred_element_type", "interpret", "block_m", "block_n", "block_k",
                                             "num_warps", "num_stages"))
def grouped_matmul(x, w, group_sizes, *, preferred_element_type=None, interpret=None, block_m=None, block_n=None,
                   block_k=None, num_warps=None, num_stages=None):
    """x: [M, K] rows sorted by group; w: [G, K, N] (float, or int8 converted in-kernel to x's
    dtype, or an Mxfp4Weight expanded in-kernel to x's dtype); group_sizes: [G] int32 -> [M, N] in
    preferred_element_type (default x's dtype).

    Tile sizes default to `default_tiles`; pass any of them to override (benchmarks, tuning).
    """
    mxfp4 = isinstance(w, Mxfp4Weight)
    m, k = x.shape
    num_groups, k2, n = w.shape
    if k2 != k or group_sizes.shape != (num_groups,):
        raise ValueError(f"grouped_matmul: x {x.shape}, w {w.shape}, group_sizes {group_sizes.shape} do not match")
    if not fits(k, n):
        raise ValueError(f"grouped_matmul: K={k} and N={n} must be multiples of 16; use grouped_matmul_reference")
    out_dtype = jnp.dtype(preferred_element_type or x.dtype)
    tiles = default_tiles(m, k, n, num_groups)
    block_m = block_m or tiles["block_m"]
    block_n = block_n or tiles["block_n"]
    block_k = block_k or (max(tiles["block_k"], 2 * MXFP4_SLICE) if mxfp4 else tiles["block_k"])
    num_warps = num_warps or tiles["num_warps"]
    num_stages = num_stages or tiles["num_stages"]
    pow2 = lambda b: b >= 16 and b & (b - 1) == 0
    if not (pow2(block_m) and pow2(block_n) and pow2(block_k)) or k % block_k or n % block_n:
        raise ValueError(f"grouped_matmul: block_m={block_m}, block_n={block_n}, block_k={block_k} must be powers of two "
                         f">= 16, with block_k dividing K={k} and block_n dividing N={n}")
    if mxfp4 and block_k < 2 * MXFP4_SLICE:
        raise ValueError(f"grouped_matmul: MXFP4 weights take steps of whole 32-row blocks (block_k={block_k})")
    if m == 0:
        return jnp.zeros((0, n), out_dtype)
    m_pad = -(-m // block_m) * block_m
    xp = jnp.pad(x, ((0, m_pad - m), (0, 0))) if m_pad != m else x  # every tile's block lies inside x
    group, row_start, row_end = tile_table(group_sizes, m, block_m)
    num_tiles = group.shape[0]
    full = lambda shape: pl.BlockSpec(shape, lambda t, j: (0,) * len(shape))
    columns = lambda rows: pl.BlockSpec((num_groups, rows, block_n), lambda t, j: (0, 0, j))
    tables = [full((num_tiles,))] * 3
    params = dict(block_m=block_m, block_k=block_k, num_k_steps=k // block_k, num_groups=num_groups)
    if mxfp4:
        kernel = functools.partial(_mxfp4_kernel, **params)
        in_specs = tables + [full((m_pad, k // 2))] * 2 + [columns(k // 2), columns(k // 32)]
        operands = (xp[:, 0::2], xp[:, 1::2], w.blocks, w.scales)
    else:
        kernel = functools.partial(_kernel, **params)
        in_specs = tables + [full((m_pad, k)), columns(k)]
        operands = (xp, w)
    out = pl.pallas_call(
        kernel,
        grid=(num_tiles, n // block_n),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((m_pad, block_n), lambda t, j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((m_pad, n), out_dtype),
        interpret=pallas_mode.resolve(interpret),
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"grouped_matmul_bm{block_m}_bn{block_n}_bk{block_k}{'_mxfp4' if mxfp4 else ''}",
    )(group, row_start, row_end, *operands)
    return out[:m] if m_pad != m else out
