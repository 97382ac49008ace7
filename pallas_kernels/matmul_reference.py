"""Pure-XLA matmuls over plain or int8-quantized weights (the reference and CPU path)."""
import jax.numpy as jnp

from jlight.core.quantization import QuantizedWeight, QuantizedWeightT, W8A8Weight, W8A8WeightT, quantize_activations


def matmul(x, w, out_dtype=None):
    """x: [..., in] times w: [in, out] (an array, QuantizedWeight, W8A8Weight, or their K-major
    QuantizedWeightT / W8A8WeightT holding [out, in]) -> [..., out].

    Accumulates in float32 (int32 for W8A8); the result is cast to out_dtype (default: x's dtype).
    """
    out_dtype = out_dtype or x.dtype
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
