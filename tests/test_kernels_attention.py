"""Pallas paged attention (interpret mode on CPU) against the XLA reference.

Interpret mode fills every output buffer with NaN before the kernel runs, so an output
element the kernel forgets to write shows up as NaN and fails `_check`.
"""
import numpy as np
import jax.numpy as jnp
import pytest

from kernel_batches import check_attention_output, random_batch, reference_attention
from jlight.pallas_kernels import dispatch, paged_attention_pallas

PAGE_SIZE = 16
NUM_KV_HEADS = 2
NUM_LAYERS = 2

# (name, dtype, group, head_dim, q_lens, context_lens, num_tokens incl. padding, sliding_window, num_splits)
CASES = [
    # decode rows: single token, page-boundary lengths (16, 17, 32), an empty row, a long row; split-K
    ("decode_split", jnp.bfloat16, 4, 128, [1, 1, 1, 0, 1, 1, 1], [1, 16, 17, 0, 32, 300, 2050], 7, None, None),
    ("decode_gqa1", jnp.float32, 1, 64, [1, 1, 0, 1], [1, 33, 0, 15], 4, None, 1),
    # mixed prefill chunks (with earlier context in pages) + decode + empty row + padding tokens
    ("mixed_gqa8", jnp.float32, 8, 64, [37, 1, 0, 16, 5], [37, 200, 0, 48, 70], 64, None, None),
    ("prefill_chunk", jnp.bfloat16, 4, 128, [40], [1000], 48, None, None),
    ("sliding_window", jnp.float32, 4, 64, [1, 20], [500, 300], 24, 64, None),
    # Gemma 4's full layers: head_dim 512 (half the positions a step), a prefill chunk beside decode rows
    ("head_dim_512", jnp.float32, 2, 512, [1, 9, 1], [40, 9, 100], 16, None, None),
]


def _check(rng, dtype, group, head_dim, q_lens, ctx_lens, num_tokens, sliding_window, num_splits):
    num_pages = sum(-(-c // PAGE_SIZE) for c in ctx_lens) + 4
    md = random_batch(rng, q_lens, ctx_lens, page_size=PAGE_SIZE, num_pages=num_pages, num_tokens=num_tokens)
    shape = (NUM_LAYERS, num_pages, PAGE_SIZE, NUM_KV_HEADS, head_dim)
    k = jnp.asarray(rng.standard_normal(shape), dtype)
    v = jnp.asarray(rng.standard_normal(shape), dtype)
    q = jnp.asarray(rng.standard_normal((num_tokens, NUM_KV_HEADS * group, head_dim)), dtype)
    layer = jnp.int32(1)
    kw = dict(scale=head_dim ** -0.5, sliding_window=sliding_window)
    f32 = lambda a: a.astype(jnp.float32)
    want = np.asarray(reference_attention(f32(q), f32(k), f32(v), layer, md, **kw))
    got = paged_attention_pallas.paged_attention(q, k, v, layer, md, num_splits=num_splits, **kw)
    check_attention_output(got, want, md, dtype)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_reference(case):
    rng = np.random.default_rng(abs(hash(case[0])) % 2**32)
    _check(rng, *case[1:])


def test_split_k_equals_single_pass():
    """Split-K and one pass over the pages compute the same attention."""
    rng = np.random.default_rng(7)
    md = random_batch(rng, [1, 1, 1], [700, 5, 129], page_size=PAGE_SIZE, num_pages=60)
    shape = (1, 60, PAGE_SIZE, NUM_KV_HEADS, 64)
    k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((3, NUM_KV_HEADS * 4, 64)), jnp.float32)
    one = paged_attention_pallas.paged_attention(q, k, v, jnp.int32(0), md, scale=0.125, num_splits=1)
    many = paged_attention_pallas.paged_attention(q, k, v, jnp.int32(0), md, scale=0.125, num_splits=5)
    np.testing.assert_allclose(np.asarray(many), np.asarray(one), atol=1e-5, rtol=1e-5)


def test_rejects_page_size_not_power_of_two():
    md = random_batch(np.random.default_rng(0), [1], [5], page_size=12, num_pages=3)
    k = jnp.zeros((1, 3, 12, 1, 64))
    with pytest.raises(ValueError, match="page_size=12"):
        paged_attention_pallas.paged_attention(jnp.ones((1, 1, 64)), k, k, jnp.int32(0), md, scale=0.125)


def test_dispatch_selects_pallas_kernels():
    kernels = dispatch.get_kernels("pallas", "pallas")
    assert kernels.paged_attention.args[0] is dispatch.mosaic_or_triton_attention  # the Mosaic GPU kernel where it applies
    assert kernels.matmul.func is dispatch.fp8_or  # fp8 weights to XLA's fp8 dot, every other weight to:
    assert kernels.matmul.args[0].__module__ == "jlight.pallas_kernels.matmul_pallas"
