"""Every Pallas kernel, at the H200 benchmark shapes, lowers to Triton modules that verify.

This is the CPU stand-in for the GPU's own parse of the module: a kernel that passes its
interpret-mode tests can still lower to a malformed module (seen 2026-11-29: the grouped matmul's
K loop got bounds of different types and failed on the H200 only). tests/triton_lowering.py says how.
"""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from jlight.pallas_kernels import (
    grouped_matmul_pallas,
    matmul_pallas,
    paged_attention_pallas,
)
from jlight.core.quantization import QuantizedKV, QuantizedWeight, QuantizedWeightT, W8A8WeightT, kv_scales_shape
from kernel_batches import random_batch
from triton_lowering import triton_module_texts, verified_triton_modules

S = jax.ShapeDtypeStruct


def _attention_args(kv_dtype, q_lens, ctx_lens, num_tokens):
    page_size, kv_heads, head_dim = 16, 8, 128
    num_pages = sum(-(-c // page_size) for c in ctx_lens) + 1
    md = random_batch(np.random.default_rng(0), q_lens, ctx_lens, page_size=page_size, num_pages=num_pages,
                      num_tokens=num_tokens)
    shape = (2, num_pages, page_size, kv_heads, head_dim)
    if kv_dtype == "int8":
        pool = QuantizedKV(S(shape, jnp.int8), S(kv_scales_shape(shape), jnp.float32))
    else:
        pool = S(shape, jnp.float32 if kv_dtype == "f32" else jnp.bfloat16)
    q_dtype = jnp.float32 if kv_dtype == "f32" else jnp.bfloat16  # float32: full-precision dots, not TF32
    return S((num_tokens, 32, head_dim), q_dtype), pool, md


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "f32"])
@pytest.mark.parametrize("batch,cfg", [
    ("decode", {}), ("decode", dict(num_splits=2)), ("decode", dict(pages_per_step=8, num_warps=8, num_stages=3)),
    ("prefill", {}),
])
def test_paged_attention_modules_verify(kv_dtype, batch, cfg):
    if batch == "decode":
        q, pool, md = _attention_args(kv_dtype, [1] * 8, [4096] * 8, 8)
    else:
        q, pool, md = _attention_args(kv_dtype, [256, 1], [3000, 700], 264)
    fn = lambda q, k, v, md: paged_attention_pallas.paged_attention(q, k, v, jnp.int32(1), md, scale=0.088,
                                                                     interpret=False, **cfg)
    assert verified_triton_modules(fn, q, pool, pool, md) == 1


def test_float32_attention_multiplies_in_float32_not_tf32():
    """Triton's dots default to TF32; a float32 model's attention must not (model_runner.matmul_precision).
    tt.dot omits its inputPrecision when it is IEEE, Triton's own default."""
    fn = lambda q, k, v, md: paged_attention_pallas.paged_attention(q, k, v, jnp.int32(1), md, scale=0.088,
                                                                     interpret=False)
    for kv_dtype, tf32 in (("f32", False), ("bf16", True)):
        q, pool, md = _attention_args(kv_dtype, [1] * 8, [4096] * 8, 8)
        dots = [line for text in triton_module_texts(fn, q, pool, pool, md)
                for line in text.splitlines() if "tt.dot " in line]
        assert len(dots) == 2, dots
        assert all(("inputPrecision = tf32" in d) == tf32 for d in dots), (kv_dtype, dots)


@pytest.mark.parametrize("m,cfg", [
    (1, {}), (1, dict(block_n=256, num_splits=4)), (3, {}), (8, {}), (8, dict(gemv=True)), (64, {}),
])
def test_w8a16_modules_verify(m, cfg):
    k, n = 4096, 14336
    w = QuantizedWeight(S((k, n), jnp.int8), S((n,), jnp.float32))
    fn = lambda x, w: matmul_pallas.w8a16_matmul(x, w, interpret=False, **cfg)
    assert verified_triton_modules(fn, S((m, k), jnp.bfloat16), w) == 1


@pytest.mark.parametrize("m,k,n,cfg", [
    (1, 4096, 14336, {}), (1, 4096, 14336, dict(block_n=16, block_k=512, num_splits=1)), (1, 14336, 4096, {}),
    (2, 14336, 4096, {}), (1, 4096, 128256, {}),
])
def test_w8a16_kmajor_modules_verify(m, k, n, cfg):
    w = QuantizedWeightT(S((n, k), jnp.int8), S((n,), jnp.float32))
    fn = lambda x, w: matmul_pallas.w8a16_kmajor_matmul(x, w, interpret=False, **cfg)
    assert verified_triton_modules(fn, S((m, k), jnp.bfloat16), w) == 1


def test_w8a8_module_verifies():
    w = W8A8WeightT(S((1024, 4096), jnp.int8), S((1024,), jnp.float32))
    fn = lambda x, w: matmul_pallas.w8a8_matmul(x, w, interpret=False)
    assert verified_triton_modules(fn, S((512, 4096), jnp.bfloat16), w) == 1


@pytest.mark.parametrize("m,k,n,groups,w_dtype", [
    (4096, 4096, 14336, 8, jnp.bfloat16),   # Mixtral gate/up, prefill 2048 x top-2
    (16384, 7168, 2048, 256, jnp.bfloat16),  # DeepSeek-V3 gate/up, prefill 2048 x top-8
    (8, 2048, 7168, 256, jnp.bfloat16),      # DeepSeek-V3 down, decode 1 x top-8
    (128, 4096, 14336, 8, jnp.int8),         # int8 experts, converted in the kernel
])
def test_grouped_matmul_modules_verify(m, k, n, groups, w_dtype):
    fn = lambda x, w, gs: grouped_matmul_pallas.grouped_matmul(x, w, gs, interpret=False)
    assert verified_triton_modules(fn, S((m, k), jnp.bfloat16), S((groups, k, n), w_dtype), S((groups,), jnp.int32)) == 1
