"""The ragged batch cut into blocks of one sequence each, for the recurrent layers' references.

A recurrent layer (Mamba-2's SSD scan, the gated delta rule) reads a sequence's tokens in order,
starting from the state its sequence left after its previous step: a fixed-size array in a state
pool, one slot per running sequence (jlight/engine/state_pool.py), the slot of row b being
`state_slots[b]`. Slot 0 is scratch: padding rows read and write it. The functions take the pool of
every layer of a kind ([layers, slots, ...]) and the layer, and read and write only the batch's rows
of that layer in it, as attention reads the KV pool: no slice of a layer is taken out and set back
(which, alone in a program, XLA copies whole: 12 layers of 1,025 slots of 32 x 64 on the CPU, 168 ms
against 0.035 ms; inside the engine's step it kept them in place, and the two ways decode alike).

`block_scan` cuts each row's tokens into blocks of at most `block_len` consecutive tokens
(batch_metadata.query_blocks: a block never spans two rows) and runs `block_fn` over the blocks in
order under lax.scan, the pool in the carry: a block reads its row's slot, computes its tokens'
outputs and the state after its last token, and writes that back to the slot. A row's blocks are
consecutive, so its second block reads what its first wrote, and the slot ends the step holding the
state after the row's last token. A block whose first token is at position 0 starts from zeros: a
new sequence needs no cleared slot.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jlight.core.batch_metadata import BatchMetadata, query_blocks


def num_blocks(num_tokens: int, num_rows: int, block_len: int) -> int:
    """Blocks enough for any ragged batch of num_tokens tokens in num_rows rows."""
    return -(-num_tokens // block_len) + num_rows


def block_scan(block_fn: Callable, token_inputs, state_pool, layer, state_slots, md: BatchMetadata, block_len: int):
    """block_fn(state [*S] float32, inputs [L, ...] (a pytree, invalid tokens zeroed), valid [L] bool)
    -> (outputs [L, ...], new state [*S]) over the blocks of the ragged batch.

    token_inputs: a pytree of [T, ...] arrays; state_pool: [layers, slots, *S], of which `layer` (an int, or
    an int32 scalar) is read and written; state_slots: [B] int32.
    Returns (outputs [T, ...] with zeros at padding tokens, state_pool)."""
    num_tokens = jax.tree.leaves(token_inputs)[0].shape[0]
    block_len = min(block_len, num_tokens)  # a small step's rows fit shorter blocks
    rows = state_slots.shape[0]
    row, start, end = query_blocks(md.query_start, num_blocks(num_tokens, rows, block_len), block_len)
    idx = start[:, None] + jnp.arange(block_len, dtype=jnp.int32)[None, :]  # [NB, L]
    valid = idx < end[:, None]
    idx = jnp.minimum(idx, num_tokens - 1)
    used = end > start
    slot = jnp.where(used, state_slots[row], 0)
    fresh = md.positions[start] == 0  # the block opens its sequence
    blocks = jax.tree.map(lambda a: jnp.where(valid.reshape(valid.shape + (1,) * (a.ndim - 1)), a[idx], 0), token_inputs)

    def body(pool, xs):
        inputs, valid_b, slot_b, fresh_b = xs
        state = jnp.where(fresh_b, 0.0, pool[layer, slot_b].astype(jnp.float32))
        out, state = block_fn(state, inputs, valid_b)
        return pool.at[layer, slot_b].set(state.astype(pool.dtype)), out

    state_pool, outs = jax.lax.scan(body, state_pool, (blocks, valid, slot, fresh))
    dest = jnp.where(valid, idx, num_tokens).reshape(-1)  # invalid positions scatter out of range: dropped

    def unblock(o):
        flat = o.reshape((-1,) + o.shape[2:])
        return jnp.zeros((num_tokens,) + o.shape[2:], o.dtype).at[dest].set(flat, mode="drop")

    return jax.tree.map(unblock, outs), state_pool


def causal_conv1d(x, weight, bias, conv_pool, layer, state_slots, md: BatchMetadata):
    """The depthwise causal convolution of a ragged batch, each row continuing its rolling state.

    x: [T, C] the step's inputs; weight: [K, C] (tap K-1 multiplies the current token); bias: [C]
    or None; conv_pool: [layers, slots, K-1, C], slot s of `layer` holding the K-1 inputs before its
    sequence's next token (oldest first; zeros before position 0, which a fresh row reads without
    touching the slot).
    Returns (y [T, C] float32, before any activation; conv_pool with each row's last K-1 inputs)."""
    num_tokens, channels = x.shape
    K = weight.shape[0]
    x32 = x.astype(jnp.float32)
    t = jnp.arange(num_tokens)
    row = md.token_seq
    first = md.query_start[row]  # [T] the row's first token in this step
    within = t - first
    fresh_tok = md.positions[first] == 0
    state = jnp.where(fresh_tok[:, None, None], 0.0, conv_pool[layer, state_slots[row]].astype(jnp.float32))  # [T, K-1, C]
    taps = []
    for lag in range(K):  # tap K-1-lag reads the input `lag` tokens back
        from_chunk = x32[jnp.maximum(t - lag, 0)]
        from_state = jnp.take_along_axis(state, jnp.clip(K - 1 + within - lag, 0, K - 2)[:, None, None], axis=1)[:, 0] \
            if K > 1 else from_chunk
        taps.append(jnp.where((lag <= within)[:, None], from_chunk, from_state))
    # [T, K, C] windows times the weights, summed over the taps: a reduction, which XLA computes once; a sum of
    # products it fuses again into each of y's consumers, which then read the old rows after the write below.
    y = jnp.sum(jnp.stack(taps[::-1], axis=1) * weight.astype(jnp.float32)[None], axis=1)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    if K == 1:
        return y, conv_pool
    # New state of each row: the inputs at positions end-(K-1) .. end-1.
    q_start, q_end = md.query_start[:-1], md.query_start[1:]
    q_len = q_end - q_start
    rows = state_slots.shape[0]
    fresh_row = md.positions[jnp.minimum(q_start, num_tokens - 1)] == 0
    old = jnp.where(fresh_row[:, None, None], 0.0, conv_pool[layer, state_slots].astype(jnp.float32))  # [B, K-1, C]
    i = jnp.arange(K - 1)[None, :]  # [1, K-1]
    back = q_len[:, None] - (K - 1) + i  # offset in the chunk of state entry i
    from_chunk = x32[jnp.clip(q_start[:, None] + back, 0, num_tokens - 1)]  # [B, K-1, C]
    from_old = jnp.take_along_axis(old, jnp.clip(i + q_len[:, None], 0, K - 2)[:, :, None], axis=1)
    new = jnp.where((back >= 0)[:, :, None], from_chunk, from_old)
    slots = jnp.where(q_len > 0, state_slots, 0)  # empty rows write the scratch slot
    del rows
    # The written rows depend on y by data (a term that is always +0.0, NaN-free: a comparison's 0 or 1 times 0),
    # so XLA reads the old rows for y before it writes the pool; left unordered, it may write first and copy the
    # whole pool to keep the old rows (an optimization barrier does not survive XLA:CPU's passes).
    new = new + 0.0 * (y[:1, None, :1] > 0).astype(jnp.float32)
    return y, conv_pool.at[layer, slots].set(new.astype(conv_pool.dtype))
