"""HF checkpoints stored in FP8: their weights read as e4m3 values with one scale per output channel.

Two `quantization_config`s of config.json are read:
  * quant_method "compressed-tensors" (llm-compressor; the `*-FP8` / `*-FP8-dynamic` Llama, Qwen releases):
    `config_groups.*.weights` of `num_bits` 8, `type` "float", `strategy` "channel" (`NAME.weight_scale`
    float32 [out, 1]), "tensor" (a scalar or [1]) or "block" (`block_structure` [bn, bk]; `weight_scale`
    [ceil(out / bn), ceil(in / bk)]). Modules in `ignore` (usually lm_head) are stored unquantized.
  * quant_method "fp8" (transformers' FineGrainedFP8, DeepSeek-V3, the Qwen3-*-FP8 releases): with
    `weight_block_size` [bn, bk], `NAME.weight_scale_inv` float32 [ceil(out / bn), ceil(in / bk)] (despite the
    name a multiplier: weight = values * scale of its block); without it, one `NAME.weight_scale` per tensor.
In both, `NAME.weight` is float8_e4m3fn [out, in] (HF's layout) and weight ~= weight values * scale.

What the engine holds: an Fp8Weight (values [in, out], scales [out]) per linear weight.
  * channel scales are kept as they are; a tensor scale becomes that scale on every channel (exact);
  * block scales are dequantized per block (float32, exact) and requantized per output channel, the
    channel's scale the largest block scale of its row: each value is rounded to e4m3 a second time, a
    relative error of at most 2^-4 more (tests/test_fp8_checkpoints.py measures it against the
    block-dequantized weights), none where a row's block scales differ by powers of two (ue8m0-style
    scales: the rescaling is exact for every value that stays in e4m3's normal range, >= 2^-6 of the
    channel scale). So every fp8 matmul path takes them (XLA's fp8 gemm has no block scales).
  * activations: always quantized dynamically, per token, at run time (matmul_reference.fp8_matmul).
    A static `input_scale` (compressed-tensors `input_activations.dynamic` false, fp8's
    activation_scheme "static") is read and not used: a per-token scale is at least as precise.
    KV-cache scales (`k_scale`, `v_scale`) are not read either.
`fp8_tensors` pairs each weight with its scale in the tensor stream (they may lie in different shards)
and yields an `Fp8HostWeight` in its place; assemble_params keeps the Llama-named linear weights as
Fp8Weights and dequantizes every other one (MoE experts, MLA projections: the engine keeps those in
the load dtype, as int8 quantization does) to float32 as it reads it.
"""
from __future__ import annotations

import math
from typing import Iterable, NamedTuple

import numpy as np

from jlight.core.errors import UnsupportedModelError

E4M3_MAX = 448.0
SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")
UNUSED_SUFFIXES = (".input_scale", ".k_scale", ".v_scale")  # static activation / KV scales (see above)


class Fp8Scheme(NamedTuple):
    method: str  # "compressed-tensors" or "fp8"
    strategy: str  # "channel", "tensor" or "block"
    block: tuple[int, int] | None  # [bn (out), bk (in)] for "block"


class Fp8HostWeight(NamedTuple):
    """One linear weight from an FP8 checkpoint, on the host, in HF's layout."""
    values: np.ndarray  # [out, in] float8_e4m3fn
    scales: np.ndarray  # [out] float32; weight[o, i] ~= values[o, i] * scales[o]

    def dequantize(self) -> np.ndarray:
        return self.values.astype(np.float32) * self.scales[:, None]

    def rows(self, start: int, stop: int) -> "Fp8HostWeight":
        """Output channels [start, stop) (a fused checkpoint tensor's part)."""
        return Fp8HostWeight(self.values[start:stop], self.scales[start:stop])


