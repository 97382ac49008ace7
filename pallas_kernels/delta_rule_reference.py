"""XLA references for the gated delta rule (Qwen3-Next's gated DeltaNet) over a ragged batch.

Per value head, with the state S [k_dim, v_dim], q and k L2-normalised by the caller, q scaled by
k_dim ** -0.5 here, g_t <= 0 the log decay and beta_t in (0, 1):
  S <- exp(g_t) S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t

  chunked_delta_rule(q, k, v, g, beta, state_pool, layer, state_slots, md, *, chunk_size) -> (o, state_pool)
    any ragged batch: each row's tokens in chunks of chunk_size (ragged_scan.block_scan), each
    chunk in the WY form of FLA's chunked kernel (one triangular solve per chunk), starting from the
    row's slot.
  delta_rule_update(q, k, v, g, beta, state_pool, layer, state_slots) -> (o, state_pool)
    one token a row (decode): the recurrence above, once.

Shapes: q, k [T, v_heads, k_dim] (key heads already repeated to the value heads); v [T, v_heads,
v_dim]; g, beta [T, v_heads]; state_pool [layers, slots, v_heads, k_dim, v_dim], of which `layer`'s rows are
read and written (ragged_scan). o [T, v_heads, v_dim] float32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jlight.core.batch_metadata import BatchMetadata
from jlight.pallas_kernels.ragged_scan import block_scan


def _delta_block(S0, inp, valid):
    q, k, v, g, beta = inp  # [L, H, K], [L, H, K], [L, H, V], [L, H], [L, H]; zeros at invalid tokens
    L = q.shape[0]
    q = q * q.shape[-1] ** -0.5
    gcum = jnp.cumsum(g, axis=0)  # [L, H]
    causal = jnp.tril(jnp.ones((L, L), bool))
    decay = jnp.exp(jnp.where(causal[:, :, None], gcum[:, None, :] - gcum[None, :, :], -jnp.inf))  # [i, j, H]
    kb, vb = k * beta[..., None], v * beta[..., None]
    # (I + strictly-lower(beta_i k_i . k_j decay_ij)) U = beta V and W = beta K exp(gcum)
    system = jnp.einsum("ihk,jhk->hij", kb, k) * jnp.moveaxis(decay, 2, 0)  # [H, L, L]
    system = jnp.tril(system, -1) + jnp.eye(L)
    solve = lambda rhs: jax.scipy.linalg.solve_triangular(system, jnp.moveaxis(rhs, 1, 0), lower=True, unit_diagonal=True)
    u = solve(vb)  # [H, L, V]
    w = solve(kb * jnp.exp(gcum)[..., None])  # [H, L, K]
    v_new = u - jnp.einsum("hlk,hkv->hlv", w, S0)  # the part the old state does not predict
    qd = jnp.moveaxis(q * jnp.exp(gcum)[..., None], 1, 0)  # [H, L, K]
    attn = jnp.einsum("ihk,jhk->hij", q, k) * jnp.moveaxis(decay, 2, 0)
    o = jnp.einsum("hlk,hkv->hlv", qd, S0) + jnp.einsum("hij,hjv->hiv", attn, v_new)
    kd = jnp.moveaxis(k * jnp.exp(gcum[-1][None, :] - gcum)[..., None], 1, 0)  # [H, L, K]
    S = S0 * jnp.exp(gcum[-1])[:, None, None] + jnp.einsum("hlk,hlv->hkv", kd, v_new)
    return jnp.moveaxis(o, 0, 1), S


def chunked_delta_rule(q, k, v, g, beta, state_pool, layer, state_slots, md: BatchMetadata, *, chunk_size: int = 64):
    f32 = lambda a: a.astype(jnp.float32)
    return block_scan(_delta_block, tuple(map(f32, (q, k, v, g, beta))), state_pool, layer, state_slots, md, chunk_size)


def delta_rule_update(q, k, v, g, beta, state_pool, layer, state_slots):
    """q, k: [R, v_heads, k_dim], one token of each row R (its state in slot state_slots[r])."""
    q, k, v, g, beta = (a.astype(jnp.float32) for a in (q, k, v, g, beta))
    q = q * q.shape[-1] ** -0.5
    S = state_pool[layer, state_slots].astype(jnp.float32) * jnp.exp(g)[..., None, None]  # [R, H, K, V]
    delta = (v - jnp.einsum("rhkv,rhk->rhv", S, k)) * beta[..., None]
    S = S + jnp.einsum("rhk,rhv->rhkv", k, delta)
    return jnp.einsum("rhkv,rhk->rhv", S, q), state_pool.at[layer, state_slots].set(S.astype(state_pool.dtype))
