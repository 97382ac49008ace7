"""Reads a HF model directory: config.json, generation_config.json and safetensors weights.

Tensors are streamed one at a time (memory-mapped by safetensors), so a model never needs a
second full copy on the host. safetensors' numpy backend cannot return bfloat16 or float8, so
those tensors are read as raw bytes from the file's own offsets and viewed as ml_dtypes' types.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Iterator

import numpy as np

from jlight.core.errors import ModelLoadError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(model_dir: str) -> list[str]:
    """The weight files of a HF directory, single-file or sharded."""
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index} is not a valid safetensors index ({e}); re-download it") from None
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not os.path.isfile(os.path.join(model_dir, f))]
        if missing:
            raise ModelLoadError(f"{index} lists shard(s) {missing} that are not in {model_dir}; the download is incomplete")
        return [os.path.join(model_dir, f) for f in files]
    single = os.path.join(model_dir, SINGLE_FILE)
    if os.path.isfile(single):
        return [single]
    raise ModelLoadError(
        f"{model_dir} has no {SINGLE_FILE} or {INDEX_FILE}; jlight loads safetensors weights "
        "(convert .bin checkpoints with transformers' save_pretrained(safe_serialization=True))"
    )


def _header(path: str) -> tuple[dict, int]:
    """(tensor header, byte offset where the data section starts) of a safetensors file."""
    try:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
    except (OSError, struct.error, ValueError) as e:  # ValueError covers JSON and UTF-8 errors
        raise ModelLoadError(f"safetensors file {path} has a corrupt header ({e}); re-download it") from None
    header.pop("__metadata__", None)
    return header, 8 + header_len


RAW_DTYPES = ("BF16", "F8_E4M3")  # the safetensors dtypes numpy lacks, read by _raw_reader


def _raw_reader(path: str):
    """Returns read(name) -> a bfloat16 or float8_e4m3fn array viewing the file's bytes (no float32 copy)."""
    # ml_dtypes loads only for the dtypes numpy lacks.
    import ml_dtypes

    header, data_start = _header(path)
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    dtypes = {"BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn}

    def read(name: str) -> np.ndarray:
        info = header[name]
        begin, end = info["data_offsets"]
        return raw[data_start + begin : data_start + end].view(dtypes[info["dtype"]]).reshape(info["shape"])

    return read


def count_tensors(files: list[str]) -> int:
    return sum(len(_header(p)[0]) for p in files)


def stream_safetensors(files: list[str], keep=None) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (name, numpy array) for every tensor of every file (those whose name `keep(name)` accepts, when
    given), one at a time; a tensor not kept is not read.

    A truncated or corrupt file raises ModelLoadError naming it.
    """
    # safetensors loads only for HF checkpoints.
    from safetensors import SafetensorError, safe_open

    for path in files:
        try:
            with safe_open(path, framework="numpy") as f:
                raw = None
                for name in f.keys():
                    if keep is not None and not keep(name):
                        continue
                    if f.get_slice(name).get_dtype() in RAW_DTYPES:
                        raw = raw or _raw_reader(path)
                        yield name, raw(name)
                    else:
                        yield name, f.get_tensor(name)
        except (SafetensorError, OSError, ValueError, struct.error) as e:
            raise ModelLoadError(f"safetensors file {path} is corrupt or truncated ({e}); re-download it") from None


def checkpoint_dtype(hf_config: dict) -> str:
    """The dtype the checkpoint was saved in (config.json `torch_dtype`, `dtype` in transformers 5)."""
    name = hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32"
    return {"float": "float32", "half": "float16", "bf16": "bfloat16"}.get(name, name)


def read_generation_config(model_dir: str) -> dict:
    """generation_config.json as a dict ({} when absent); eos_token_id is normalised to a list."""
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            gen = json.load(f)
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON ({e}); fix or delete it") from None
    eos = gen.get("eos_token_id")
    if eos is not None and not isinstance(eos, list):
        gen["eos_token_id"] = [eos]
    return gen
