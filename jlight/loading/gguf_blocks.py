"""A GGUF tensor's Q4_0 / Q4_1 / Q5_0 / Q8_0 / Q4_K / Q5_K / Q6_K blocks taken apart on the host, for the
weights the engine keeps as the file stores them (jlight/core/gguf_weights.py; `load_model(keep_gguf_blocks=True)`).

The file's blocks ([rows, row bytes] of a memory map) are split into their fields: Q4_1's 20-byte block
is d (float16), m (float16) and 16 bytes of nibbles; Q4_0's 18-byte block is d and the nibbles, with
value - 8 as the weight's multiple of d, kept as m = -8 d (exact: a float16 times a power of two); Q8_0's
34-byte block is d and 32 int8 values; Q5_0's 22-byte block (d, the 32 values' fifth bits, their low nibbles)
becomes a Q8_0 block of the values - 16 (-16..15), the same numbers at 1.0625 bytes a weight instead of 0.6875.
The K-quants' 256-value super-blocks become their sub-blocks, each with its own float32 d (and m), the
products llama.cpp's dequantization forms (exact in float32):
  Q4_K (144 bytes: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32, 128 bytes of
    nibbles: each 64 values are 32 bytes' low nibbles, then the same bytes' high nibbles) -> a Q4_1-style
    block a sub-block, d = d * scale, m = -dmin * min, its nibbles repacked into Q4_1's order (0.75 bytes a
    weight instead of 0.5625).
  Q5_K (176 bytes: Q4_K's header, 32 bytes of fifth bits, Q4_K's nibbles) -> int8 values 0..31 with Q4_K's
    d and m a block of 32 (GGUFQ8MinWeight, 1.25 bytes a weight instead of 0.6875). The minimum stays apart:
    folding value - 16 into it would round 16 d - dmin * min, and the weights would differ from llama.cpp's.
  Q6_K (210 bytes: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, f16 d) -> int8 values
    q - 32 (-32..31) with d = d * scale a block of 16 (GGUFQ8Weight, 1.25 bytes a weight instead of 0.82).
Rows stay rows (output channels), so permuting them (llama.cpp's Q/K order) and fusing weights on `out` act
on whole rows.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import numpy as np

from jlight.core.gguf_weights import GGUFQ4Weight, GGUFQ8MinWeight, GGUFQ8Weight

KEPT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
# A K-quant super-block's bytes.
_SUPER_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


class GGUFHostWeight(NamedTuple):
    """One weight's fields on the host, in the order of its kind's (GGUFQ4Weight, GGUFQ8Weight, GGUFQ8MinWeight)."""
    kind: type
    fields: tuple[np.ndarray, ...]  # each [out, ...]

    @property
    def shape(self) -> tuple[int, int]:
        """The logical [in, out]."""
        return self.kind(*self.fields).shape

    def map_rows(self, fn: Callable[[np.ndarray], np.ndarray]) -> "GGUFHostWeight":
        """fn applied to every field's rows (a permutation of the output channels)."""
        return GGUFHostWeight(self.kind, tuple(fn(f) for f in self.fields))

    def to_device(self, place: Callable[[str, np.ndarray], jax.Array], path: str):
        """The device weight, each field put by `place(path.field, host array)`."""
        return self.kind(*(place(f"{path}.{name}", f) for name, f in zip(self.kind._fields, self.fields)))


