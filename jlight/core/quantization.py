"""Weight quantization (int8 and fp8, per-output-channel symmetric scales, per-token activation
scales) and the int8 and fp8 KV caches (int8: one scale per token and KV head).

Three weight types share one layout (values [..., in, out], scales float32 [..., out]):
  QuantizedWeight: weight-only int8 (W8A16): activations stay in bf16/f32.
  W8A8Weight: also quantizes the activations per token at run time and multiplies in
    int8 with int32 accumulation.
  Fp8Weight: float8_e4m3fn values (quantization="fp8"); its matmul (matmul_reference.fp8_matmul)
    runs W8A8-FP8 (activations to e4m3 per token, an fp8 x fp8 dot) or weight-only (the values
    upcast inside the dot), chosen by the step's rows.
W8A8Weight and Fp8Weight subclass QuantizedWeight, so code that only moves, shards or dequantizes
weights (lax.scan slicing, sharding rules, MoE experts' dequantize) treats them alike; matmuls tell
them apart with isinstance(w, W8A8Weight) / isinstance(w, Fp8Weight), checked before QuantizedWeight.
"""
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

QUANT_MODES = ("int8", "w8a8", "fp8")
# The 2-D-per-layer linear weights of models/llama.py.
LINEAR_WEIGHTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


class QuantizedWeight(NamedTuple):
    values: jax.Array  # [..., in, out] int8
    scales: jax.Array  # [..., out] float32; weight ~= values * scales


class W8A8Weight(QuantizedWeight):
    """Same fields as QuantizedWeight; selects int8 x int8 matmuls."""


class Fp8Weight(QuantizedWeight):
    """values float8_e4m3fn [..., in, out], scales float32 [..., out]: weight ~= values * scales."""


class W8A8WeightT(NamedTuple):
    """A W8A8Weight stored transposed ("K-major"), the layout the Pallas W8A8 kernel reads: Hopper's
    8-bit tensor-core instructions (wgmma) take both operands contiguous along the summed `in` axis.
    The engine makes these from W8A8Weights when its matmuls run on the Pallas path
    (transpose_to_kmajor); checkpoints and sharding rules keep the [in, out] layout. Not a
    QuantizedWeight: code that reads `.values` as [in, out] must not take it for one."""
    values_t: jax.Array  # [..., out, in] int8
    scales: jax.Array  # [..., out] float32


class QuantizedWeightT(NamedTuple):
    """A weight-only int8 QuantizedWeight stored transposed ([out, in], K-major), for XLA's fused
    dequantize-dot on GPU (dispatch.kmajor_weight_types says when the engine makes them)."""
    values_t: jax.Array  # [..., out, in] int8
    scales: jax.Array  # [..., out] float32


class Fp8WeightT(NamedTuple):
    """An Fp8Weight stored transposed ([out, in], K-major), the layout XLA's GPU fp8 gemm (cuBLASLt)
    takes without a transpose: both operands contracting on their minor dimension (the gemm rewriter
    transposes an [in, out] right-hand side first). dispatch.kmajor_weight_types says when."""
    values_t: jax.Array  # [..., out, in] float8_e4m3fn
    scales: jax.Array  # [..., out] float32


_KMAJOR = {QuantizedWeight: QuantizedWeightT, W8A8Weight: W8A8WeightT, Fp8Weight: Fp8WeightT}


class Mxfp4Weight(NamedTuple):
    """An MXFP4 weight kept as a checkpoint stores it (gpt-oss's experts, quantization="mxfp4"), in the
    [..., in, out] layout: 4-bit e2m1 values, two a byte along `in`, one e8m0 exponent a block of 32 rows of
    `in`. Its [..., in, out] values are dequantize_mxfp4's; expert matmuls expand them where they read them
    (models/moe.py). Not a QuantizedWeight: it has no `values`."""
    blocks: jax.Array  # [..., in / 2, out] uint8: byte b holds row 2b (low nibble) and row 2b + 1 (high nibble)
    scales: jax.Array  # [..., in / 32, out] uint8: rows 32g .. 32g + 31 times 2^(scales[g] - 127)

    @property
    def shape(self) -> tuple:
        """The [..., in, out] shape of the weight it stands for."""
        *lead, half, out = self.blocks.shape
        return (*lead, 2 * half, out)


