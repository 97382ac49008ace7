"""Pure-XLA paged attention: the reference every attention kernel is tested against,
and the implementation used on CPU.

One function serves decode, prefill chunks and mixed batches: each token attends to the
K/V of its own sequence up to its own position, read a few pages (128 positions) at a time with
an online softmax, so memory stays O(query rows x 128) whatever the context length.

The tokens are cut into blocks of consecutive tokens of one row (query_blocks), and a block
gathers each of its row's pages once: a prefill chunk's tokens share their gathers. Gathering
per token, one 512-token chunk over 1024 tokens of SmolLM2-shaped context took 208-217 ms a layer
on a 2-core CPU, against 25-37 ms now, and eight 1024-token prompts ran 2.9x faster end to end
(docs/BENCHMARKS.md, "CPU prefill").
"""
import jax
import jax.numpy as jnp

from jlight.core.batch_metadata import BatchMetadata, query_blocks, token_blocks
from jlight.core.quantization import FP8_KV_DTYPE, QuantizedKV, quantize_kv, to_fp8_kv

_MASKED = -1e30
_KV_PER_STEP = 128  # K/V positions a loop step reads (whole pages): fewer, larger products than one page


def write_kv(k_cache, v_cache, layer, k, v, slot_mapping):
    """Scatter this step's K/V into the paged cache.

    k_cache, v_cache: [num_layers, num_pages, page_size, num_kv_heads, head_dim], or QuantizedKV
    pools of that shape (int8 KV cache: each token's vector per KV head is quantized here); fp8
    pools take the values saturated to the format's range.
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
        values = to_fp8_kv(x) if cache.dtype == FP8_KV_DTYPE else x.astype(cache.dtype)
        return cache.at[layer, page, offset].set(values)

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


def query_block_size(num_tokens: int, num_rows: int) -> int:
    """Tokens per query block: up to 64, and at most num_tokens / num_rows, so the padded query
    rows (blocks x block size) stay under twice the tokens; 1 for decode steps."""
    size = 1
    while size < 64 and 2 * size * num_rows <= num_tokens:
        size *= 2
    return size


def paged_attention(q, k_cache, v_cache, layer, md: BatchMetadata, *, scale: float, sliding_window=None,
                    soft_cap: float | None = None, sinks=None):
    """Causal attention of each token over its own sequence's pages.

    q: [T, num_heads, head_dim]; returns [T, num_heads, head_dim] in q's dtype, zeros for padding
    tokens (beyond query_start[B]). K/V of this step must already be written (write_kv) so a token
    sees itself. int8 pools (QuantizedKV) are dequantized page by page.
    The attention kinds of the model families (models/attention_kinds.py):
      sliding_window: a token sees the last `sliding_window` positions, itself included; None sees
        the whole context. A Python int, or a traced int32 scalar (a scanned layer stack whose
        layers differ), where a value >= every context is the whole context.
      soft_cap: scores become soft_cap * tanh(scores / soft_cap) (Gemma 2), after `scale`.
      sinks: [num_heads] float32 learned logits (gpt-oss), one extra softmax column per head that
        takes probability mass and contributes no value.
    """
    num_tokens, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[2], k_cache.shape[3]
    num_rows = md.page_table.shape[0]
    group = num_heads // num_kv_heads
    block_q = query_block_size(num_tokens, num_rows)
    num_blocks = num_tokens if block_q == 1 else -(-num_tokens // block_q) + num_rows
    row, start, end = query_blocks(md.query_start, num_blocks, block_q)
    token = start[:, None] + jnp.arange(block_q)[None, :]  # [blocks, block_q]
    real = token < end[:, None]
    token = jnp.where(real, token, 0)
    positions = jnp.where(real, md.positions[token], -1)  # rows past a block's end see no position
    # [blocks, kv_heads, block_q * group, head_dim]: batch axes first, so each product is a plain batched matmul
    qg = q[token].reshape(num_blocks, block_q, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    qg = qg.reshape(num_blocks, num_kv_heads, block_q * group, head_dim).astype(jnp.float32) * scale
    row_pos = jnp.repeat(positions, group, axis=1)  # [blocks, block_q * group]: each query row's position
    pages_per_step = max(1, _KV_PER_STEP // page_size)
    max_pages = md.page_table.shape[1]
    # Padding entries point at scratch page 0; their positions lie past every context, so they are masked.
    block_pages = jnp.pad(md.page_table, ((0, 0), (0, -max_pages % pages_per_step)))[row]  # [blocks, pages]
    kv_per_step = pages_per_step * page_size
    num_steps = (jnp.max(md.context_lens) + kv_per_step - 1) // kv_per_step
    first_step = 0
    if sliding_window is not None:
        # Start at the first step any block's window reaches: the steps before it are masked for every
        # block, and a sliding-window group's pages there are null (page 0, kv_layout.NULL_PAGE).
        lowest = jnp.where(real[:, 0], positions[:, 0], jnp.iinfo(jnp.int32).max)  # [blocks] first query position
        first_step = jnp.minimum(jnp.maximum(jnp.min(lowest) - sliding_window + 1, 0) // kv_per_step, num_steps)

    def body(j, carry):
        pages = jax.lax.dynamic_slice_in_dim(block_pages, j * pages_per_step, pages_per_step, axis=1)
        # [blocks, kv_heads, positions, head_dim]
        merge = lambda x: x.reshape(num_blocks, kv_per_step, num_kv_heads, head_dim).transpose(0, 2, 1, 3)
        k, v = merge(load_pages(k_cache, layer, pages)), merge(load_pages(v_cache, layer, pages))
        s = jnp.einsum("bkqd,bksd->bkqs", qg, k)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kv_pos = j * kv_per_step + jnp.arange(kv_per_step)
        mask = kv_pos[None, None, :] <= row_pos[:, :, None]  # [blocks, block_q * group, kv_per_step]
        if sliding_window is not None:
            mask &= kv_pos[None, None, :] > row_pos[:, :, None] - sliding_window
        return online_softmax_step(carry, s, mask[:, None], lambda p: jnp.einsum("bkqs,bksd->bkqd", p, v))

    stat = (num_blocks, num_kv_heads, block_q * group)
    init = (jnp.full(stat, _MASKED, jnp.float32), jnp.zeros(stat, jnp.float32), jnp.zeros(stat + (head_dim,), jnp.float32))
    if sinks is not None:
        # The sink column starts the running softmax: max = the sink, sum = exp(0), no value.
        # Query row r of a block is head (kv_head * group + r % group).
        sink = jnp.tile(sinks.astype(jnp.float32).reshape(num_kv_heads, 1, group), (1, block_q, 1))
        init = (jnp.broadcast_to(sink.reshape(1, num_kv_heads, block_q * group), stat), jnp.ones(stat, jnp.float32), init[2])
    _, l, acc = jax.lax.fori_loop(first_step, num_steps, body, init)
    out = acc / jnp.maximum(l, 1e-30)[..., None]  # [blocks, kv_heads, block_q * group, head_dim]
    out = out.reshape(num_blocks, num_kv_heads, block_q, group, head_dim).transpose(0, 2, 1, 3, 4)
    out = out.reshape(num_blocks, block_q, num_heads, head_dim)
    if block_q == 1:  # block t is token t
        out = out.reshape(num_tokens, num_heads, head_dim)
    else:
        token_block, token_offset = token_blocks(md, num_tokens, num_blocks, block_q)
        out = out[token_block, token_offset]
    is_real_token = jnp.arange(num_tokens) < md.query_start[-1]
    return jnp.where(is_real_token[:, None, None], out, 0.0).astype(q.dtype)