def _half(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte `at` of each block [..., block bytes] -> [...] float16."""
    return blocks[..., at:at + 2].copy().view(np.float16)[..., 0]


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """[..., groups, 32] bytes -> [..., groups * 2, 32] values: each group's 32 low nibbles, then its high ones
    (Q4_K's and Q5_K's order of the values in a super-block)."""
    values = np.stack([packed & 0xF, packed >> 4], axis=-2)
    return values.reshape(*packed.shape[:-2], -1, 32)


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K super-blocks [..., bytes] -> float32 (d, m) [..., 8] of their sub-blocks: d * scale and
    -dmin * min, from the 6-bit scales and mins packed in bytes 4..15 (llama.cpp's get_scale_min_k4)."""
    packed = blocks[..., 4:16]
    low, mid, top = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scale = np.concatenate([low & 0x3F, (top & 0xF) | ((low >> 2) & 0x30)], axis=-1)
    minimum = np.concatenate([mid & 0x3F, (top >> 4) | ((mid >> 2) & 0x30)], axis=-1)
    d = _half(blocks, 0).astype(np.float32)[..., None] * scale.astype(np.float32)
    m = -(_half(blocks, 2).astype(np.float32)[..., None] * minimum.astype(np.float32))
    return d, m


def _split_k(type_name: str, data: np.ndarray) -> GGUFHostWeight:
    """A Q4_K / Q5_K / Q6_K tensor's super-blocks [rows, row bytes] -> its sub-blocks' fields (the module's forms)."""
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, _SUPER_BYTES[type_name])  # [rows, super-blocks, bytes]
    if type_name == "Q6_K":
        low = blocks[..., :128].reshape(rows, -1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)
        high = blocks[..., 128:192].reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
        q = (low & 0xF).reshape(rows, -1, 8, 32) | ((high & 0x3) << 4).reshape(rows, -1, 8, 32)
        values = q.astype(np.int8) - np.int8(32)  # [rows, super-blocks, 8, 32]: the super-block's 256 in order
        d = _half(blocks, 208).astype(np.float32)[..., None] * blocks[..., 192:208].view(np.int8).astype(np.float32)
        return GGUFHostWeight(GGUFQ8Weight, (values.reshape(rows, -1), d.reshape(rows, -1)))
    d, m = (a.reshape(rows, -1) for a in _k_scales(blocks))
    if type_name == "Q4_K":
        values = _nibbles(blocks[..., 16:].reshape(rows, -1, 4, 32))  # [rows, super-blocks, 8, 32]
        packed = values[..., :16] | (values[..., 16:] << 4)  # Q4_1's order: value i and 16 + i in byte i
        return GGUFHostWeight(GGUFQ4Weight, (packed.reshape(rows, -1), d, m))
    low = _nibbles(blocks[..., 48:].reshape(rows, -1, 4, 32))  # [rows, super-blocks, 8, 32]
    # [rows, super-blocks, 8, 32]: bit j of the 32 bytes is sub-block j's fifth bits
    fifth = (blocks[..., None, 16:48] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    values = low | (fifth << 4)
    return GGUFHostWeight(GGUFQ8MinWeight, (values.astype(np.int8).reshape(rows, -1), d, m))


def split_blocks(type_name: str, data: np.ndarray) -> GGUFHostWeight | None:
    """data: a tensor's blocks [rows, row bytes]. None for a type kept as float, or a Q4_0 scale whose
    -8 d would overflow float16."""
    rows = data.shape[0]
    if type_name in _SUPER_BYTES:
        return _split_k(type_name, data)
    if type_name == "Q8_0":
        blocks = data.reshape(rows, -1, 34)
        return GGUFHostWeight(GGUFQ8Weight, (blocks[..., 2:].reshape(rows, -1).view(np.int8), _half(blocks, 0)))
    if type_name == "Q4_1":
        blocks = data.reshape(rows, -1, 20)
        return GGUFHostWeight(GGUFQ4Weight, (blocks[..., 4:].reshape(rows, -1), _half(blocks, 0), _half(blocks, 2)))
    if type_name == "Q5_0":
        blocks = data.reshape(rows, -1, 22)
        high = blocks[..., 2:6].copy().view("<u4")  # [rows, blocks, 1]: bit j is value j's fifth bit
        low = blocks[..., 6:]  # [rows, blocks, 16]: value j in the low nibble of byte j, value 16 + j in the high
        nibbles = np.concatenate([low & 0xF, low >> 4], axis=-1).astype(np.int16)  # [rows, blocks, 32]
        fifth = (high >> np.arange(32, dtype=np.uint32)) & 1
        values = (nibbles | (fifth.astype(np.int16) << 4)) - 16
        return GGUFHostWeight(GGUFQ8Weight, (values.astype(np.int8).reshape(rows, -1), _half(blocks, 0)))
    if type_name == "Q4_0":
        blocks = data.reshape(rows, -1, 18)
        d = _half(blocks, 0)
        with np.errstate(over="ignore"):
            m = d * np.float16(-8)
        if not np.isfinite(m).all():
            return None
        return GGUFHostWeight(GGUFQ4Weight, (blocks[..., 2:].reshape(rows, -1), d, m))
    return None