# e2m1: sign, two exponent bits, one mantissa bit; index = the 4-bit code (e2m1_values computes them)
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def e2m1_values(code: jax.Array) -> jax.Array:
    """FP4_E2M1_VALUES[code] as float32, computed elementwise (no table gather), so that XLA can fuse the
    expansion into the matmul that reads it: exponent field 0 is subnormal (m / 2), else (1 + m / 2) 2^(e - 1)."""
    exponent, mantissa = ((code >> 1) & 3).astype(jnp.float32), (code & 1).astype(jnp.float32)
    power = jnp.where(exponent == 3, 4.0, jnp.where(exponent == 2, 2.0, 1.0))  # 2^(e - 1) exactly
    magnitude = jnp.where(exponent == 0, 0.5 * mantissa, (1.0 + 0.5 * mantissa) * power)
    return jnp.where(code >= 8, -magnitude, magnitude)


def dequantize_mxfp4(w: Mxfp4Weight, dtype) -> jax.Array:
    """w's values [..., in, out] in `dtype` (bfloat16 holds every MXFP4 value whose exponent is in its range)."""
    *lead, half, out = w.blocks.shape
    pairs = jnp.stack([e2m1_values(w.blocks & 0x0F), e2m1_values(w.blocks >> 4)], axis=-2)  # [..., in / 2, 2, out]
    # 2^(s - 127) exactly: float32's exponent field is e8m0's (s = 0, 2^-127, is float32's subnormal 1 << 22)
    bits = jnp.where(w.scales == 0, jnp.uint32(1 << 22), w.scales.astype(jnp.uint32) << 23)
    scale = jax.lax.bitcast_convert_type(bits, jnp.float32)
    values = pairs.reshape(*lead, half * 2 // 32, 32, out) * scale[..., None, :]
    return values.reshape(*lead, half * 2, out).astype(dtype)


@jax.jit
def _transpose_last_two(values):
    return jnp.swapaxes(values, -1, -2)


def transpose_to_kmajor(tree, kinds=(W8A8Weight,), names=None, delete_source: bool = False):
    """Every weight in `tree` whose type is one of `kinds` (QuantizedWeight, W8A8Weight; plain or
    inside a FusedWeight, per layer or stacked) as its K-major counterpart. names: only weights
    under these dict keys (e.g. the linear layers that go through `matmul`, not MoE experts, which
    models/moe.py reads as [in, out]). delete_source: free each [in, out] copy once transposed, so
    the peak is the model plus one weight (only for arrays the caller holds no other reference to)."""
    def convert(path, leaf):
        if type(leaf) not in kinds:
            return leaf
        keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
        if names is not None and (not keys or keys[-1] not in names):
            return leaf
        values_t = _transpose_last_two(leaf.values)
        if delete_source:
            leaf.values.delete()
        return _KMAJOR[type(leaf)](values_t, leaf.scales)

    return jax.tree_util.tree_map_with_path(convert, tree, is_leaf=lambda x: type(x) in _KMAJOR)


def quantize_int8(w: jax.Array) -> QuantizedWeight:
    """Quantize a [..., in, out] weight to int8 with one scale per output channel."""
    w32 = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=-2)
    scales = jnp.where(amax > 0, amax / 127.0, 1.0)
    values = jnp.clip(jnp.round(w32 / scales[..., None, :]), -127, 127).astype(jnp.int8)
    return QuantizedWeight(values, scales)


# ---- fp8 (e4m3) weights and activations ---------------------------------------------------
# e4m3 keeps 3 mantissa bits over its whole range (normal numbers from 2^-6 to 448), so a value
# rounds with a relative error of at most 2^-4; scaling a channel (or a token) by amax / 448 puts
# its largest value at the top of the range. Casts saturate at +-448: a plain cast of a larger
# value gives NaN (float8_e4m3fn has no infinity).
FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8_DTYPE).max)  # 448


