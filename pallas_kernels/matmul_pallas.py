"""int8 matmuls in Pallas (Triton backend; pallas_mode.py says why not Mosaic GPU).

W8A16 (QuantizedWeight): int8 weights are converted to the activation dtype in
registers, so HBM traffic is one byte per weight: the decode (GEMV-like) path, where
reading the weights is the whole cost. Few output tiles (small `out`, batch 1) are
split along `in` (split-K) so the GPU is full; partial sums are added in XLA.

W8A8 (W8A8WeightT, weights stored [out, in]): activations are quantized per token in XLA,
then int8 x int8 tiles accumulate in int32 on the tensor cores; both scales are applied
once at the end. Serves prefill, where the matmul is compute-bound; it is the engine's W8A8
path on GPU by default (matmul_gpu_default): on the H200, 1.4x XLA's int8 dot on the same weights
(2.4x XLA's on [in, out] ones, the layout before).

W8A16 on K-major weights (QuantizedWeightT, values [out, in]: how the engine stores weight-only int8
on GPU for XLA's dequantize-dot): w8a16_kmajor_matmul. Its GEMV path (one row) reads each output's
weights as one contiguous run and needs no split-K at the wide layers: on the H200 it reads a
4096x14336 layer at 82% of the copy rate in a single launch, and "auto" uses it for one-row steps.
Its tensor-core path (up to 16 rows) lost to XLA's dequantize-dot at 8 rows, so it stays off, as does
the Mosaic GPU kernel for 8-64 rows (w8a16_mosaic.py; MOSAIC_W8A16_MAX_ROWS says why).

Plain (unquantized) weights go to XLA's dot (cuBLAS), which a Pallas GEMM would not beat.
"""
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from jlight.pallas_kernels import matmul_reference, pallas_mode, w8a16_mosaic
from jlight.core.quantization import (
    QuantizedWeight, QuantizedWeightT, W8A8Weight, W8A8WeightT, int8_to_f32, quantize_activations)
from jlight.pallas_kernels.tiling import NUM_SMS, largest_pow2_divisor, next_pow2

# Steps of fewer rows send K-major W8A8 weights to XLA's int8 dot. H200, 4096x14336 (docs/BENCHMARKS.md):
# 8 rows XLA 21.2 us vs the kernel's best 21.7; 64 rows 28.3 vs 23.7; 512 rows 82.4 vs 62.0.
W8A8_PALLAS_MIN_ROWS = 64
_GEMV_MAX_ROWS = 4  # up to this many rows, W8A16 reduces on CUDA cores (no tensor-core tile)
# w8a16_matmul keywords that matmul() (the engine's path) passes; "gemv_max_rows" overrides
# _GEMV_MAX_ROWS. benchmarks/decode_latency.py sets these to compare variants end to end.
W8A16_OPTIONS: dict = {}


def _w8a16_kernel(x_ref, w_ref, s_ref, o_ref, *, block_k, steps_per_split, num_steps, apply_scale, magic_convert):
    """Tensor-core tiles; the int8 tile is converted to x's dtype (exact) in registers."""
    split = pl.program_id(2)
    first = split * steps_per_split
    last = jnp.minimum(first + steps_per_split, num_steps)

    def body(step, acc):
        x = x_ref[:, pl.ds(step * block_k, block_k)]  # [block_m, block_k]
        w = w_ref[pl.ds(step * block_k, block_k), :]  # [block_k, block_n] int8
        w = int8_to_f32(w, True).astype(x.dtype) if magic_convert else w.astype(x.dtype)
        return acc + pltr.dot(x, w).astype(jnp.float32)

    acc = jax.lax.fori_loop(first, last, body, jnp.zeros(o_ref.shape, jnp.float32))  # [block_m, block_n]
    if apply_scale:
        acc = acc * s_ref[...].astype(jnp.float32)[None, :]
    o_ref[...] = acc.astype(o_ref.dtype)


