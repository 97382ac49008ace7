"""The per-step description of a ragged batch, shared by the model and the kernels.

A step runs T tokens (decode tokens and prefill chunks of up to B sequences, flattened
into one array and padded to a bucket size). Everything here is a device array, so the
whole struct is a pytree that passes through `jax.jit` without recompiling as long as
the shapes (T, B, max_pages_per_seq) stay the same.

Page 0 of the KV pool is reserved as a scratch page: padding tokens write there and
unused page-table entries point there, so no index is ever out of range.
"""
from typing import NamedTuple

import jax


class BatchMetadata(NamedTuple):
    positions: jax.Array  # [T] int32, position of each token in its sequence
    slot_mapping: jax.Array  # [T] int32, page * page_size + offset where the token's K/V go
    token_seq: jax.Array  # [T] int32, batch row (0..B-1) each token belongs to
    page_table: jax.Array  # [B, max_pages_per_seq] int32, page ids of each row
    context_lens: jax.Array  # [B] int32, K/V length of each row after this step (0 = empty row)
    query_start: jax.Array  # [B + 1] int32, cu_q_lens: row b's tokens are [query_start[b], query_start[b+1])
    logits_indices: jax.Array  # [B] int32, flat index of the token whose logits each row samples from