def to_fp8(x: jax.Array) -> jax.Array:
    """x (any float dtype) as float8_e4m3fn, saturated at +-448 (NaN stays NaN)."""
    return jnp.clip(x.astype(jnp.float32), -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)


def quantize_fp8(w: jax.Array) -> Fp8Weight:
    """A [..., in, out] weight as e4m3 values with one float32 scale per output channel (amax / 448)."""
    w32 = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=-2)
    scales = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    return Fp8Weight(to_fp8(w32 / scales[..., None, :]), scales)


def quantize_activations_fp8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-token e4m3: x [..., in] -> (values float8_e4m3fn [..., in], scales f32 [..., 1] = amax / 448)."""
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=-1, keepdims=True)
    scales = jnp.where(amax > 0, amax / FP8_MAX, 1.0)  # [..., 1]
    return to_fp8(x32 / scales), scales


def quantize_activations(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-token symmetric int8: x [..., in] -> (values int8 [..., in], scales f32 [..., 1])."""
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=-1, keepdims=True)
    scales = jnp.where(amax > 0, amax / 127.0, 1.0)  # [..., 1]
    values = jnp.clip(jnp.round(x32 / scales), -127, 127).astype(jnp.int8)
    return values, scales


def dequantize(w: QuantizedWeight, dtype=jnp.float32) -> jax.Array:
    return (w.values.astype(jnp.float32) * w.scales[..., None, :]).astype(dtype)


# Names quantize_params can leave unquantized (keep=...): a layer weight is kept in every layer
# (a stacked [L, in, out] weight has one type for lax.scan), lm_head is the output projection.
QUANTIZABLE = LINEAR_WEIGHTS + ("lm_head",)


# ---- int8 KV cache ------------------------------------------------------------------------
# kv_cache_dtype="int8": each K/V page pool is a QuantizedKV. A token's K (or V) vector of one
# KV head is quantized on its own, symmetric, scale = amax / 127, when write_kv scatters it; the
# scale lives next to the values. Per-(token, head) scales fit the scatter: a token's write never
# changes the scale of other tokens in its page, so no page is ever re-quantized, and a page that
# is shared through the prefix cache stays bit-identical. They cost 4 bytes per token and head
# (6% of the int8 bytes at head_dim 64, 3% at 128). They are stored head-major within a page
# ([..., kv_heads, page_size]), so one KV head's scales of a page are one contiguous run: a TMA copy
# (the Mosaic GPU kernel) needs >= 16 contiguous bytes, and the Triton kernel reads them in one vector.

KV_CACHE_DTYPES = ("auto", "int8", "fp8")

# kv_cache_dtype="fp8": each pool is a plain float8_e4m3fn array of the unquantized pool's shape, with
# scale 1 (vLLM's fp8 cache without calibrated scales): a floating-point format keeps its relative
# precision (3 mantissa bits) over its whole range, so K and V need no per-token scale as long as
# they stay within +-448, where write_kv saturates them. It halves a bf16 cache's bytes exactly and
# keeps every page size open to the Mosaic GPU kernel (no scale copies).
FP8_KV_DTYPE = FP8_DTYPE
FP8_KV_MAX = FP8_MAX
to_fp8_kv = to_fp8  # K/V values as fp8, saturated at +-448


class QuantizedKV(NamedTuple):
    values: jax.Array  # [layers, pages, page_size, kv_heads, head_dim] int8
    # [layers, pages, kv_heads, page_size] float32: x[l, p, s, h] ~= values[l, p, s, h] * scales[l, p, h, s]
    scales: jax.Array

    @property
    def shape(self):  # the logical pool shape, as for an unquantized pool
        return self.values.shape

    @property
    def dtype(self):
        return self.values.dtype


