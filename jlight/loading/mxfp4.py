"""MXFP4 expert weights (gpt-oss checkpoints), expanded on the host as they are read, or kept as stored.

An MXFP4 tensor `NAME` is stored as two: `NAME_blocks` uint8 [experts, out, in / 32, 16], each byte
two 4-bit e2m1 values (low nibble first, so byte j of a block holds elements 2j and 2j + 1), and
`NAME_scales` uint8 [experts, out, in / 32], one e8m0 exponent per block of 32 (2^(scale - 127)).
`expand_mxfp4` turns each pair into the float32 `NAME` [experts, in, out], the layout of gpt-oss's
bf16 checkpoints, which the loader then casts to the load dtype (bf16 holds every MXFP4 value
exactly, as long as the exponents stay in bf16's range). Every other tensor passes through.
With keep=True (quantization="mxfp4") each pair stays as the file's bytes (Mxfp4HostWeight), put on the device
as a jlight.core.quantization.Mxfp4Weight that the expert matmuls expand where they read it.
A GGUF file's MXFP4 tensor (ggml type MXFP4, llama.cpp's gpt-oss experts) has the same values in another byte
order: a block of 32 is 17 bytes, the e8m0 exponent, then 16 bytes whose low nibbles are elements 0..15 and
high nibbles elements 16..31 (ggml's e2m1 table is HF's doubled, its exponent 2^(e - 128): the same value).
`from_ggml_mxfp4` repacks it into the HF layout above.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from jlight.core.quantization import FP4_E2M1_VALUES, Mxfp4Weight

FP4_VALUES = np.array(FP4_E2M1_VALUES, np.float32)


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


@dataclasses.dataclass
class Mxfp4HostWeight:
    """An MXFP4 tensor as the file stores it, on the host: blocks [X, out, G, 16], scales [X, out, G] (uint8).
    `shape` is the [X, in = 32 G, out] weight it stands for; to_device() makes it a
    jlight.core.quantization.Mxfp4Weight."""
    blocks: np.ndarray
    scales: np.ndarray

    def __post_init__(self):
        if self.blocks.shape[:-1] != self.scales.shape or self.blocks.shape[-1] != 16:
            raise ValueError(f"MXFP4 blocks {self.blocks.shape} and scales {self.scales.shape} do not pair: blocks must "
                             "be [..., groups, 16] bytes with one scale per group")

    @property
    def shape(self) -> tuple:
        *lead, out, groups, _ = self.blocks.shape
        return (*lead, 32 * groups, out)

    def columns(self, cols: slice) -> "Mxfp4HostWeight":
        """The output columns `cols` (a view)."""
        return Mxfp4HostWeight(self.blocks[..., cols, :, :], self.scales[..., cols, :])

    def dequantize(self) -> np.ndarray:
        return dequantize(self.blocks, self.scales)

    def to_device(self) -> Mxfp4Weight:
        """The file's bytes to the device, laid out there as an Mxfp4Weight."""
        return _device_layout(jax.device_put(np.asarray(self.blocks)), jax.device_put(np.asarray(self.scales)))


@jax.jit
def _device_layout(blocks, scales) -> Mxfp4Weight:
    """[X, out, G, 16] blocks and [X, out, G] scales -> Mxfp4Weight's [X, in / 2, out] and [X, G, out]: byte
    16 g + j of a row's blocks holds elements 32 g + 2 j (low nibble) and 32 g + 2 j + 1 (high)."""
    *lead, out, groups, _ = blocks.shape
    packed = jnp.swapaxes(blocks.reshape(*lead, out, groups * 16), -1, -2)
    return Mxfp4Weight(packed, jnp.swapaxes(scales, -1, -2))


def from_ggml_mxfp4(data: np.ndarray) -> Mxfp4HostWeight:
    """A GGUF MXFP4 tensor's bytes [..., out, G * 17] (ggml's blocks) -> the Mxfp4HostWeight of the same values:
    blocks [..., out, G, 16] in HF's nibble order (byte j: elements 2j low, 2j + 1 high), scales [..., out, G]."""
    data = np.asarray(data, np.uint8)
    if data.shape[-1] % 17:
        raise ValueError(f"GGUF MXFP4 rows of {data.shape[-1]} bytes are not whole 17-byte blocks")
    blocks = data.reshape(*data.shape[:-1], -1, 17)
    packed = blocks[..., 1:]
    values = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)  # [..., G, 32] codes in element order
    return Mxfp4HostWeight(values[..., 0::2] | (values[..., 1::2] << 4), np.ascontiguousarray(blocks[..., 0]))


def expand_mxfp4(tensors: Iterable[tuple[str, np.ndarray]], keep: bool = False):
    """(name, array) pairs with every NAME_blocks + NAME_scales pair replaced by NAME, dequantized, or with
    keep=True kept as an Mxfp4HostWeight."""
    pending: dict[str, dict[str, np.ndarray]] = {}
    for name, tensor in tensors:
        base, kind = _split(name)
        if kind is None:
            yield name, tensor
            continue
        got = pending.setdefault(base, {})
        got[kind] = tensor
        if len(got) == 2:
            kept = Mxfp4HostWeight(np.asarray(got["blocks"], np.uint8), np.asarray(got["scales"], np.uint8))
            yield base, kept if keep else kept.dequantize()
            del pending[base]
    for base, got in pending.items():
        raise ValueError(f"checkpoint has {base}_{next(iter(got))} without its "
                         f"{'scales' if 'blocks' in got else 'blocks'}; the file is incomplete")


def _split(name: str) -> tuple[str, str | None]:
    for kind in ("blocks", "scales"):
        if name.endswith("_" + kind):
            return name[: -len(kind) - 1], kind
    return name, None