def fp8_scheme(hf_config: dict) -> Fp8Scheme | None:
    """The FP8 layout config.json's quantization_config names, None for an unquantized checkpoint or one
    another loader reads (gpt-oss's mxfp4); a ValueError naming the field for a layout jlight cannot read."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "mxfp4":
        return None  # gpt-oss experts: loading/mxfp4.py
    if method == "fp8":
        if qc.get("fmt", "e4m3") != "e4m3":
            raise UnsupportedModelError(f"quantization_config.fmt={qc['fmt']!r}: jlight reads float8_e4m3fn FP8 checkpoints only")
        block = qc.get("weight_block_size")
        if block is None:
            return Fp8Scheme("fp8", "tensor", None)
        return Fp8Scheme("fp8", "block", _block(block, "quantization_config.weight_block_size"))
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    raise UnsupportedModelError(
        f"quantization_config.quant_method={method!r} is not supported: jlight reads unquantized checkpoints and the FP8 "
        "ones ('compressed-tensors' float8, 'fp8'); load the unquantized model (and pass quantization='int8', 'w8a8' or 'fp8')")


def _block(block, field: str) -> tuple[int, int]:
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise UnsupportedModelError(f"{field}={block!r} must be two positive ints [out, in]")
    return int(block[0]), int(block[1])


def _compressed_tensors(qc: dict) -> Fp8Scheme:
    groups = qc.get("config_groups") or {}
    if not groups:
        raise UnsupportedModelError("quantization_config (compressed-tensors) has no config_groups; the config is incomplete")
    schemes = set()
    for name, group in groups.items():
        w = group.get("weights") or {}
        where = f"quantization_config.config_groups.{name}.weights"
        if w.get("num_bits") != 8 or w.get("type") != "float":
            raise UnsupportedModelError(
                f"{where} has num_bits={w.get('num_bits')!r}, type={w.get('type')!r}: jlight reads compressed-tensors "
                "checkpoints with 8-bit float (FP8) weights only; load the unquantized model instead")
        strategy = w.get("strategy")
        if strategy not in ("channel", "tensor", "block"):
            raise UnsupportedModelError(f"{where}.strategy={strategy!r}: jlight reads 'channel', 'tensor' and 'block' FP8 weights")
        block = _block(w.get("block_structure"), f"{where}.block_structure") if strategy == "block" else None
        schemes.add(Fp8Scheme("compressed-tensors", strategy, block))
    if len(schemes) > 1:
        raise UnsupportedModelError(f"quantization_config.config_groups mix weight strategies {sorted(s.strategy for s in schemes)}; "
                                    "jlight reads one FP8 layout a checkpoint")
    return schemes.pop()


def to_e4m3(x: np.ndarray) -> np.ndarray:
    """float32 -> float8_e4m3fn, saturated at +-448 (a plain cast gives NaN past it)."""
    import ml_dtypes  # numpy's own dtypes lack fp8

    return np.clip(x, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)


def blocks_to_channels(values: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> Fp8HostWeight:
    """Block-scaled e4m3 values [out, in] as e4m3 values with one scale per output channel: the largest
    block scale of the channel's row of blocks (every value's rescale factor is then <= 1)."""
    weight = dequantize_blocks(values, scale, block)
    row_scale = np.repeat(np.max(scale.astype(np.float32), axis=1), block[0])[: values.shape[0]]  # [out]
    row_scale = np.where(row_scale > 0, row_scale, 1.0).astype(np.float32)
    return Fp8HostWeight(to_e4m3(weight / row_scale[:, None]), row_scale)


def dequantize_blocks(values: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """values e4m3 [out, in] times the scale of each [bn, bk] block (scale [ceil(out/bn), ceil(in/bk)]) -> float32."""
    (n, k), (bn, bk) = values.shape, block
    want = (math.ceil(n / bn), math.ceil(k / bk))
    if scale.shape != want:
        raise ValueError(f"block scales of shape {scale.shape} do not fit a [{n}, {k}] weight in {bn}x{bk} blocks "
                         f"(expected {want}); config.json's block size does not match the weights")
    full = np.repeat(np.repeat(scale.astype(np.float32), bn, axis=0), bk, axis=1)[:n, :k]
    return values.astype(np.float32) * full


def channel_weight(name: str, values: np.ndarray, scale: np.ndarray, scheme: Fp8Scheme) -> Fp8HostWeight:
    """One checkpoint weight and its scale tensor as per-output-channel e4m3 (see the module docstring)."""
    if values.ndim != 2:
        raise ValueError(f"FP8 tensor {name} has shape {values.shape}; jlight reads 2-D [out, in] FP8 weights")
    scale = np.asarray(scale, np.float32)
    n = values.shape[0]
    if scheme.strategy == "block" and scale.ndim == 2:
        return blocks_to_channels(values, scale, scheme.block)
    if scale.size == 1:
        return Fp8HostWeight(values, np.full((n,), scale.reshape(()), np.float32))
    if scale.size == n and scale.ndim <= 2:
        return Fp8HostWeight(values, scale.reshape(n))
    raise ValueError(f"the scale of FP8 tensor {name} has shape {scale.shape}; expected [{n}, 1], [{n}], a scalar "
                     f"or block scales ({scheme.strategy} strategy)")


def fp8_tensors(tensors: Iterable[tuple[str, np.ndarray]], scheme: Fp8Scheme):
    """(name, array) pairs with every float8 `X.weight` and its `X.weight_scale(_inv)` replaced by one
    (`X.weight`, Fp8HostWeight); the unused scales dropped; every other tensor as it comes."""
    pending: dict[str, dict] = {}  # base name -> {"weight": values, "scale": scale} until both are read
    for name, tensor in tensors:
        if name.endswith(UNUSED_SUFFIXES):
            continue
        suffix = next((s for s in SCALE_SUFFIXES if name.endswith(s)), None)
        if suffix is not None:
            base, kind = name[: -len(suffix)], "scale"
        elif name.endswith(".weight") and _is_fp8(tensor):
            base, kind = name[: -len(".weight")], "weight"
        else:
            yield name, tensor
            continue
        got = pending.setdefault(base, {})
        got[kind] = tensor
        if len(got) == 2:
            del pending[base]
            yield base + ".weight", channel_weight(base + ".weight", got["weight"], got["scale"], scheme)
    for base, got in pending.items():
        missing = f"{base}.weight" if "scale" in got else f"its scale ({base}.weight_scale or .weight_scale_inv)"
        raise ValueError(f"FP8 checkpoint has {base}.{'weight' if 'weight' in got else 'weight_scale'} without {missing}; "
                         "the file is incomplete")


def _is_fp8(tensor) -> bool:
    return getattr(getattr(tensor, "dtype", None), "name", "") == "float8_e4m3fn"
