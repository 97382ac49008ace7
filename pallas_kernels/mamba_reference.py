"""XLA references for Mamba-2's selective state space (SSD) over a ragged batch.

Per head h, with a_t = dt_t * A_h (A < 0) and the state h_t [head_dim, state_size]:
  h_t = exp(a_t) h_{t-1} + dt_t x_t B_t^T,    y_t = h_t C_t
(B and C shared by the heads of a group). The model adds D * x and the gate.

  ssd_scan(x, dt, A, B, C, ssm_pool, layer, state_slots, md, *, chunk_size) -> (y, ssm_pool)
    any ragged batch (prefill chunks and decode tokens): each row's tokens in chunks of
    chunk_size, in SSD's chunked form (ragged_scan.block_scan), starting from its slot's state.
  ssm_update(x, dt, A, B, C, ssm_pool, layer, state_slots) -> (y, ssm_pool)
    one token a row (decode): the recurrence above, once.

Shapes: x [T, heads, head_dim]; dt [T, heads] (already dt_bias'ed, softplus'ed and clamped);
A [heads] float32; B, C [T, groups, state_size]; ssm_pool [layers, slots, heads, head_dim, state_size], of
which `layer`'s rows are read and written (ragged_scan).
Outputs y [T, heads, head_dim] float32.
"""
from __future__ import annotations

import jax.numpy as jnp

from jlight.core.batch_metadata import BatchMetadata
from jlight.pallas_kernels.ragged_scan import block_scan


def _per_head(b, num_heads: int):
    """[..., groups, N] -> [..., heads, N] (heads of a group are consecutive)."""
    return jnp.repeat(b, num_heads // b.shape[-2], axis=-2)


def _ssd_block(A):
    def block(h0, inp, valid):
        x, dt, B, C = inp  # [L, H, P], [L, H], [L, H, N], [L, H, N]; dt 0 at invalid tokens
        a = dt * A  # [L, H]
        acum = jnp.cumsum(a, axis=0)  # [L, H]
        L = x.shape[0]
        causal = jnp.tril(jnp.ones((L, L), bool))
        seg = jnp.where(causal[:, :, None], acum[:, None, :] - acum[None, :, :], -jnp.inf)  # [l, s, H]
        scores = jnp.einsum("lhn,shn->lsh", C, B) * jnp.exp(seg)
        dtx = x * dt[..., None]  # [L, H, P]
        y = jnp.einsum("lsh,shp->lhp", scores, dtx)
        y = y + jnp.einsum("lhn,hpn->lhp", C, h0) * jnp.exp(acum)[..., None]
        to_end = jnp.exp(acum[-1][None, :] - acum)  # [L, H]
        h = h0 * jnp.exp(acum[-1])[:, None, None] + jnp.einsum("lh,lhn,lhp->hpn", to_end, B, dtx)
        return y, h
    return block


def ssd_scan(x, dt, A, B, C, ssm_pool, layer, state_slots, md: BatchMetadata, *, chunk_size: int = 64):
    num_heads = x.shape[1]
    f32 = lambda a: a.astype(jnp.float32)
    inputs = (f32(x), f32(dt), _per_head(f32(B), num_heads), _per_head(f32(C), num_heads))
    return block_scan(_ssd_block(f32(A)), inputs, ssm_pool, layer, state_slots, md, chunk_size)


def ssm_update(x, dt, A, B, C, ssm_pool, layer, state_slots):
    """x: [R, heads, head_dim], one token of each row R (its state in slot state_slots[r])."""
    num_heads = x.shape[1]
    x, dt = x.astype(jnp.float32), dt.astype(jnp.float32)
    B, C = _per_head(B.astype(jnp.float32), num_heads), _per_head(C.astype(jnp.float32), num_heads)
    h = ssm_pool[layer, state_slots].astype(jnp.float32)  # [R, H, P, N]
    h = h * jnp.exp(dt * A.astype(jnp.float32))[..., None, None] + jnp.einsum("rhp,rhn->rhpn", x * dt[..., None], B)
    y = jnp.einsum("rhpn,rhn->rhp", h, C)
    return y, ssm_pool.at[layer, state_slots].set(h.astype(ssm_pool.dtype))
