"""Linear weights kept in a GGUF file's own block quantization, as the file stores them.

A GGUF weight is one output channel a row ([out, in], K-major), each row in blocks of 32 weights that
share a float16 scale d (and, for Q4_1, a float16 minimum m):
  GGUFQ4Weight (Q4_1, and Q4_0 as Q4_1 with m = -8 d, the same numbers): weight = d * value + m, the
    values 4-bit (0..15) packed two a byte, 16 bytes a block: value i in the low nibble of byte i,
    value 16 + i in its high nibble (GGUF's order).
  GGUFQ8Weight (Q8_0, and Q5_0 with its values - 16): weight = d * value, the values int8.
Kept so, a weight costs 0.625 (Q4) or 1.0625 (Q8) bytes instead of float32's 4: batch-1 decode on the
CPU reads a fifth of the bytes (pallas_kernels/gguf_matmul_cpu.py multiplies them in float32, each
weight dequantized in registers). `dequantize_gguf_t` gives the float weights the loader would have made
([out, in]: the transpose of the [in, out] the other linear weights are).
Both are NamedTuples of arrays, so stacking (lax.scan), slicing and fusing (concatenated on `out`, the
rows: models/layers.fuse_projections) treat them as any weight; `shape` is the logical [..., in, out].
"""
from typing import NamedTuple

import jax
import jax.numpy as jnp

GGUF_BLOCK = 32


class GGUFQ4Weight(NamedTuple):
    blocks: jax.Array  # [..., out, in / 2] uint8, 16 bytes a block of 32 values
    scales: jax.Array  # [..., out, in / 32] float16, d
    mins: jax.Array  # [..., out, in / 32] float16, m

    @property
    def shape(self) -> tuple[int, ...]:
        lead, out, num_blocks = self.scales.shape[:-2], self.scales.shape[-2], self.scales.shape[-1]
        return (*lead, num_blocks * GGUF_BLOCK, out)


class GGUFQ8Weight(NamedTuple):
    values_t: jax.Array  # [..., out, in] int8
    scales: jax.Array  # [..., out, in / 32] float16, d

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.values_t.shape[:-2], self.values_t.shape[-1], self.values_t.shape[-2])


GGUF_WEIGHTS = (GGUFQ4Weight, GGUFQ8Weight)


def dequantize_gguf_t(w, dtype=jnp.float32) -> jax.Array:
    """The weights [..., out, in] in `dtype`, computed in float32 (d * value + m)."""
    if isinstance(w, GGUFQ4Weight):
        packed = w.blocks.reshape(*w.blocks.shape[:-1], -1, GGUF_BLOCK // 2)  # [..., out, blocks, 16]
        values = jnp.concatenate([packed & 0xF, packed >> 4], axis=-1).astype(jnp.float32)  # [..., out, blocks, 32]
        weights = values * w.scales.astype(jnp.float32)[..., None] + w.mins.astype(jnp.float32)[..., None]
    elif isinstance(w, GGUFQ8Weight):
        values = w.values_t.reshape(*w.values_t.shape[:-1], -1, GGUF_BLOCK).astype(jnp.float32)
        weights = values * w.scales.astype(jnp.float32)[..., None]
    else:
        raise TypeError(f"not a GGUF weight: {type(w).__name__}")
    return weights.reshape(*weights.shape[:-2], -1).astype(dtype)


def out_axis(w) -> int:
    """The axis of a linear weight's output channels: -2 for GGUF weights ([out, in] rows), else -1."""
    return -2 if isinstance(w, GGUF_WEIGHTS) else -1