def _w8a16_gemv_kernel(x_ref, w_ref, s_ref, o_ref, *, block_k, steps_per_split, num_steps, apply_scale, num_rows,
                       reduce_each_step, magic_convert):
    """For a few rows: multiply-and-reduce on the CUDA cores instead of a 16-row
    tensor-core tile that would be mostly padding; the weight tile is loaded once.

    By default each row keeps a [block_k, block_n] float32 accumulator of elementwise
    products and reduces it over `in` once, after the loop: the loop body is then loads,
    converts and FMAs only, with no cross-thread reduction per step.
    `reduce_each_step=True` is the earlier variant (reduce every step), kept for the benchmark.
    (Loading weight tiles one or two steps ahead in the loop carry was tried on the H200 and was
    slower at every shape, e.g. 26.0 -> 38.3 us at 4096x14336: docs/BENCHMARKS.md.)
    """
    split = pl.program_id(2)
    first = split * steps_per_split
    last = jnp.minimum(first + steps_per_split, num_steps)
    block_n = o_ref.shape[1]
    acc_shape = (block_n,) if reduce_each_step else (block_k, block_n)

    def body(step, accs):
        k = pl.ds(step * block_k, block_k)
        w = int8_to_f32(w_ref[k, :], magic_convert)  # [block_k, block_n]
        products = [x_ref[r, k].astype(jnp.float32)[:, None] * w for r in range(num_rows)]
        if reduce_each_step:
            return tuple(acc + jnp.sum(p, axis=0) for acc, p in zip(accs, products))
        return tuple(acc + p for acc, p in zip(accs, products))

    accs = jax.lax.fori_loop(first, last, body, tuple(jnp.zeros(acc_shape, jnp.float32) for _ in range(num_rows)))
    for r, acc in enumerate(accs):  # rows past num_rows are padding, sliced off by the caller
        if not reduce_each_step:
            acc = jnp.sum(acc, axis=0)
        if apply_scale:
            acc = acc * s_ref[...].astype(jnp.float32)
        o_ref[r, :] = acc.astype(o_ref.dtype)


def _w8a16_kmajor_kernel(x_ref, w_ref, s_ref, o_ref, *, block_k, steps_per_split, num_steps, apply_scale, tile_rows):
    """Few rows against K-major int8 weights: x [M, K] is read as a `tile_rows`-row tile (rows past M
    masked to zero, so the caller pads nothing) and w_ref [block_n, K] holds whole contiguous rows of
    W^T, so every weight load is a run of K bytes. The int8 tile is converted in registers (by
    exponent bits, exact) and multiplied on the tensor cores: x @ w^T, both operands K-major."""
    split = pl.program_id(1)
    first = split * steps_per_split
    last = jnp.minimum(first + steps_per_split, num_steps)
    rows = pl.ds(0, tile_rows)
    live = (jnp.arange(tile_rows) < x_ref.shape[0])[:, None]  # [tile_rows, 1]

    def body(step, acc):
        k = pl.ds(pl.multiple_of(step * block_k, block_k), block_k)
        x = pltr.load(x_ref.at[rows, k], mask=live, other=0)  # [tile_rows, block_k]
        w = int8_to_f32(w_ref[:, k], True).astype(x.dtype)  # [block_n, block_k]
        return acc + pltr.dot(x, w, trans_b=True)

    acc = jax.lax.fori_loop(first, last, body, jnp.zeros((tile_rows, o_ref.shape[-1]), jnp.float32))
    if apply_scale:
        acc = acc * s_ref[...].astype(jnp.float32)[None, :]
    pltr.store(o_ref.at[rows, :], acc.astype(o_ref.dtype), mask=live)


