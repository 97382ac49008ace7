"""Collective matmuls: the all-gather before a column-parallel matmul and the reduce-scatter
after a row-parallel one, broken into a ring of `ppermute` steps interleaved with partial
matmuls so that communication overlaps compute (the JAX shard_map guide's "collective
matmul"; Wang et al., "Overlap communication with dependent computation").

Both are bidirectional: each device's token block is cut in two halves, one travelling
clockwise and one counter-clockwise, so both directions of every link carry data and the
ring takes n - 1 hops of half a block instead of n - 1 hops of a whole one.

Call them inside `shard_map` over `axis_name` (of size `n`), with activations sharded on
tokens (sequence parallelism) between a row-parallel output and the next column input.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _ring(n: int, step: int):
    """Permutation sending device j's buffer to j + step (mod n)."""
    return [(j, (j + step) % n) for j in range(n)]


def all_gather_matmul(x, w, matmul, *, axis_name: str, n: int):
    """all_gather(x, tokens) @ w without a separate all-gather.

    x: [T/n, in] this device's token block; w: [in, out/n] this device's columns.
    Returns [T, out/n] (all tokens, local columns), token order as a tiled all-gather.
    """
    if n == 1:
        return matmul(x, w)
    block = x.shape[0]
    if block % 2:
        raise ValueError(f"all_gather_matmul needs an even token block per device, got {block}")
    half = block // 2
    me = jax.lax.axis_index(axis_name)
    fwd, bwd = x[:half], x[half:]  # first halves travel to j+1, second halves to j-1
    out = jnp.zeros((n, 2, half, w.shape[-1]), x.dtype)  # [source block, half, half tokens, out/n]
    for step in range(n):
        # At this step we hold the first half of block me - step and the second half of block me + step.
        src_fwd, src_bwd = (me - step) % n, (me + step) % n
        if step < n - 1:  # issue the transfers before the matmuls so they overlap
            next_fwd = jax.lax.ppermute(fwd, axis_name, _ring(n, 1))
            next_bwd = jax.lax.ppermute(bwd, axis_name, _ring(n, -1))
        out = jax.lax.dynamic_update_slice(out, matmul(fwd, w)[None, None], (src_fwd, 0, 0, 0))
        out = jax.lax.dynamic_update_slice(out, matmul(bwd, w)[None, None], (src_bwd, 1, 0, 0))
        if step < n - 1:
            fwd, bwd = next_fwd, next_bwd
    return out.reshape(n * block, w.shape[-1])


def matmul_reduce_scatter(x, w, matmul, *, axis_name: str, n: int):
    """psum_scatter(x @ w, tokens) without a separate reduce-scatter.

    x: [T, in/n] all tokens, this device's slice of the contraction dim; w: [in/n, out].
    Returns [T/n, out]: this device's token block of the sum over devices.

    Partial sums travel round the ring; each device adds its contribution for the block the
    sum is heading to, so after n - 1 hops every block's sum arrives at its owner.
    """
    if n == 1:
        return matmul(x, w)
    tokens = x.shape[0]
    if tokens % (2 * n):
        raise ValueError(f"matmul_reduce_scatter needs tokens divisible by 2 * {n}, got {tokens}")
    half = tokens // (2 * n)
    me = jax.lax.axis_index(axis_name)
    x_blocks = x.reshape(n, 2, half, x.shape[-1])  # [block, half, half tokens, in/n]

    def partial(block_idx, which):
        rows = jax.lax.dynamic_index_in_dim(x_blocks, block_idx, axis=0, keepdims=False)[which]
        return matmul(rows, w)  # [half, out]

    acc_fwd = acc_bwd = None
    for step in range(n):
        # The clockwise sum held now started at device me - step and is bound for block
        # me - step - 1; the counter-clockwise one started at me + step, bound for me + step + 1.
        # At the last step both are bound for `me`.
        p_fwd = partial((me - step - 1) % n, 0)
        p_bwd = partial((me + step + 1) % n, 1)
        acc_fwd = p_fwd if acc_fwd is None else acc_fwd + p_fwd
        acc_bwd = p_bwd if acc_bwd is None else acc_bwd + p_bwd
        if step < n - 1:
            acc_fwd = jax.lax.ppermute(acc_fwd, axis_name, _ring(n, 1))
            acc_bwd = jax.lax.ppermute(acc_bwd, axis_name, _ring(n, -1))
    return jnp.concatenate([acc_fwd, acc_bwd], axis=0)  # [T/n, out]
