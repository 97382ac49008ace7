"""int8 matmuls in Pallas (Triton backend; pallas_mode.py says why not Mosaic GPU).

W8A16 (QuantizedWeight, [in, out]; matmul_impl="pallas"): int8 weights are converted to the
activation dtype in registers, so HBM traffic is one byte per weight: the decode (GEMV-like) path,
where reading the weights is the whole cost. Few output tiles (small `out`, batch 1) are split
along `in` (split-K) so the GPU is full; partial sums are added in XLA.

W8A8 (W8A8WeightT, weights stored [out, in]): activations are quantized per token in XLA, then
int8 x int8 tiles accumulate in int32 on the tensor cores; both scales are applied once at the end.
Serves prefill, where the matmul is compute-bound; it is the engine's W8A8 path on GPU by default
(matmul_gpu_default): on the H200, 1.4x XLA's int8 dot on the same weights.

W8A16 on K-major weights (QuantizedWeightT, values [out, in]: how the engine stores weight-only int8
on GPU for XLA's dequantize-dot): w8a16_kmajor_matmul, a GEMV for one or two rows. It reads each
output's weights as one contiguous run and needs no split-K at the wide layers: on the H200 it reads
a 4096x14336 layer at 82% of the copy rate in a single launch, and "auto" uses it for one-row steps.
From two rows up XLA's dequantize-dot is the faster (docs/BENCHMARKS.md), so those steps stay XLA's.

Plain (unquantized) weights go to XLA's dot (cuBLAS), which a Pallas GEMM would not beat.
"""
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from jlight.pallas_kernels import matmul_reference, pallas_mode
from jlight.core.quantization import (
    QuantizedWeight, QuantizedWeightT, W8A8Weight, W8A8WeightT, int8_to_f32, quantize_activations)
from jlight.pallas_kernels.tiling import NUM_SMS, largest_pow2_divisor, next_pow2

# Steps of fewer rows send K-major W8A8 weights to XLA's int8 dot. H200, 4096x14336 (docs/BENCHMARKS.md):
# 8 rows XLA 21.2 us vs the kernel's best 21.7; 64 rows 28.3 vs 23.7; 512 rows 82.4 vs 62.0.
W8A8_PALLAS_MIN_ROWS = 64
_GEMV_MAX_ROWS = 4  # up to this many rows, W8A16 reduces on CUDA cores (no tensor-core tile)
# matmul_impl="auto" sends K-major weight-only int8 steps of up to KMAJOR_GEMV_MAX_ROWS rows to
# w8a16_kmajor_matmul: at one row it beat XLA's dequantize-dot at every Llama-3-8B shape on the H200
# (4096x14336 19.3 vs 40.6 us, the lm_head 145 vs 180 us; docs/BENCHMARKS.md). At two rows XLA's is
# the faster (18.5 us at 4096x14336, the GEMV 32.7), so every step of two rows or more stays XLA's.
KMAJOR_GEMV_MAX_ROWS = 1


def _w8a16_kernel(x_ref, w_ref, s_ref, o_ref, *, block_k, steps_per_split, num_steps, apply_scale):
    """Tensor-core tiles; the int8 tile is converted to x's dtype (exact) in registers."""
    split = pl.program_id(2)
    first = split * steps_per_split
    last = jnp.minimum(first + steps_per_split, num_steps)

    def body(step, acc):
        x = x_ref[:, pl.ds(step * block_k, block_k)]  # [block_m, block_k]
        w = w_ref[pl.ds(step * block_k, block_k), :].astype(x.dtype)  # [block_k, block_n]
        return acc + pltr.dot(x, w).astype(jnp.float32)

    acc = jax.lax.fori_loop(first, last, body, jnp.zeros(o_ref.shape, jnp.float32))  # [block_m, block_n]
    if apply_scale:
        acc = acc * s_ref[...].astype(jnp.float32)[None, :]
    o_ref[...] = acc.astype(o_ref.dtype)


