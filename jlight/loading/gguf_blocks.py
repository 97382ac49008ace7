"""A GGUF tensor's Q4_0 / Q4_1 / Q5_0 / Q8_0 blocks taken apart on the host, for the weights the engine keeps
as the file stores them (jlight/core/gguf_weights.py; `load_model(keep_gguf_blocks=True)`).

The file's blocks ([rows, row bytes] of a memory map) are split into their fields: Q4_1's 20-byte block
is d (float16), m (float16) and 16 bytes of nibbles; Q4_0's 18-byte block is d and the nibbles, with
value - 8 as the weight's multiple of d, kept as m = -8 d (exact: a float16 times a power of two); Q8_0's
34-byte block is d and 32 int8 values; Q5_0's 22-byte block (d, the 32 values' fifth bits, their low nibbles)
becomes a Q8_0 block of the values - 16 (-16..15), the same numbers at 1.0625 bytes a weight instead of 0.6875. Rows stay rows (output channels), so permuting them (llama.cpp's
Q/K order) and fusing weights on `out` act on whole rows.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import numpy as np

from jlight.core.gguf_weights import GGUF_BLOCK, GGUFQ4Weight, GGUFQ8Weight

KEPT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q8_0")


class GGUFHostWeight(NamedTuple):
    """One weight's fields on the host, in the GGUFQ4Weight / GGUFQ8Weight order."""
    kind: type  # GGUFQ4Weight or GGUFQ8Weight
    fields: tuple[np.ndarray, ...]  # each [out, ...]

    @property
    def shape(self) -> tuple[int, int]:
        """The logical [in, out]."""
        scales = self.fields[1]
        return scales.shape[1] * GGUF_BLOCK, scales.shape[0]

    def map_rows(self, fn: Callable[[np.ndarray], np.ndarray]) -> "GGUFHostWeight":
        """fn applied to every field's rows (a permutation of the output channels)."""
        return GGUFHostWeight(self.kind, tuple(fn(f) for f in self.fields))

    def to_device(self, place: Callable[[str, np.ndarray], jax.Array], path: str):
        """The device weight, each field put by `place(path.field, host array)`."""
        return self.kind(*(place(f"{path}.{name}", f) for name, f in zip(self.kind._fields, self.fields)))


def split_blocks(type_name: str, data: np.ndarray) -> GGUFHostWeight | None:
    """data: a tensor's blocks [rows, row bytes]. None for a type kept as float, or a Q4_0 scale whose
    -8 d would overflow float16."""
    rows = data.shape[0]
    if type_name == "Q8_0":
        blocks = data.reshape(rows, -1, 34)
        d = blocks[..., :2].copy().view(np.float16)[..., 0]
        return GGUFHostWeight(GGUFQ8Weight, (blocks[..., 2:].reshape(rows, -1).view(np.int8), d))
    if type_name == "Q4_1":
        blocks = data.reshape(rows, -1, 20)
        d = blocks[..., :2].copy().view(np.float16)[..., 0]
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
        return GGUFHostWeight(GGUFQ4Weight, (blocks[..., 4:].reshape(rows, -1), d, m))
    if type_name == "Q5_0":
        blocks = data.reshape(rows, -1, 22)
        d = blocks[..., :2].copy().view(np.float16)[..., 0]
        high = blocks[..., 2:6].copy().view("<u4")  # [rows, blocks, 1]: bit j is value j's fifth bit
        low = blocks[..., 6:]  # [rows, blocks, 16]: value j in the low nibble of byte j, value 16 + j in the high
        nibbles = np.concatenate([low & 0xF, low >> 4], axis=-1).astype(np.int16)  # [rows, blocks, 32]
        fifth = (high >> np.arange(32, dtype=np.uint32)) & 1
        values = (nibbles | (fifth.astype(np.int16) << 4)) - 16
        return GGUFHostWeight(GGUFQ8Weight, (values.astype(np.int8).reshape(rows, -1), d))
    if type_name == "Q4_0":
        blocks = data.reshape(rows, -1, 18)
        d = blocks[..., :2].copy().view(np.float16)[..., 0]
        with np.errstate(over="ignore"):
            m = d * np.float16(-8)
        if not np.isfinite(m).all():
            return None
        return GGUFHostWeight(GGUFQ4Weight, (blocks[..., 2:].reshape(rows, -1), d, m))
    return None
