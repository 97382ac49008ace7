"""A GGUF file's metadata and tensor table, read in one pass with `struct`.

gguf.GGUFReader turns every value of the metadata into numpy views, one at a time: for SmolLM2's
49,152-token vocabulary and its merges that took 2.4 s of every start on a 2-core machine, longer
than dequantizing the weights. This reads the same file format (GGUF v2/v3, little-endian: the
header, the key/value metadata, the tensor infos, then the aligned tensor data) into Python values
in about a tenth of that, and keeps the tensor data as views of one read-only memory map.

`GGUFFile.fields` maps each key to its value (str, int, float, bool, or a list of them);
`GGUFFile.tensors` lists `GGUFTensor`s whose `data` has the layout gguf.quants.dequantize takes
(typed elements for F16/F32/F64/I8-I64, else the raw blocks as bytes, [rows, bytes per row]).
"""
from __future__ import annotations

import struct
from typing import Any, NamedTuple

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF value type -> struct format of one scalar (8: string, 9: array are read apart)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# ggml types whose elements numpy reads as they are (the others are blocks of bytes)
_TYPED = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}


class GGUFTensor(NamedTuple):
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # fastest-varying dimension first, as GGUF lists them
    data: np.ndarray  # a view of the file


class GGUFFile:
    def __init__(self, path: str):
        # gguf loads only for GGUF checkpoints (its quantization tables; its reader is not used).
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = path
        self._map = np.memmap(path, mode="r")
        self._buf = memoryview(self._map)
        if bytes(self._buf[:4]) != GGUF_MAGIC:
            raise ValueError("no GGUF magic at the start")
        self._pos = 4
        version = self._scalar("I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (big-endian files read as a huge version); jlight reads v2 and v3")
        tensor_count, kv_count = self._scalar("Q"), self._scalar("Q")
        self.fields: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string()
            self.fields[key] = self._value(self._scalar("I"))
        infos = []
        for _ in range(tensor_count):
            name = self._string()
            dims = struct.unpack_from(f"<{self._scalar('I')}Q", self._buf, self._pos)
            self._pos += 8 * len(dims)
            infos.append((name, dims, self._scalar("I"), self._scalar("Q")))
        alignment = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment={alignment} is not a power of two")
        start = -(-self._pos // alignment) * alignment
        self.tensors: list[GGUFTensor] = []
        for name, dims, raw_type, offset in infos:
            ggml_type = GGMLQuantizationType(raw_type)
            rows = tuple(int(d) for d in reversed(dims))  # numpy order: slowest first
            elements = int(np.prod(rows, dtype=np.int64))
            block, block_bytes = GGML_QUANT_SIZES[ggml_type]
            begin = start + int(offset)
            if raw_type in _TYPED:
                data = np.frombuffer(self._map, _TYPED[raw_type], elements, begin).reshape(rows)
            else:  # whole blocks: the last dimension in bytes
                data = np.frombuffer(self._map, np.uint8, elements // block * block_bytes, begin)
                data = data.reshape(rows[:-1] + (rows[-1] // block * block_bytes,))
            self.tensors.append(GGUFTensor(name, ggml_type, tuple(int(d) for d in dims), data))
        del self._buf

    def _scalar(self, fmt: str):
        (value,) = struct.unpack_from("<" + fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._scalar("Q")
        text = bytes(self._buf[self._pos:self._pos + n]).decode("utf-8")
        self._pos += n
        return text

    def _value(self, kind: int):
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item, count = self._scalar("I"), self._scalar("Q")
            if item == _STRING:
                return [self._string() for _ in range(count)]
            if item == _ARRAY:
                return [self._value(_ARRAY) for _ in range(count)]
            fmt = _SCALARS[item]
            values = list(struct.unpack_from(f"<{count}{fmt}", self._buf, self._pos))
            self._pos += count * struct.calcsize(fmt)
            return values
        if kind not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {kind}")
        return self._scalar(_SCALARS[kind])
