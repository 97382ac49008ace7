"""Pure-XLA matmuls over plain, int8- or fp8-quantized weights (the reference and CPU path)."""
import math

import jax
import jax.numpy as jnp

from jlight.core.gguf_weights import GGUF_WEIGHTS, dequantize_gguf_t
from jlight.core.quantization import (
    Fp8Weight, Fp8WeightT, QuantizedWeight, QuantizedWeightT, W8A8Weight, W8A8WeightT, quantize_activations,
    quantize_activations_fp8)

FP8_WEIGHTS = (Fp8Weight, Fp8WeightT)
# Steps of at least this many rows run fp8 weights as W8A8-FP8, smaller ones weight-only: the
# default of EngineConfig.fp8_w8a8_min_rows. A placeholder, to be measured on the H200 (the crossover
# of the two at the Llama-3-8B shapes: benchmarks/kernels.py fp8).
FP8_W8A8_MIN_ROWS = 64


def matmul(x, w, out_dtype=None, *, fp8_w8a8_min_rows: int = FP8_W8A8_MIN_ROWS):
    """x: [..., in] times w: [in, out] (an array, QuantizedWeight, W8A8Weight, Fp8Weight, or their K-major
    QuantizedWeightT / W8A8WeightT / Fp8WeightT holding [out, in], or a GGUF block-quantized weight,
    [out, in] blocks: core/gguf_weights.py) -> [..., out].

    Accumulates in float32 (int32 for W8A8); the result is cast to out_dtype (default: x's dtype).
    fp8 weights: W8A8-FP8 for steps of >= fp8_w8a8_min_rows rows, weight-only below (fp8_matmul).
    """
    out_dtype = out_dtype or x.dtype
    if isinstance(w, GGUF_WEIGHTS):
        # Dequantized to float32 [out, in] and contracted on `in`, in float32 (gguf_matmul_cpu's reference).
        y = jax.lax.dot_general(x.astype(jnp.float32), dequantize_gguf_t(w), (((x.ndim - 1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32)
        return y.astype(out_dtype)
    if isinstance(w, FP8_WEIGHTS):
        return fp8_matmul(x, w, out_dtype, w8a8=math.prod(x.shape[:-1]) >= fp8_w8a8_min_rows)
    if isinstance(w, (W8A8Weight, W8A8WeightT)):
        # Per-token int8 activations times the int8 weights, int32 sums (exact), both scales after.
        values = w.values if isinstance(w, W8A8Weight) else jnp.swapaxes(w.values_t, -1, -2)
        xq, x_scales = quantize_activations(x)
        y = jnp.dot(xq, values, preferred_element_type=jnp.int32).astype(jnp.float32)
        return (y * x_scales * w.scales.astype(jnp.float32)).astype(out_dtype)
    if isinstance(w, (QuantizedWeight, QuantizedWeightT)):
        # Dequantize in the compute dtype; XLA fuses the scale multiply into the dot's epilogue.
        values = w.values if isinstance(w, QuantizedWeight) else jnp.swapaxes(w.values_t, -1, -2)
        y = jnp.dot(x, values.astype(x.dtype), preferred_element_type=jnp.float32)
        return (y * w.scales.astype(jnp.float32)).astype(out_dtype)
    if jnp.dtype(out_dtype) == jnp.dtype(x.dtype):
        # The product in x's dtype directly (float32 sums all the same): a float32 product then a
        # cast is a separate pass over the output where XLA:GPU runs the dot on cuBLAS (H200, an
        # 8192-token prefill step: 0.38 ms a layer of converts after the gate/up and down GEMMs).
        return jnp.dot(x, w.astype(x.dtype), preferred_element_type=x.dtype)
    return jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(out_dtype)


def fp8_matmul(x, w, out_dtype=None, *, w8a8: bool):
    """x [..., in] times an Fp8Weight ([in, out]) or Fp8WeightT ([out, in]) -> [..., out] in out_dtype.

    w8a8=True (W8A8-FP8): x is quantized per token to e4m3 (scale = the row's amax / 448), the two fp8
    operands meet in one dot_general with float32 sums, and the row and column scales are applied in
    one elementwise epilogue. With K-major weights both operands contract on their minor dimension,
    the form XLA's GPU gemm rewriter turns into cuBLASLt's fp8 gemm (Hopper's fp8 tensor cores)
    without a transpose; [in, out] weights (under a mesh) cost it a transpose of the weights.
    w8a8=False (weight-only): the e4m3 values are upcast to x's dtype inside the dot (one byte a weight
    read), x stays as it is, and the column scales are applied after.
    The dot is 2-D ([rows, in] x [out, in]): the fp8 gemm takes one contracting and one free dimension.
    """
    out_dtype = out_dtype or x.dtype
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)  # [M, in]
    kmajor = isinstance(w, Fp8WeightT)
    values = w.values_t if kmajor else w.values  # [out, in] or [in, out]
    contract = (((1,), (1,)), ((), ())) if kmajor else (((1,), (0,)), ((), ()))
    if w8a8:
        xq, x_scales = quantize_activations_fp8(x2)  # [M, in] e4m3, [M, 1] float32
        y = jax.lax.dot_general(xq, values, contract, preferred_element_type=jnp.float32)
        y = y * x_scales * w.scales.astype(jnp.float32)
    else:
        y = jax.lax.dot_general(x2, values.astype(x.dtype), contract, preferred_element_type=jnp.float32)
        y = y * w.scales.astype(jnp.float32)
    return y.astype(out_dtype).reshape(*lead, y.shape[-1])