def _w8a16_kmajor_gemv_kernel(x_ref, w_ref, s_ref, o_ref, *, block_k, steps_per_split, num_steps, apply_scale,
                              reduce_each_step):
    """One or two rows against K-major int8 weights on the CUDA cores: each weight row is a contiguous
    run of K bytes, so a [block_n, block_k] tile is block_n coalesced runs, and the row's dot products
    are per-thread FMAs along `in` plus one reduction (after the loop by default, as the [in, out]
    GEMV does; every step with reduce_each_step, which leaves room for wider block_k)."""
    split = pl.program_id(1)
    first = split * steps_per_split
    last = jnp.minimum(first + steps_per_split, num_steps)
    num_rows, block_n = o_ref.shape
    acc_shape = (block_n,) if reduce_each_step else (block_n, block_k)

    def body(step, accs):
        k = pl.ds(pl.multiple_of(step * block_k, block_k), block_k)
        w = int8_to_f32(w_ref[:, k], True)  # [block_n, block_k]
        products = [w * x_ref[r, k].astype(jnp.float32)[None, :] for r in range(num_rows)]
        if reduce_each_step:
            return tuple(acc + jnp.sum(p, axis=1) for acc, p in zip(accs, products))
        return tuple(acc + p for acc, p in zip(accs, products))

    accs = jax.lax.fori_loop(first, last, body, tuple(jnp.zeros(acc_shape, jnp.float32) for _ in range(num_rows)))
    for r, acc in enumerate(accs):
        if not reduce_each_step:
            acc = jnp.sum(acc, axis=1)
        if apply_scale:
            acc = acc * s_ref[...].astype(jnp.float32)
        o_ref[r, :] = acc.astype(o_ref.dtype)


def _w8a8_kernel(x_ref, xs_ref, w_ref, s_ref, o_ref, *, block_k, num_steps, kmajor):
    def body(step, acc):
        k = pl.ds(step * block_k, block_k)
        x = x_ref[:, k]  # [block_m, block_k] int8
        if kmajor:  # w_ref holds W^T, [block_n, K]: both dot operands contiguous along K
            return acc + pltr.dot(x, w_ref[:, k], trans_b=True)  # int32
        return acc + pltr.dot(x, w_ref[k, :])  # [block_k, block_n] int8 -> int32

    acc_dtype = jnp.int32 if jnp.issubdtype(x_ref.dtype, jnp.integer) else jnp.float32  # fp8: f32 sums
    acc = jax.lax.fori_loop(0, num_steps, body, jnp.zeros(o_ref.shape, acc_dtype))  # [block_m, block_n]
    out = acc.astype(jnp.float32) * xs_ref[...][:, None] * s_ref[...].astype(jnp.float32)[None, :]
    o_ref[...] = out.astype(o_ref.dtype)


