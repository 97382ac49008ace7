"""MXFP4 expert weights (gpt-oss checkpoints), expanded on the host as they are read.

An MXFP4 tensor `NAME` is stored as two: `NAME_blocks` uint8 [experts, out, in / 32, 16], each byte
two 4-bit e2m1 values (low nibble first, so byte j of a block holds elements 2j and 2j + 1), and
`NAME_scales` uint8 [experts, out, in / 32], one e8m0 exponent per block of 32 (2^(scale - 127)).
`expand_mxfp4` turns each pair into the float32 `NAME` [experts, in, out], the layout of gpt-oss's
bf16 checkpoints, which the loader then casts to the load dtype (bf16 holds every MXFP4 value
exactly, as long as the exponents stay in bf16's range). Every other tensor passes through.
"""
from __future__ import annotations

from typing import Iterable

import numpy as np

# e2m1: sign, two exponent bits, one mantissa bit
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks uint8 [X, out, G, 16], scales uint8 [X, out, G] -> float32 [X, in = G * 32, out]."""
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} do not pair: blocks must be "
                         "[..., groups, 16] bytes with one scale per group")
    values = np.empty(blocks.shape[:-1] + (32,), np.float32)  # [X, out, G, 32]
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return np.swapaxes(values.reshape(*blocks.shape[:-2], -1), -1, -2)  # [X, in, out]


def expand_mxfp4(tensors: Iterable[tuple[str, np.ndarray]]):
    """(name, array) pairs with every NAME_blocks + NAME_scales pair replaced by NAME, dequantized."""
    pending: dict[str, dict[str, np.ndarray]] = {}
    for name, tensor in tensors:
        base, kind = _split(name)
        if kind is None:
            yield name, tensor
            continue
        got = pending.setdefault(base, {})
        got[kind] = tensor
        if len(got) == 2:
            yield base, dequantize(got["blocks"], got["scales"])
            del pending[base]
    for base, got in pending.items():
        raise ValueError(f"checkpoint has {base}_{next(iter(got))} without its "
                         f"{'scales' if 'blocks' in got else 'blocks'}; the file is incomplete")


def _split(name: str) -> tuple[str, str | None]:
    for kind in ("blocks", "scales"):
        if name.endswith("_" + kind):
            return name[: -len(kind) - 1], kind
    return name, None