def _w8a16_gemv_kernel(x_ref, w_ref, s_ref, o_ref, *, block_k, steps_per_split, num_steps, apply_scale, num_rows):
    """For a few rows: multiply-and-reduce on the CUDA cores instead of a 16-row
    tensor-core tile that would be mostly padding; the weight tile is loaded once.

    Each row keeps a [block_k, block_n] float32 accumulator of elementwise products and
    reduces it over `in` once, after the loop: the loop body is loads, converts (by exponent
    bits, quantization.int8_to_f32) and FMAs only, with no cross-thread reduction per step.
    """
    split = pl.program_id(2)
    first = split * steps_per_split
    last = jnp.minimum(first + steps_per_split, num_steps)
    block_n = o_ref.shape[1]

    def body(step, accs):
        k = pl.ds(step * block_k, block_k)
        w = int8_to_f32(w_ref[k, :])  # [block_k, block_n]
        return tuple(acc + x_ref[r, k].astype(jnp.float32)[:, None] * w for r, acc in enumerate(accs))

    accs = jax.lax.fori_loop(first, last, body, tuple(jnp.zeros((block_k, block_n), jnp.float32) for _ in range(num_rows)))
    for r, acc in enumerate(accs):  # rows past num_rows are padding, sliced off by the caller
        acc = jnp.sum(acc, axis=0)
        if apply_scale:
            acc = acc * s_ref[...].astype(jnp.float32)
        o_ref[r, :] = acc.astype(o_ref.dtype)


def _w8a16_kmajor_gemv_kernel(x_ref, w_ref, s_ref, o_ref, *, block_k, steps_per_split, num_steps, apply_scale):
    """One or two rows against K-major int8 weights on the CUDA cores: each weight row is a contiguous
    run of K bytes, so a [block_n, block_k] tile is block_n coalesced runs, and the row's dot products
    are per-thread FMAs along `in` plus one reduction after the loop."""
    split = pl.program_id(1)
    first = split * steps_per_split
    last = jnp.minimum(first + steps_per_split, num_steps)
    num_rows, block_n = o_ref.shape

    def body(step, accs):
        k = pl.ds(pl.multiple_of(step * block_k, block_k), block_k)
        w = int8_to_f32(w_ref[:, k])  # [block_n, block_k]
        return tuple(acc + w * x_ref[r, k].astype(jnp.float32)[None, :] for r, acc in enumerate(accs))

    accs = jax.lax.fori_loop(first, last, body, tuple(jnp.zeros((block_n, block_k), jnp.float32) for _ in range(num_rows)))
    for r, acc in enumerate(accs):
        acc = jnp.sum(acc, axis=1)
        if apply_scale:
            acc = acc * s_ref[...].astype(jnp.float32)
        o_ref[r, :] = acc.astype(o_ref.dtype)


def _w8a8_kernel(x_ref, xs_ref, w_ref, s_ref, o_ref, *, block_k, num_steps):
    def body(step, acc):
        k = pl.ds(step * block_k, block_k)
        # x [block_m, block_k] int8; w_ref holds W^T, [block_n, K]: both dot operands contiguous along K
        return acc + pltr.dot(x_ref[:, k], w_ref[:, k], trans_b=True)  # int32

    acc = jax.lax.fori_loop(0, num_steps, body, jnp.zeros(o_ref.shape, jnp.int32))  # [block_m, block_n]
    out = acc.astype(jnp.float32) * xs_ref[...][:, None] * s_ref[...].astype(jnp.float32)[None, :]
    o_ref[...] = out.astype(o_ref.dtype)


