"""Pure-XLA paged attention: the reference every attention kernel is tested against,
and the implementation used on CPU.

One function serves decode, prefill chunks and mixed batches: each token attends to the
K/V of its own sequence up to its own position, read page by page with an online
softmax, so memory stays O(tokens x page_size) whatever the context length.
"""
import jax
import jax.numpy as jnp

from jlight.pallas_kernels.batch_metadata import BatchMetadata
from jlight.pallas_kernels.quantization import QuantizedKV, quantize_kv

_MASKED = -1e30


def write_kv(k_cache, v_cache, layer, k, v, slot_mapping):
    """Scatter this step's K/V into the paged cache.

    k_cache, v_cache: [num_layers, num_pages, page_size, num_kv_heads, head_dim], or QuantizedKV
    pools of that shape (int8 KV cache: each token's vector per KV head is quantized here).
    k, v: [T, num_kv_heads, head_dim]; slot_mapping: [T] flat slots.
    """
    page_size = k_cache.shape[2]
    page = slot_mapping // page_size
    offset = slot_mapping % page_size

    def write(cache, x):
        if isinstance(cache, QuantizedKV):
            values, scales = quantize_kv(x)
            # scales [T, kv_heads] go to [layer, page, :, offset] (the pool keeps them head-major)
            return QuantizedKV(cache.values.at[layer, page, offset].set(values),
                               cache.scales.at[layer, page, :, offset].set(scales))
        return cache.at[layer, page, offset].set(x.astype(cache.dtype))

    return write(k_cache, k), write(v_cache, v)


def load_pages(cache, layer, pages):
    """cache[layer, pages] as float32 ([..., page_size, kv_heads, head_dim]), dequantized if int8."""
    if isinstance(cache, QuantizedKV):
        scales = jnp.swapaxes(cache.scales[layer, pages], -1, -2)  # [..., page_size, kv_heads]
        return cache.values[layer, pages].astype(jnp.float32) * scales[..., None]
    return cache[layer, pages].astype(jnp.float32)


def online_softmax_step(carry, scores, mask, weighted_values):
    """Fold one page of scores into a running softmax (m = max, l = sum, acc = weighted values).

    scores: [..., page_size] with mask broadcastable to it; weighted_values(p) -> p . V for
    probabilities p of scores' shape. Masked positions contribute nothing, even on a page
    that is masked entirely.
    """
    m, l, acc = carry
    scores = jnp.where(mask, scores, _MASKED)
    m_new = jnp.maximum(m, scores.max(-1))
    p = jnp.where(mask, jnp.exp(scores - m_new[..., None]), 0.0)
    correction = jnp.exp(m - m_new)
    return m_new, l * correction + p.sum(-1), acc * correction[..., None] + weighted_values(p)


def paged_attention(q, k_cache, v_cache, layer, md: BatchMetadata, *, scale: float, sliding_window: int | None = None):
    """Causal attention of each token over its own sequence's pages.

    q: [T, num_heads, head_dim]; returns [T, num_heads, head_dim] in q's dtype.
    K/V of this step must already be written (write_kv) so a token sees itself. int8 pools
    (QuantizedKV) are dequantized page by page.
    """
    num_tokens, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[2], k_cache.shape[3]
    group = num_heads // num_kv_heads
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(jnp.float32) * scale
    token_pages = md.page_table[md.token_seq]  # [T, max_pages]
    positions = md.positions
    num_pages = (jnp.max(md.context_lens) + page_size - 1) // page_size

    def body(j, carry):
        page = token_pages[:, j]
        k = load_pages(k_cache, layer, page)  # [T, page_size, kv_heads, head_dim]
        v = load_pages(v_cache, layer, page)
        s = jnp.einsum("tkgd,tskd->tkgs", qg, k)
        kv_pos = j * page_size + jnp.arange(page_size)
        mask = kv_pos[None, :] <= positions[:, None]  # [T, page_size]
        if sliding_window is not None:
            mask &= kv_pos[None, :] > positions[:, None] - sliding_window
        return online_softmax_step(carry, s, mask[:, None, None, :], lambda p: jnp.einsum("tkgs,tskd->tkgd", p, v))

    init = (
        jnp.full((num_tokens, num_kv_heads, group), _MASKED, jnp.float32),
        jnp.zeros((num_tokens, num_kv_heads, group), jnp.float32),
        jnp.zeros((num_tokens, num_kv_heads, group, head_dim), jnp.float32),
    )
    _, l, acc = jax.lax.fori_loop(0, num_pages, body, init)
    out = acc / jnp.maximum(l, 1e-30)[..., None]
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