def quantize_kv(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., head_dim] -> (values int8 [..., head_dim], scales float32 [...]), symmetric per vector."""
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=-1)
    scales = jnp.where(amax > 0, amax / 127.0, 1.0)
    values = jnp.clip(jnp.round(x32 / scales[..., None]), -127, 127).astype(jnp.int8)
    return values, scales


def dequantize_kv(values: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
    return (values.astype(jnp.float32) * scales[..., None]).astype(dtype)


def quantize_kv_pool(pool: jax.Array) -> "QuantizedKV":
    """A whole page pool [..., page_size, kv_heads, head_dim] as a QuantizedKV (scales head-major)."""
    values, scales = quantize_kv(pool)
    return QuantizedKV(values, jnp.swapaxes(scales, -1, -2))


def dequantize_kv_pool(pool: "QuantizedKV", dtype=jnp.float32) -> jax.Array:
    return dequantize_kv(pool.values, jnp.swapaxes(pool.scales, -1, -2), dtype)


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")


def kv_pool_bytes(shape, kv_cache_dtype: str, model_dtype) -> int:
    """Bytes of one page pool of `shape` ([..., kv_heads, head_dim]), scales included."""
    check_kv_cache_dtype(kv_cache_dtype)
    elements = 1
    for n in shape:
        elements *= int(n)
    if kv_cache_dtype == "int8":
        return elements + (elements // int(shape[-1])) * 4
    if kv_cache_dtype == "fp8":
        return elements
    return elements * jnp.dtype(model_dtype).itemsize


def make_kv_pool(shape, kv_cache_dtype: str, model_dtype, shardings=None):
    """A zeroed page pool: an array of the model dtype ("auto") or of fp8 ("fp8"), or a QuantizedKV ("int8").

    shardings: None, or a NamedSharding for the unquantized pool (scales_sharding derives the scales').
    """
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype in ("auto", "fp8"):
        dtype = FP8_KV_DTYPE if kv_cache_dtype == "fp8" else model_dtype
        if shardings is None:
            return jnp.zeros(shape, dtype)
        return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=shardings)()
    shape = tuple(shape)
    zeros = lambda: QuantizedKV(jnp.zeros(shape, jnp.int8), jnp.zeros(kv_scales_shape(shape), jnp.float32))
    if shardings is None:
        return zeros()
    return jax.jit(zeros, out_shardings=QuantizedKV(shardings, scales_sharding(shardings, len(shape))))()


def kv_scales_shape(shape) -> tuple:
    """A QuantizedKV's scales shape for values of `shape` [..., page_size, kv_heads, head_dim]."""
    *lead, page_size, kv_heads, _ = shape
    return (*lead, kv_heads, page_size)


def scales_sharding(sharding, rank: int):
    """The sharding of a QuantizedKV's scales ([..., kv_heads, page_size]), given its values'
    ([..., page_size, kv_heads, head_dim], rank `rank`) NamedSharding or PartitionSpec."""
    spec = sharding.spec if isinstance(sharding, NamedSharding) else sharding
    axes = tuple(spec) + (None,) * (rank - len(spec))
    scales_spec = PartitionSpec(*axes[: rank - 3], axes[rank - 2], axes[rank - 3])
    return NamedSharding(sharding.mesh, scales_spec) if isinstance(sharding, NamedSharding) else scales_spec


# int8 -> float32 by exponent bits: for v in [-128, 127], the float32 with bits
# 0x4B000000 + (v + 128) is exactly 2**23 + v + 128 (v + 128 fills the low mantissa bits).
_INT8_MAGIC_BITS = 0x4B000000 + 128
_INT8_MAGIC_VALUE = float(2 ** 23 + 128)


def int8_to_f32(w):
    """Exact int8 -> float32 by an integer add and a float subtract (full-rate ALU ops) instead of
    the int-to-float conversion instruction, which Hopper issues at 16 per clock per SM, an eighth
    of its FMA rate: in a GEMV that converts every weight byte, the conversion alone needs ~14 us
    for a 4096x14336 layer (~16 us of HBM reads)."""
    bits = w.astype(jnp.int32) + _INT8_MAGIC_BITS
    return jax.lax.bitcast_convert_type(bits, jnp.float32) - _INT8_MAGIC_VALUE