def _choose_splits(tiles: int, num_steps: int) -> int:
    """Split-K count for a W8A16 call of `tiles` output tiles and `num_steps` K steps: enough
    programs for two per SM, at least 4 steps per split, and (H200 sweeps) a count
    that divides the steps, so no split is short: 14336x4096 at M=1, 8 splits of 14 steps 22.2 us
    vs 9 of ~12.4 27.1 us; 4096x14336, 2 of 16 22.9 us vs 3 of ~10.7 26.1 us."""
    if tiles >= 2 * NUM_SMS:
        return 1
    target = max(1, min(-(-2 * NUM_SMS // tiles), num_steps // 4))
    return max(s for s in range(1, target + 1) if num_steps % s == 0)


def _pad_rows(x, multiple):
    pad = -x.shape[0] % multiple
    return jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1)) if pad else x


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "block_n", "block_k", "num_splits", "num_warps", "num_stages", "gemv"))
def w8a16_matmul(x, w: QuantizedWeight, out_dtype=None, *, interpret=None, block_n=None, block_k=None, num_splits=None,
                 num_warps=None, num_stages=4, gemv=None):
    """x: [M, in] (bf16/f32) times int8 w.values [in, out] * w.scales [out] -> [M, out].

    gemv (default: M <= 4) reduces on the CUDA cores and converts int8 by exponent bits
    (quantization.int8_to_f32: faster than the convert instruction at every Llama-3-8B shape on the
    H200, e.g. 30.5 -> 26.4 us at 4096x14336, 320 -> 200 us for the lm_head); the tensor-core path
    converts with the instruction (exponent bits made no difference there). Both conversions are exact."""
    out_dtype = out_dtype or x.dtype
    m, k = x.shape
    n = w.values.shape[1]
    gemv = m <= _GEMV_MAX_ROWS if gemv is None else gemv
    # The GEMV path reads only its num_rows rows, so its row block is the rows themselves (a power
    # of two): no XLA pad of x before the kernel, no slice after it. Tensor-core tiles need 16 rows.
    block_m = next_pow2(m) if gemv else 16 if m <= 16 else 64
    # Tile sizes from the H200 sweep in docs/BENCHMARKS.md (best of those tried at M=1).
    block_n = block_n or largest_pow2_divisor(n, 128 if gemv or m > 16 else 64)
    num_warps = num_warps or (8 if gemv else 4)
    # GEMV rows each hold a [block_k, block_n] f32 accumulator: cap rows * block_k * block_n
    # at 16K elements (64 registers per thread at 8 warps).
    gemv_k_cap = max(16, 16384 // (block_n * m))
    block_k = block_k or largest_pow2_divisor(k, gemv_k_cap if gemv else 128 if m <= 16 else 64)
    num_steps = k // block_k
    tiles = -(-m // block_m) * (n // block_n)
    num_splits = num_splits or _choose_splits(tiles, num_steps)
    steps_per_split = -(-num_steps // num_splits)
    xp = _pad_rows(x, block_m)  # [M_pad, in]
    common = dict(block_k=block_k, steps_per_split=steps_per_split, num_steps=num_steps, apply_scale=num_splits == 1)
    kernel = (functools.partial(_w8a16_gemv_kernel, num_rows=m, **common) if gemv
              else functools.partial(_w8a16_kernel, **common))
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


def _kmajor_gemv_tiles(k: int, n: int) -> tuple:
    """(block_n, block_k, num_splits or None for _choose_splits) of the K-major GEMV, the best of the
    H200 sweep at one row (docs/BENCHMARKS.md): wide layers 16 x 256 tiles in one pass
    (4096x14336 19.3 us, 82% of copy; the lm_head 4096x128256 145 us, 98%); narrow ones 8 x 512 for
    more programs (4096x6144 10.4 us, 4096x4096 8.8); narrow and long (14336x4096) 16 x 512 with
    split-K, whose XLA sum still beats one pass (23.1 vs 26.0 us)."""
    if n >= 8192:
        return 16, 256, 1
    return (16, 512, None) if k >= 8192 else (8, 512, 1)


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "block_n", "block_k", "num_splits", "num_warps", "num_stages"))
def w8a16_kmajor_matmul(x, w: QuantizedWeightT, out_dtype=None, *, interpret=None, block_n=None, block_k=None,
                        num_splits=None, num_warps=4, num_stages=4):
    """x: [M <= 2, in] (bf16/f16) times int8 w.values_t [out, in] * w.scales [out] -> [M, out]: decode
    steps against weights stored K-major (QuantizedWeightT, what the engine keeps on GPU), multiplied
    and reduced on the CUDA cores. Tiles not given are _kmajor_gemv_tiles'."""
    out_dtype = out_dtype or x.dtype
    m, k = x.shape
    n = w.values_t.shape[0]
    if m > 2:
        raise ValueError(f"w8a16_kmajor_matmul takes at most 2 rows, got x of shape {x.shape}; "
                         "XLA's dequantize-dot (matmul_reference.matmul) takes more")
    default_n, default_k, default_splits = _kmajor_gemv_tiles(k, n)
    block_n = largest_pow2_divisor(n, block_n or default_n)  # tiles as asked, or the largest that divide the shape
    block_k = largest_pow2_divisor(k, block_k or default_k)
    num_steps = k // block_k
    num_splits = min(num_splits or default_splits or _choose_splits(n // block_n, num_steps), num_steps)
    steps_per_split = -(-num_steps // num_splits)
    kernel = functools.partial(_w8a16_kmajor_gemv_kernel, block_k=block_k, steps_per_split=steps_per_split,
                               num_steps=num_steps, apply_scale=num_splits == 1)
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
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"w8a16_kmajor_gemv_bn{block_n}_bk{block_k}_s{num_splits}",
    )(x, w.values_t, w.scales)
    if num_splits > 1:
        return (jnp.sum(y, axis=0) * w.scales.astype(jnp.float32)).astype(out_dtype)
    return y[0]


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "block_m", "block_n", "block_k", "num_warps", "num_stages"))
def w8a8_matmul(x, w: W8A8WeightT, out_dtype=None, *, interpret=None, block_m=None, block_n=None, block_k=None,
                num_warps=4, num_stages=None):
    """Per-token int8 x: [M, in] times int8 weights w.values_t [out, in] * w.scales [out] -> [M, out];
    int32 accumulation. The weights are K-major (W8A8WeightT) because Hopper's 8-bit wgmma takes both
    operands contiguous along the summed axis: on [in, out] weights Triton cannot use it (H200,
    4096x4096x14336: 1291 us at best vs 386 us K-major, docs/BENCHMARKS.md)."""
    if not isinstance(w, W8A8WeightT):
        raise TypeError(f"w8a8_matmul takes K-major W8A8WeightT weights, got {type(w).__name__}; "
                        "make them with quantization.transpose_to_kmajor")
    out_dtype = out_dtype or x.dtype
    m, k = x.shape
    n = w.values_t.shape[0]
    xq, x_scales = quantize_activations(x)  # [M, in] int8, [M, 1] f32
    block_m = block_m or (16 if m <= 16 else 64 if m <= 64 else 128)
    # Tile defaults: the fastest tried on the H200 at 4096 x 14336 (docs/BENCHMARKS.md): 128 x 128 x 128,
    # 4 warps, 3 stages from 128 rows, 64-wide tiles with 4 stages below (more programs).
    few_rows = m <= 64
    block_n = block_n or largest_pow2_divisor(n, 64 if few_rows else 128)
    block_k = block_k or largest_pow2_divisor(k, 128)
    num_stages = num_stages or (4 if few_rows else 3)
    xq = _pad_rows(xq, block_m)
    x_scales = _pad_rows(x_scales[:, 0], block_m)  # [M_pad]
    kernel = functools.partial(_w8a8_kernel, block_k=block_k, num_steps=k // block_k)
    y = pl.pallas_call(
        kernel,
        grid=(xq.shape[0] // block_m, n // block_n),
        in_specs=[
            pl.BlockSpec((block_m, k), lambda i, j: (i, 0)),
            pl.BlockSpec((block_m,), lambda i, j: (i,)),
            pl.BlockSpec((block_n, k), lambda i, j: (j, 0)),
            pl.BlockSpec((block_n,), lambda i, j: (j,)),
        ],
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((xq.shape[0], n), out_dtype),  # [M_pad, out]
        interpret=pallas_mode.resolve(interpret),
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"w8a8_bm{block_m}_bn{block_n}_bk{block_k}_kmajor",
    )(xq, x_scales, w.values_t, w.scales)
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
    y = w8a16_matmul(x.reshape(-1, x.shape[-1]), w, out_dtype, interpret=interpret)  # [M, out]
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _kmajor_w8a16(x, w, out_dtype, interpret):
    """K-major weight-only int8: the Pallas GEMV for 16-bit steps of up to KMAJOR_GEMV_MAX_ROWS rows,
    XLA's dequantize-dot otherwise."""
    if _rows(x) > KMAJOR_GEMV_MAX_ROWS or x.dtype not in (jnp.bfloat16, jnp.float16) or not _fits(w):
        return matmul_reference.matmul(x, w, out_dtype)
    y = w8a16_kmajor_matmul(x.reshape(-1, x.shape[-1]), w, out_dtype, interpret=interpret)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def matmul_gpu_default(x, w, out_dtype=None, *, interpret=None):
    """matmul_impl="auto" on GPU: the Pallas kernel for K-major W8A8 weights, the Pallas K-major GEMV
    for one-row steps on K-major weight-only int8, XLA for everything else (XLA's fused dequantize-dot
    beat the W8A16 kernels from two rows up: KMAJOR_GEMV_MAX_ROWS; at prefill sizes it also beat
    converting the weights apart for cuBLAS and a Pallas bf16-tensor-core kernel: docs/BENCHMARKS.md)."""
    if isinstance(w, W8A8WeightT):
        return _w8a8(x, w, out_dtype, interpret)
    if isinstance(w, QuantizedWeightT):
        return _kmajor_w8a16(x, w, out_dtype, interpret)
    return matmul_reference.matmul(x, w, out_dtype)
