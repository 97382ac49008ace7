"""Decode attention on the CPU in C++ (paged_attention_cpu.cc, built and registered by cpu_ffi.load with the
other CPU kernels): the reference's contract (attention_reference.paged_attention) for float32 pools and the
plain causal kind, for the few tokens of a decode step.

The XLA reference loops over pages in a `while` of small gathers, products and softmax updates, each a
separate XLA:CPU operation: for SmolLM2's 30 layers at batch 1 those cost more than the attention's own
arithmetic. Here each (token, KV head) is one task: the scores of the head's query group over the row's
positions, their softmax, then the weighted sum of V, read page by page from the pool.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

TARGET = "jlight_paged_attention_cpu"


def takes(q, k_cache, *, sliding_window=None, soft_cap=None, sinks=None) -> bool:
    """Whether the kernel takes these inputs: float32 pools (not int8 or fp8), no sliding window, soft cap or sinks."""
    return (sliding_window is None and soft_cap is None and sinks is None and isinstance(k_cache, jax.Array)
            and k_cache.dtype == jnp.float32 and k_cache.ndim == 5)


def paged_attention(q, k_cache, v_cache, layer, md, *, scale: float, sliding_window=None, soft_cap=None, sinks=None):
    """attention_reference.paged_attention's signature and result (q [T, heads, head_dim] -> [T, heads, head_dim],
    zeros for padding tokens) where `takes` holds."""
    if not takes(q, k_cache, sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks):
        raise ValueError("paged_attention_cpu takes float32 pools without sliding windows, soft caps or sinks")
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    y = jax.ffi.ffi_call(TARGET, out)(q.astype(jnp.float32), k_cache, v_cache, jnp.asarray(layer, jnp.int32),
                                      md.token_seq, md.positions, md.page_table, md.query_start, scale=np.float32(scale))
    return y.astype(q.dtype)