def _choose_splits(tiles: int, num_steps: int) -> int:
    """Split-K count for a W8A16 call of `tiles` output tiles and `num_steps` K steps: enough
    programs for two per SM, at least 4 steps per split, and (H200 sweeps, 2026-11-29) a count
    that divides the steps, so no split is short: 14336x4096 at M=1, 8 splits of 14 steps 22.2 us
    vs 9 of ~12.4 27.1 us; 4096x14336, 2 of 16 22.9 us vs 3 of ~10.7 26.1 us."""
    if tiles >= 2 * NUM_SMS:
        return 1
    target = max(1, min(-(-2 * NUM_SMS // tiles), num_steps // 4))
    return max(s for s in range(1, target + 1) if num_steps % s == 0)


def _pad_rows(x, multiple):
    pad = -x.shape[0] % multiple
    return jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1)) if pad else x


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "block_n", "block_k", "num_splits", "num_warps", "num_stages", "gemv", "reduce_each_step", "magic_convert"))
def w8a16_matmul(x, w: QuantizedWeight, out_dtype=None, *, interpret=None, block_n=None, block_k=None, num_splits=None,
                 num_warps=None, num_stages=4, gemv=None, reduce_each_step=False, magic_convert=None):
    """x: [M, in] (bf16/f32) times int8 w.values [in, out] * w.scales [out] -> [M, out].

    `magic_convert` converts int8 by exponent bits (quantization.int8_to_f32). Default: on the GEMV
    path, where the H200 runs of 2026-11-29 measured it faster at every Llama-3-8B shape (e.g.
    30.5 -> 26.4 us at 4096x14336, 320 -> 200 us for the lm_head); it made no difference on the
    tensor-core path. Both conversions are exact."""
    out_dtype = out_dtype or x.dtype
    m, k = x.shape
    n = w.values.shape[1]
    gemv = m <= _GEMV_MAX_ROWS if gemv is None else gemv
    # The GEMV path reads only its num_rows rows, so its row block is the rows themselves (a power
    # of two): no XLA pad of x before the kernel, no slice after it. Tensor-core tiles need 16 rows.
    block_m = next_pow2(m) if gemv else 16 if m <= 16 else 64
    magic_convert = gemv if magic_convert is None else magic_convert
    # Tile sizes from the H200 sweep in docs/BENCHMARKS.md (best of those tried at M=1).
    block_n = block_n or largest_pow2_divisor(n, 128 if gemv or m > 16 else 64)
    num_warps = num_warps or (8 if gemv else 4)
    # GEMV rows each hold a [block_k, block_n] f32 accumulator: cap rows * block_k * block_n
    # at 16K elements (64 registers per thread at 8 warps).
    gemv_k_cap = 128 if reduce_each_step else max(16, 16384 // (block_n * m))
    block_k = block_k or largest_pow2_divisor(k, gemv_k_cap if gemv else 128 if m <= 16 else 64)
    num_steps = k // block_k
    tiles = -(-m // block_m) * (n // block_n)
    num_splits = num_splits or _choose_splits(tiles, num_steps)
    steps_per_split = -(-num_steps // num_splits)
    xp = _pad_rows(x, block_m)  # [M_pad, in]
    common = dict(block_k=block_k, steps_per_split=steps_per_split, num_steps=num_steps, apply_scale=num_splits == 1)
    kernel = (functools.partial(_w8a16_gemv_kernel, num_rows=m, reduce_each_step=reduce_each_step,
                                magic_convert=magic_convert, **common) if gemv
              else functools.partial(_w8a16_kernel, magic_convert=magic_convert, **common))
    out_type = out_dtype if num_splits == 1 else jnp.float32
    y = pl.pallas_call(
        kernel,
        grid=(xp.shape[0] // block_m, n // block_n, num_splits),
        in_specs=[
            pl.BlockSpec((block_m, k), lambda i, j, s: (i, 0)),
            pl.BlockSpec((k, block_n), lambda i, j, s: (0, j)),
            pl.BlockSpec((block_n,), lambda i, j, s: (j,)),
        ],
        out_specs=pl.BlockSpec((None, block_m, block_n), lambda i, j, s: (s, i, j)),
        out_shape=jax.ShapeDtypeStruct((num_splits, xp.shape[0], n), out_type),  # [splits, M_pad, out]
        interpret=pallas_mode.resolve(interpret),
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"w8a16_{'gemv' if gemv else 'dot'}_bm{block_m}_bn{block_n}_bk{block_k}_s{num_splits}",
    )(xp, w.values, w.scales)
    if num_splits > 1:
        y = (jnp.sum(y, axis=0) * w.scales.astype(jnp.float32)).astype(out_dtype)[None]
    return y[0, :m]


KMAJOR_MAX_ROWS = 16  # the K-major W8A16 kernel's row tile (the tensor cores' smallest): steps up to 16 tokens
# matmul_impl="auto" sends K-major weight-only int8 steps of up to KMAJOR_GEMV_MAX_ROWS rows to
# w8a16_kmajor_matmul's GEMV path: at one row it beat XLA's dequantize-dot at every Llama-3-8B shape
# on the H200 (4096x14336 19.3 vs 40.6 us, the lm_head 145 vs 180 us; docs/BENCHMARKS.md, 2026-12-01).
# At two rows XLA's is the faster (18.5 us at 4096x14336, the GEMV 32.7). The tensor-core path (up to
# KMAJOR_PALLAS_MAX_ROWS, 0: off) lost to XLA at 8 rows at every shape (e.g. 4096x28672 37.1 vs 32.5 us,
# 4096x6144 12.7 vs 9.6). So every step of two rows or more stays XLA's.
KMAJOR_GEMV_MAX_ROWS = 1
KMAJOR_PALLAS_MAX_ROWS = 0
# Steps of MOSAIC_W8A16_MIN_ROWS to MOSAIC_W8A16_MAX_ROWS rows (a multiple of 8) on K-major weight-only
# int8 run the Mosaic GPU kernel (w8a16_mosaic.py) with these options; MAX 0: off. Off because on the
# H200 it lost end to end although it wins alone (docs/BENCHMARKS.md, ninth session): batch-1 decode
# 3.21 against 2.91 ms of device time a step, offline serving at 32 sequences 1,650 against 1,962
# output tok/s and a tie at 16 (1,842 / 1,846), its activation split and split-K sums adding kernels. Its
# bf16-activation mode (no split kernels, 2 programs per SM) lost too (twelfth session): 1,878 against 2,173 at 32.
MOSAIC_W8A16_MIN_ROWS = 9  # 8-row steps (batch-1 decode): its matmuls tied XLA's in the engine (63.1 vs 63.9 us a layer)
MOSAIC_W8A16_MAX_ROWS = 0
MOSAIC_W8A16_OPTIONS = dict(int8_activations=True)


def _kmajor_gemv_tiles(k: int, n: int) -> tuple:
    """(block_n, block_k, num_splits or None for _choose_splits) of the K-major GEMV, the best of the
    H200 sweep at one row (2026-12-01, docs/BENCHMARKS.md): wide layers 16 x 256 tiles in one pass
    (4096x14336 19.3 us, 82% of copy; the lm_head 4096x128256 145 us, 98%); narrow ones 8 x 512 for
    more programs (4096x6144 10.4 us, 4096x4096 8.8); narrow and long (14336x4096) 16 x 512 with
    split-K, whose XLA sum still beat one pass (23.1 vs 26.0 us)."""
    if n >= 8192:
        return 16, 256, 1
    return (16, 512, None) if k >= 8192 else (8, 512, 1)


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "block_n", "block_k", "num_splits", "num_warps", "num_stages",
                                             "gemv", "reduce_each_step"))
def w8a16_kmajor_matmul(x, w: QuantizedWeightT, out_dtype=None, *, interpret=None, block_n=None, block_k=None,
                        num_splits=None, num_warps=None, num_stages=None, gemv=False, reduce_each_step=False):
    """x: [M <= 16, in] (bf16/f16) times int8 w.values_t [out, in] * w.scales [out] -> [M, out]: decode
    steps against weights stored K-major (QuantizedWeightT, what the engine keeps on GPU).
    gemv=True (M <= 2): CUDA-core multiply-and-reduce instead of a 16-row tensor-core tile."""
    out_dtype = out_dtype or x.dtype
    m, k = x.shape
    n = w.values_t.shape[0]
    if m > (2 if gemv else KMAJOR_MAX_ROWS):
        raise ValueError(f"w8a16_kmajor_matmul takes at most {2 if gemv else KMAJOR_MAX_ROWS} rows"
                         f"{' with gemv=True' if gemv else ''}, got x of shape {x.shape}")
    if gemv and not (block_n or block_k or num_splits):
        block_n, block_k, num_splits = _kmajor_gemv_tiles(k, n)
    block_n = largest_pow2_divisor(n, block_n or 64)  # tiles as asked, or the largest that divide the shape
    block_k = largest_pow2_divisor(k, block_k or 256)
    num_steps = k // block_k
    num_splits = min(num_splits or _choose_splits(n // block_n, num_steps), num_steps)
    steps_per_split = -(-num_steps // num_splits)
    common = dict(block_k=block_k, steps_per_split=steps_per_split, num_steps=num_steps, apply_scale=num_splits == 1)
    kernel = (functools.partial(_w8a16_kmajor_gemv_kernel, reduce_each_step=reduce_each_step, **common) if gemv
              else functools.partial(_w8a16_kmajor_kernel, tile_rows=KMAJOR_MAX_ROWS, **common))
    out_type = out_dtype if num_splits == 1 else jnp.float32
    y = pl.pallas_call(
        kernel,
        grid=(n // block_n, num_splits),
        in_specs=[
            pl.BlockSpec((m, k), lambda j, s: (0, 0)),
            pl.BlockSpec((block_n, k), lambda j, s: (j, 0)),
            pl.BlockSpec((block_n,), lambda j, s: (j,)),
        ],
        out_specs=pl.BlockSpec((None, m, block_n), lambda j, s: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((num_splits, m, n), out_type),  # [splits, M, out]
        interpret=pallas_mode.resolve(interpret),
        compiler_params=pltr.CompilerParams(num_warps=num_warps or 4, num_stages=num_stages or 4),
        name=f"w8a16_kmajor_{'gemv_' if gemv else ''}bn{block_n}_bk{block_k}_s{num_splits}",
    )(x, w.values_t, w.scales)
    if num_splits > 1:
        return (jnp.sum(y, axis=0) * w.scales.astype(jnp.float32)).astype(out_dtype)
    return y[0]


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "block_m", "block_n", "block_k", "num_warps", "num_stages"))
def w8a8_matmul(x, w, out_dtype=None, *, interpret=None, block_m=None, block_n=None, block_k=None, num_warps=None,
                num_stages=None):
    """Per-token int8 x: [M, in] times int8 weights -> [M, out]; int32 accumulation.

    w: a W8A8WeightT (values [out, in], K-major), the fast layout: Hopper's 8-bit wgmma takes both
    operands contiguous along the summed axis. An [in, out] QuantizedWeight also works, but Triton
    then cannot use wgmma (H200, 4096x4096x14336: 1291 us at best vs 386 us K-major,
    docs/BENCHMARKS.md); it stays for that comparison. Weights in fp8 (e4m3) make it an fp8 x fp8
    matmul with float32 sums (benchmarks only: its fp8 tiles were slower than XLA's fp8 dot, 1007
    vs 798 us at 4096 x 4096 x 14336, and than bf16, so no quantization mode makes them)."""
    out_dtype = out_dtype or x.dtype
    m, k = x.shape
    kmajor = isinstance(w, W8A8WeightT)
    values = w.values_t if kmajor else w.values
    n = values.shape[0 if kmajor else 1]
    xq, x_scales = quantize_activations(x, values.dtype)  # [M, in] int8 (or fp8 for fp8 weights), [M, 1] f32
    block_m = block_m or (16 if m <= 16 else 64 if m <= 64 else 128)
    # Tile defaults: the fastest tried on the H200 at 4096 x 14336 (docs/BENCHMARKS.md): K-major,
    # 128 x 128 x 128, 4 warps, 3 stages from 128 rows, 64-wide tiles with 4 stages below (more
    # programs); [in, out] 128 x 64 x 128, 4 warps, 4 stages.
    few_rows = m <= 64
    block_n = block_n or largest_pow2_divisor(n, 128 if kmajor and not few_rows else 64)
    block_k = block_k or largest_pow2_divisor(k, 128)
    num_warps = num_warps or 4
    num_stages = num_stages or (3 if kmajor and not few_rows else 4)
    xq = _pad_rows(xq, block_m)
    x_scales = _pad_rows(x_scales[:, 0], block_m)  # [M_pad]
    kernel = functools.partial(_w8a8_kernel, block_k=block_k, num_steps=k // block_k, kmajor=kmajor)
    y = pl.pallas_call(
        kernel,
        grid=(xq.shape[0] // block_m, n // block_n),
        in_specs=[
            pl.BlockSpec((block_m, k), lambda i, j: (i, 0)),
            pl.BlockSpec((block_m,), lambda i, j: (i,)),
            pl.BlockSpec((block_n, k), lambda i, j: (j, 0)) if kmajor else pl.BlockSpec((k, block_n), lambda i, j: (0, j)),
            pl.BlockSpec((block_n,), lambda i, j: (j,)),
        ],
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((xq.shape[0], n), out_dtype),  # [M_pad, out]
        interpret=pallas_mode.resolve(interpret),
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"w8a8_bm{block_m}_bn{block_n}_bk{block_k}{'_kmajor' if kmajor else ''}",
    )(xq, x_scales, values, w.scales)
    return y[:m]


def _fits(w) -> bool:
    """Tiles need `in` and `out` to be multiples of 16 (tensor-core minimum)."""
    values = w.values_t if isinstance(w, (W8A8WeightT, QuantizedWeightT)) else w.values
    return values.ndim == 2 and all(d % 16 == 0 for d in values.shape)


def _rows(x) -> int:
    return math.prod(x.shape[:-1])


def _w8a8(x, w, out_dtype, interpret):
    """K-major W8A8 weights: the Pallas kernel from W8A8_PALLAS_MIN_ROWS rows, XLA's int8 dot below."""
    if not _fits(w) or _rows(x) < W8A8_PALLAS_MIN_ROWS:
        return matmul_reference.matmul(x, w, out_dtype)
    y = w8a8_matmul(x.reshape(-1, x.shape[-1]), w, out_dtype, interpret=interpret)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def matmul(x, w, out_dtype=None, *, interpret=None):
    """matmul_impl="pallas". Same contract as matmul_reference.matmul: x [..., in] times w -> [..., out]."""
    if isinstance(w, W8A8WeightT):
        return _w8a8(x, w, out_dtype, interpret)
    if not isinstance(w, QuantizedWeight) or isinstance(w, W8A8Weight) or not _fits(w):
        # Plain weights: cuBLAS. [in, out] W8A8 weights (the engine makes them K-major when this
        # path is on, except under a mesh): XLA's int8 dot. Odd-shaped int8 weights (never seen
        # in Llama-family models) take the XLA path rather than failing.
        return matmul_reference.matmul(x, w, out_dtype)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])  # [M, in]
    opts = {k: v for k, v in W8A16_OPTIONS.items() if not k.startswith("kmajor")}  # those are _kmajor_w8a16's
    gemv = x2.shape[0] <= opts.pop("gemv_max_rows", _GEMV_MAX_ROWS)
    y = w8a16_matmul(x2, w, out_dtype, interpret=interpret, gemv=gemv, **opts)
    return y.reshape(*lead, y.shape[-1])


def _kmajor_w8a16(x, w, out_dtype, interpret):
    """K-major weight-only int8: the Pallas GEMV for steps of up to KMAJOR_GEMV_MAX_ROWS rows, the
    kernel's tensor-core path up to KMAJOR_PALLAS_MAX_ROWS (W8A16_OPTIONS "kmajor_gemv_max_rows" and
    "kmajor_max_rows" override them; "kmajor" holds tile options), XLA's dequantize-dot otherwise."""
    opts = dict(W8A16_OPTIONS)
    rows = _rows(x)
    gemv = rows <= min(opts.pop("kmajor_gemv_max_rows", KMAJOR_GEMV_MAX_ROWS), 2)
    mosaic_rows = (opts.pop("kmajor_mosaic_min_rows", MOSAIC_W8A16_MIN_ROWS), opts.pop("kmajor_mosaic_max_rows", MOSAIC_W8A16_MAX_ROWS))
    if not gemv and mosaic_rows[0] <= rows <= mosaic_rows[1] and w8a16_mosaic.supports(x, w):
        y = w8a16_mosaic.w8a16_mosaic_matmul(x.reshape(-1, x.shape[-1]), w, out_dtype, interpret=interpret,
                                             **(MOSAIC_W8A16_OPTIONS | opts.get("mosaic", {})))
        return y.reshape(*x.shape[:-1], y.shape[-1])
    tensor_cores = rows <= min(opts.pop("kmajor_max_rows", KMAJOR_PALLAS_MAX_ROWS), KMAJOR_MAX_ROWS)
    if not (gemv or tensor_cores) or x.dtype not in (jnp.bfloat16, jnp.float16) or not _fits(w):
        return matmul_reference.matmul(x, w, out_dtype)
    y = w8a16_kmajor_matmul(x.reshape(-1, x.shape[-1]), w, out_dtype, interpret=interpret, gemv=gemv, **opts.get("kmajor", {}))
    return y.reshape(*x.shape[:-1], y.shape[-1])


def matmul_gpu_default(x, w, out_dtype=None, *, interpret=None):
    """matmul_impl="auto" on GPU: the Pallas kernel for K-major W8A8 weights, the Pallas K-major GEMV
    for one-row steps on K-major weight-only int8, XLA for everything else (XLA's fused dequantize-dot
    beat the W8A16 kernels from two rows up: dispatch.py, KMAJOR_GEMV_MAX_ROWS; at prefill sizes it
    also beat converting the weights apart for cuBLAS and a Pallas bf16-tensor-core kernel: docs/BENCHMARKS.md,
    eleventh session)."""
    if isinstance(w, W8A8WeightT):
        return _w8a8(x, w, out_dtype, interpret)
    if isinstance(w, QuantizedWeightT):
        return _kmajor_w8a16(x, w, out_dtype, interpret)
    return matmul_reference.matmul(x, w, out_dtype)
