"""Pure-XLA paged attention over the compressed latent cache of MLA (DeepSeek-V2/V3).

The cache holds, per token and layer, only the normalised KV latent (kv_lora_rank values)
and the shared RoPE key (qk_rope_head_dim values): one "head" of width C + R in a pool
[num_layers, num_pages, page_size, 1, C + R]. The model absorbs the K up-projection into the
query (q_latent = q_nope . W_uk) and the V up-projection into the output, so attention runs
entirely in latent space: score = q_latent . c + q_rope . k_rope, out = softmax . c.
"""
import jax
import jax.numpy as jnp

from jlight.pallas_kernels.attention_reference import _MASKED, online_softmax_step
from jlight.core.batch_metadata import BatchMetadata


def write_latent(cache, layer, latent, slot_mapping):
    """cache: [L, P, page_size, 1, C + R]; latent: [T, C + R]; slot_mapping: [T] flat slots."""
    page_size = cache.shape[2]
    return cache.at[layer, slot_mapping // page_size, slot_mapping % page_size, 0].set(latent.astype(cache.dtype))


def paged_latent_attention(q_latent, q_rope, cache, layer, md: BatchMetadata, *, scale: float):
    """Causal attention of each token over its own sequence's latent pages.

    q_latent: [T, heads, C]; q_rope: [T, heads, R]. Returns [T, heads, C] (latent outputs, before
    the V up-projection) in q_latent's dtype. This step's latents must already be written.
    """
    num_tokens, num_heads, latent_dim = q_latent.shape
    page_size = cache.shape[2]
    ql = q_latent.astype(jnp.float32) * scale
    qr = q_rope.astype(jnp.float32) * scale
    token_pages = md.page_table[md.token_seq]  # [T, max_pages]
    positions = md.positions
    num_pages = (jnp.max(md.context_lens) + page_size - 1) // page_size

    def body(j, carry):
        kv = cache[layer, token_pages[:, j], :, 0].astype(jnp.float32)  # [T, page_size, C + R]
        c, k_rope = kv[..., :latent_dim], kv[..., latent_dim:]
        s = jnp.einsum("thc,tsc->ths", ql, c) + jnp.einsum("thr,tsr->ths", qr, k_rope)
        kv_pos = j * page_size + jnp.arange(page_size)
        mask = (kv_pos[None, :] <= positions[:, None])[:, None, :]  # [T, 1, page_size]
        return online_softmax_step(carry, s, mask, lambda p: jnp.einsum("ths,tsc->thc", p, c))

    init = (
        jnp.full((num_tokens, num_heads), _MASKED, jnp.float32),
        jnp.zeros((num_tokens, num_heads), jnp.float32),
        jnp.zeros((num_tokens, num_heads, latent_dim), jnp.float32),
    )
    _, l, acc = jax.lax.fori_loop(0, num_pages, body, init)
    return (acc / jnp.maximum(l, 1e-30)[..., None]).astype(q_latent.dtype)
