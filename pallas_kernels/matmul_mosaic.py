"""W8A16 decode matmuls through JAX's bundled Mosaic GPU mixed-type matmul (`matmul_impl="mosaic"`).

`jax.experimental.pallas.ops.gpu.hopper_mixed_type_matmul_mgpu` is a Hopper kernel: TMA copies in a
multi-stage pipeline, warp-specialized, the int8 operand converted in registers, wgmma on 64-row
tiles. It multiplies an int8 LEFT operand, so a decode step runs it transposed:

    y^T [out, M] = W^T [out, in] (int8, the 64-row operand) @ x^T [in, 16] (tokens padded to 16)

and applies the per-output-channel scales after. The weights are therefore stored transposed
(`TransposedInt8Weight`, made once by `transpose_int8_weights` when the engine prepares its params).
On the H200 (2026-11-29, docs/BENCHMARKS.md) it beat XLA's fused dequantize-dot at the engine's
8-token bucket by 11-14% (4096x14336: 23.2 vs 26.9 us; 4096x28672: 42.3 vs 47.5 us).

Steps with more than 16 tokens, shapes the kernel's tiles do not divide, and every run off the GPU
(the kernel has no interpret mode: tests check this module's XLA path on the CPU and the kernel on
the GPU) use XLA's dot over the same transposed weights.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jlight.pallas_kernels import matmul_reference
from jlight.pallas_kernels.quantization import QuantizedWeight, W8A8Weight

MAX_ROWS = 16  # the kernel's token tile: steps of up to 16 tokens (decode) take it
_TILE_OUT = 128  # two warpgroups of 64 weight rows per program
_TILE_IN = 256  # tile_k of the fastest configuration measured (4 pipeline stages)
_STAGES = 4


class TransposedInt8Weight(NamedTuple):
    values_t: jax.Array  # [..., out, in] int8
    scales: jax.Array  # [..., out] float32; weight[i, o] ~= values_t[o, i] * scales[o]


def _is_weight_only_int8(w) -> bool:
    return isinstance(w, QuantizedWeight) and not isinstance(w, W8A8Weight)


_transpose = jax.jit(lambda w: TransposedInt8Weight(jnp.swapaxes(w.values, -1, -2), w.scales))


def transpose_int8_weights(tree, delete_originals: bool = False):
    """Every weight-only int8 QuantizedWeight of a params tree as a TransposedInt8Weight (other
    leaves as they are). delete_originals frees each original once transposed (the caller must not
    use them afterwards), so the peak is one weight more than the model."""
    def convert(leaf):
        if not _is_weight_only_int8(leaf):
            return leaf
        out = _transpose(leaf)
        if delete_originals:
            jax.block_until_ready(out)
            leaf.values.delete()
        return out

    return jax.tree.map(convert, tree, is_leaf=_is_weight_only_int8)


def _kernel_fits(num_rows: int, w: TransposedInt8Weight) -> bool:
    n, k = w.values_t.shape[-2:]
    return (jax.default_backend() == "gpu" and w.values_t.ndim == 2 and num_rows <= MAX_ROWS
            and n % _TILE_OUT == 0 and k % _TILE_IN == 0)


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def mosaic_w8a16(x, w: TransposedInt8Weight, out_dtype):
    """x: [M <= 16, in] (bf16/f16) -> [M, out] = x @ (values_t^T * scales), on the GPU."""
    from jax.experimental.pallas.ops.gpu import hopper_mixed_type_matmul_mgpu as mixed

    config = mixed.TuningConfig(tile_m=64, tile_n=MAX_ROWS, tile_k=_TILE_IN, max_concurrent_steps=_STAGES,
                                epi_tile_n=MAX_ROWS, epi_tile_m=64, wg_dimension=mixed.MatmulDimension.M)
    m = x.shape[0]
    xt = jnp.pad(x, ((0, MAX_ROWS - m), (0, 0))).T  # [in, 16]
    yt = mixed.mixed_matmul_kernel(w.values_t, xt, out_dtype=jnp.float32, config=config)  # [out, 16]
    return (yt[:, :m].T * w.scales.astype(jnp.float32)).astype(out_dtype)


def _xla(x, w: TransposedInt8Weight, out_dtype):
    """The same product through XLA (dequantize fused into the dot; the transpose is free)."""
    y = jax.lax.dot_general(x, w.values_t.astype(x.dtype), (((x.ndim - 1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)
    return (y * w.scales.astype(jnp.float32)).astype(out_dtype)


def matmul(x, w, out_dtype=None):
    """Same contract as matmul_reference.matmul; TransposedInt8Weight weights take the kernel when
    it fits (GPU, <= 16 tokens, tile-aligned shapes, bf16/f16 activations), else XLA."""
    if not isinstance(w, TransposedInt8Weight):
        return matmul_reference.matmul(x, w, out_dtype)
    out_dtype = out_dtype or x.dtype
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])  # [M, in]
    if _kernel_fits(x2.shape[0], w) and x2.dtype in (jnp.bfloat16, jnp.float16):
        y = mosaic_w8a16(x2, w, out_dtype)
    else:
        y = _xla(x2, w, out_dtype)
    return y.reshape(*lead, y.shape[-1])
