"""The per-step description of a ragged batch, shared by the model and the kernels.

A step runs T tokens (decode tokens and prefill chunks of up to B sequences, flattened
into one array and padded to a bucket size). Everything here is a device array, so the
whole struct is a pytree that passes through `jax.jit` without recompiling as long as
the shapes (T, B, max_pages_per_seq) stay the same.

Page 0 of the KV pool is reserved as a scratch page: padding tokens write there and
unused page-table entries point there, so no index is ever out of range. A sliding-window
group's entries for pages its window no longer sees point there too (kv_layout.NULL_PAGE).
"""
from typing import NamedTuple

import jax
import jax.numpy as jnp


class BatchMetadata(NamedTuple):
    positions: jax.Array  # [T] int32, position of each token in its sequence
    slot_mapping: jax.Array  # [T] int32, page * page_size + offset where the token's K/V go
    token_seq: jax.Array  # [T] int32, batch row (0..B-1) each token belongs to
    page_table: jax.Array  # [B, max_pages_per_seq] int32, page ids of each row
    context_lens: jax.Array  # [B] int32, K/V length of each row after this step (0 = empty row)
    query_start: jax.Array  # [B + 1] int32, cu_q_lens: row b's tokens are [query_start[b], query_start[b+1])
    logits_indices: jax.Array  # [B] int32, flat index of the token whose logits each row samples from
    # [B] int32, each row's recurrent-state slot (hybrid models; 0 = the scratch slot), else None
    state_slots: jax.Array | None = None
    # A pool of layers grouped by attention kind (jlight/core/kv_layout.py), else None: the page tables and
    # slot mappings of groups 1..G-1 (page_table and slot_mapping above are group 0's). kv_layout.layer_view
    # gives each layer its own group's.
    group_page_tables: jax.Array | None = None  # [G - 1, B, max_pages_per_seq] int32
    group_slot_mappings: jax.Array | None = None  # [G - 1, T] int32


# Query blocks: the attention implementations cut each row's tokens into blocks of consecutive
# tokens, so that a block reads each of its row's pages once.
def query_blocks(query_start, num_blocks: int, block_q: int):
    """Cut each row's tokens into blocks of at most block_q tokens.

    Returns (row, start, end), each [num_blocks] int32: block i covers tokens
    [start, end) of row `row`; unused blocks have start == end == 0.
    """
    num_rows = query_start.shape[0] - 1
    q_lens = query_start[1:] - query_start[:-1]  # [B]
    blocks_per_row = (q_lens + block_q - 1) // block_q  # [B]
    cu_blocks = jnp.cumsum(blocks_per_row)  # [B], inclusive
    block = jnp.arange(num_blocks, dtype=jnp.int32)  # [num_blocks]
    used = block < cu_blocks[-1]
    # compare_all: the default method is a while loop, which XLA:GPU drives from the host (a sync per step).
    row = jnp.minimum(jnp.searchsorted(cu_blocks, block, side="right", method="compare_all"), num_rows - 1).astype(jnp.int32)
    first_block_of_row = cu_blocks[row] - blocks_per_row[row]
    start = query_start[row] + (block - first_block_of_row) * block_q
    end = jnp.minimum(start + block_q, query_start[row + 1])
    zero = jnp.zeros_like(start)
    return jnp.where(used, row, zero), jnp.where(used, start, zero), jnp.where(used, end, zero)


def token_blocks(md: BatchMetadata, num_tokens: int, num_blocks: int, block_q: int):
    """For each token, the query block that holds it and its place in that block (the inverse of
    query_blocks); padding tokens map to an arbitrary block and are zeroed by the caller."""
    blocks_per_row = (md.query_start[1:] - md.query_start[:-1] + block_q - 1) // block_q  # [B]
    blocks_before = jnp.cumsum(blocks_per_row) - blocks_per_row
    within = jnp.maximum(jnp.arange(num_tokens) - md.query_start[md.token_seq], 0)
    return jnp.minimum(blocks_before[md.token_seq] + within // block_q, num_blocks - 1), within % block_q
