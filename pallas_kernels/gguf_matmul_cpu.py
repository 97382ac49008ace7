"""The CPU kernel for GGUF block-quantized weights (jlight/core/gguf_weights.py): x times the weights
as the file stores them (the K-quants as their sub-blocks), in float32, through XLA's FFI
(gguf_matmul_cpu.cc, built and registered by cpu_ffi.load with the other CPU kernels).

Batch-1 decode on the CPU is a chain of one-row matmuls that read every weight once: float32 weights
move 4 bytes a weight; kept as Q4_1 they move 0.625, and the kernel dequantizes each block in
registers (d * (x . values) + m * sum(x)), on XLA's intra-op threads, output channels split between
them. The scales' dtype (float16, or float32 for the K-quants) and count (a block of 32, or 16 for
Q6_K) pick the kernel's instance at run time. Same signature as matmul_reference.matmul for GGUF
weights (the reference dequantizes them and runs XLA's dot); dispatch sends steps of up to
`gguf_kernel_max_rows` rows here.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jlight.core.gguf_weights import GGUFQ4Weight, GGUFQ8MinWeight, GGUFQ8Weight

TARGETS = {GGUFQ4Weight: "jlight_gguf_q4_matmul", GGUFQ8Weight: "jlight_gguf_q8_matmul",
           GGUFQ8MinWeight: "jlight_gguf_q8_min_matmul"}


def matmul(x, w, out_dtype=None):
    """x [..., in] times a GGUF weight ([out, in] blocks) -> [..., out] in out_dtype (default x's dtype),
    float32 math. Needs cpu_ffi.load() first."""
    out_dtype = out_dtype or x.dtype
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k).astype(jnp.float32)
    out = jax.ShapeDtypeStruct((x2.shape[0], w.scales.shape[-2]), jnp.float32)
    y = jax.ffi.ffi_call(TARGETS[type(w)], out)(x2, *w)  # the weight's fields in order: values, scales[, mins]
    return y.astype(out_dtype).reshape(*lead, out.shape[-1])
