"""int8 weight quantization: per-output-channel symmetric scales."""
from typing import NamedTuple

import jax
import jax.numpy as jnp


class QuantizedWeight(NamedTuple):
    values: jax.Array  # [..., in, out] int8
    scales: jax.Array  # [..., out] float32; weight ~= values * scales


def quantize_int8(w: jax.Array) -> QuantizedWeight:
    """Quantize a [..., in, out] weight to int8 with one scale per output channel."""
    w32 = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=-2)
    scales = jnp.where(amax > 0, amax / 127.0, 1.0)
    values = jnp.clip(jnp.round(w32 / scales[..., None, :]), -127, 127).astype(jnp.int8)
    return QuantizedWeight(values, scales)


def dequantize(w: QuantizedWeight, dtype=jnp.float32) -> jax.Array:
    return (w.values.astype(jnp.float32) * w.scales[..., None, :]).astype(dtype)
