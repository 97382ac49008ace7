"""Linear weights kept in a GGUF file's own block quantization, as the file stores them (or, for the
K-quants, as the same numbers in the kernel's forms).

A GGUF weight is one output channel a row ([out, in], K-major), each row in blocks of weights that share
a scale d (and, with a minimum m, weight = d * value + m):
  GGUFQ4Weight: 4-bit values (0..15) packed two a byte, 16 bytes a block of 32: value i in the low nibble
    of byte i, value 16 + i in its high nibble (GGUF's Q4_0 / Q4_1 order).
    Q4_1: d and m float16. Q4_0: Q4_1 with m = -8 d (the same numbers). Q4_K: each 32-value sub-block of a
    256-value super-block is a block with d = d_super * scale and m = -dmin_super * min (scale and min its
    6-bit integers), float32: a float16 times a 6-bit integer is exact in float32, not in float16.
  GGUFQ8Weight: int8 values, weight = d * value.
    Q8_0: blocks of 32, d float16. Q5_0: Q8_0 of its values - 16 (-16..15). Q6_K: blocks of 16 (its
    sub-blocks), values q - 32 (-32..31), d = d_super * scale (an int8), float32 (exact, as above).
  GGUFQ8MinWeight: int8 values with a minimum, weight = d * value + m, blocks of 32, d and m float32.
    Q5_K: its 5-bit values (0..31), d and m as Q4_K's.
A weight's block is in / scales.shape[-1] (32, or 16 for Q6_K); d and m have one dtype, float16 or
float32. Every float weight is the one llama.cpp's dequantization gives: d * value is exact in float32
(at most 11 + 7 + 5 significant bits), so d * value + m rounds once, as llama.cpp's d * value - m does.
Kept so, a weight costs 0.625-1.25 bytes instead of float32's 4: batch-1 decode on the CPU reads a third
to a sixth of the bytes (pallas_kernels/gguf_matmul_cpu.py multiplies them in float32, each weight
dequantized in registers). `dequantize_gguf_t` gives the float weights the loader would have made
([out, in]: the transpose of the [in, out] the other linear weights are).
All are NamedTuples of arrays whose fields are all [..., out, ...], so stacking (lax.scan), slicing and
fusing (concatenated on `out`, the rows: models/layers.fuse_projections, which fuses only weights of one
type, dtypes and block) treat them as any weight; `shape` is the logical [..., in, out].
"""
from typing import NamedTuple

import jax
import jax.numpy as jnp

GGUF_BLOCK = 32  # the values of a GGUFQ4Weight block, and of a minimum's block


class GGUFQ4Weight(NamedTuple):
    blocks: jax.Array  # [..., out, in / 2] uint8, 16 bytes a block of 32 values
    scales: jax.Array  # [..., out, in / 32] float16 or float32, d
    mins: jax.Array  # [..., out, in / 32] as scales, m

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.blocks.shape[:-2], self.blocks.shape[-1] * 2, self.blocks.shape[-2])


class GGUFQ8Weight(NamedTuple):
    values_t: jax.Array  # [..., out, in] int8
    scales: jax.Array  # [..., out, in / block] float16 (block 32) or float32 (block 32 or 16), d

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.values_t.shape[:-2], self.values_t.shape[-1], self.values_t.shape[-2])


class GGUFQ8MinWeight(NamedTuple):
    values_t: jax.Array  # [..., out, in] int8
    scales: jax.Array  # [..., out, in / 32] float32, d
    mins: jax.Array  # [..., out, in / 32] float32, m

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.values_t.shape[:-2], self.values_t.shape[-1], self.values_t.shape[-2])


GGUF_WEIGHTS = (GGUFQ4Weight, GGUFQ8Weight, GGUFQ8MinWeight)


def dequantize_gguf_t(w, dtype=jnp.float32) -> jax.Array:
    """The weights [..., out, in] in `dtype`, computed in float32 (d * value, + m where the weight has one)."""
    if isinstance(w, GGUFQ4Weight):
        packed = w.blocks.reshape(*w.blocks.shape[:-1], -1, GGUF_BLOCK // 2)  # [..., out, blocks, 16]
        values = jnp.concatenate([packed & 0xF, packed >> 4], axis=-1)  # [..., out, blocks, 32]
    elif isinstance(w, (GGUFQ8Weight, GGUFQ8MinWeight)):
        values = w.values_t.reshape(*w.values_t.shape[:-1], w.scales.shape[-1], -1)  # [..., out, blocks, block]
    else:
        raise TypeError(f"not a GGUF weight: {type(w).__name__}")
    weights = values.astype(jnp.float32) * w.scales.astype(jnp.float32)[..., None]
    if isinstance(w, (GGUFQ4Weight, GGUFQ8MinWeight)):
        weights = weights + w.mins.astype(jnp.float32)[..., None]
    return weights.reshape(*weights.shape[:-2], -1).astype(dtype)


def out_axis(w) -> int:
    """The axis of a linear weight's output channels: -2 for GGUF weights ([out, in] rows), else -1."""
    return -2 if isinstance(w, GGUF_WEIGHTS) else -1
