"""The recurrent layers' XLA references (pallas_kernels/mamba_reference.py, delta_rule_reference.py,
ragged_scan.causal_conv1d) against a naive per-token recurrence written here in numpy, on ragged
batches whose rows start from saved states (and one from position 0), chunks shorter and longer
than the chunk size. Each reads and writes one layer of a pool of three (the layer given as a traced int32, as an
unrolled step traced once passes it): the other layers come back untouched."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jlight.core.batch_metadata import BatchMetadata
from jlight.pallas_kernels import delta_rule_reference, mamba_reference, ragged_scan

# (first position, tokens this step) per row; position 0 = a fresh sequence.
ROWS = [(5, 1), (0, 11), (9, 3), (30, 1), (2, 7)]
SLOTS = [3, 1, 6, 2, 5]
NUM_SLOTS, NUM_TOKENS, NUM_ROWS = 8, 32, 6  # padded: an unused row, padding tokens
LAYER = 1  # of NUM_LAYERS in every pool
NUM_LAYERS = 3


def layered(pool):
    """[NUM_LAYERS, *pool.shape]: `pool` as layer LAYER, random others."""
    others = np.random.default_rng(99).normal(size=(NUM_LAYERS,) + pool.shape).astype(pool.dtype)
    others[LAYER] = pool
    return others


def own_layer(new_pools, pools):
    """new_pools[LAYER] after checking that every other layer is untouched."""
    for layer in set(range(NUM_LAYERS)) - {LAYER}:
        np.testing.assert_array_equal(new_pools[layer], pools[layer])
    return np.asarray(new_pools[LAYER])


def metadata():
    positions, token_seq, query_start = np.zeros(NUM_TOKENS, np.int32), np.zeros(NUM_TOKENS, np.int32), [0]
    t = 0
    for b, (start, n) in enumerate(ROWS):
        positions[t:t + n] = np.arange(start, start + n)
        token_seq[t:t + n] = b
        t += n
        query_start.append(t)
    query_start += [t] * (NUM_ROWS - len(ROWS))
    slots = np.array(SLOTS + [0] * (NUM_ROWS - len(ROWS)), np.int32)
    z = np.zeros(NUM_ROWS, np.int32)
    md = BatchMetadata(jnp.asarray(positions), jnp.zeros(NUM_TOKENS, jnp.int32), jnp.asarray(token_seq),
                       jnp.zeros((NUM_ROWS, 1), jnp.int32), jnp.asarray(z), jnp.asarray(np.array(query_start, np.int32)),
                       jnp.asarray(z))
    return md, jnp.asarray(slots)


def row_tokens():
    t = 0
    for b, (start, n) in enumerate(ROWS):
        yield b, start, range(t, t + n)
        t += n


def test_causal_conv1d_continues_each_rows_state():
    rng = np.random.default_rng(0)
    K, C = 4, 5
    x = rng.normal(size=(NUM_TOKENS, C)).astype(np.float32)
    w = rng.normal(size=(K, C)).astype(np.float32)
    bias = rng.normal(size=(C,)).astype(np.float32)
    pool = rng.normal(size=(NUM_SLOTS, K - 1, C)).astype(np.float32)
    md, slots = metadata()
    pools = layered(pool)
    y, new_pools = jax.jit(ragged_scan.causal_conv1d)(x, w, bias, pools, jnp.int32(LAYER), slots, md)
    new_pool = own_layer(new_pools, pools)
    for b, start, toks in row_tokens():
        hist = list(np.zeros((K - 1, C), np.float32) if start == 0 else pool[SLOTS[b]])
        for t in toks:
            hist.append(x[t])
            want = sum(hist[-K + i] * w[i] for i in range(K)) + bias
            np.testing.assert_allclose(y[t], want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(new_pool[SLOTS[b]], np.stack(hist[-(K - 1):]), rtol=1e-6)
    for s in set(range(1, NUM_SLOTS)) - set(SLOTS):  # other sequences' slots are untouched
        np.testing.assert_array_equal(new_pool[s], pool[s])


def ssd_inputs(rng, H=4, P=3, G=2, N=5):
    x = rng.normal(size=(NUM_TOKENS, H, P)).astype(np.float32)
    dt = np.log1p(np.exp(rng.normal(size=(NUM_TOKENS, H)))).astype(np.float32)  # softplus
    A = -np.exp(rng.normal(size=(H,))).astype(np.float32)
    B = rng.normal(size=(NUM_TOKENS, G, N)).astype(np.float32)
    C = rng.normal(size=(NUM_TOKENS, G, N)).astype(np.float32)
    pool = rng.normal(size=(NUM_SLOTS, H, P, N)).astype(np.float32)
    return x, dt, A, B, C, pool


def naive_ssd(x, dt, A, B, C, h):
    """One token: h [H, P, N] -> (y [H, P], h)."""
    H, G = x.shape[0], B.shape[0]
    Bh, Ch = np.repeat(B, H // G, axis=0), np.repeat(C, H // G, axis=0)
    h = h * np.exp(dt * A)[:, None, None] + (x * dt[:, None])[:, :, None] * Bh[:, None, :]
    return np.einsum("hpn,hn->hp", h, Ch), h


@pytest.mark.parametrize("chunk_size", [4, 64])
def test_ssd_scan_matches_the_recurrence(chunk_size):
    x, dt, A, B, C, pool = ssd_inputs(np.random.default_rng(1))
    md, slots = metadata()
    pools = layered(pool)
    y, new_pools = jax.jit(mamba_reference.ssd_scan, static_argnames="chunk_size")(x, dt, A, B, C, pools, jnp.int32(LAYER),
                                                                                   slots, md, chunk_size=chunk_size)
    new_pool = own_layer(new_pools, pools)
    for b, start, toks in row_tokens():
        h = np.zeros_like(pool[0]) if start == 0 else pool[SLOTS[b]]
        for t in toks:
            want, h = naive_ssd(x[t], dt[t], A, B[t], C[t], h)
            np.testing.assert_allclose(y[t], want, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(new_pool[SLOTS[b]], h, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(y[sum(n for _, n in ROWS):], 0)  # padding tokens
    for s in set(range(1, NUM_SLOTS)) - set(SLOTS):
        np.testing.assert_array_equal(new_pool[s], pool[s])


def test_ssm_update_is_one_step_of_the_recurrence():
    x, dt, A, B, C, pool = ssd_inputs(np.random.default_rng(2))
    R = 3
    slots = np.array([4, 1, 7], np.int32)
    pools = layered(pool)
    y, new_pools = jax.jit(mamba_reference.ssm_update)(x[:R], dt[:R], A, B[:R], C[:R], pools, jnp.int32(LAYER), slots)
    new_pool = own_layer(new_pools, pools)
    for r in range(R):
        want, h = naive_ssd(x[r], dt[r], A, B[r], C[r], pool[slots[r]])
        np.testing.assert_allclose(y[r], want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(new_pool[slots[r]], h, rtol=1e-5, atol=1e-5)


def delta_inputs(rng, H=3, K=4, V=5):
    unit = lambda a: a / np.linalg.norm(a, axis=-1, keepdims=True)
    q = unit(rng.normal(size=(NUM_TOKENS, H, K))).astype(np.float32)
    k = unit(rng.normal(size=(NUM_TOKENS, H, K))).astype(np.float32)
    v = rng.normal(size=(NUM_TOKENS, H, V)).astype(np.float32)
    g = -np.log1p(np.exp(rng.normal(size=(NUM_TOKENS, H)))).astype(np.float32) * 0.3
    beta = (1 / (1 + np.exp(-rng.normal(size=(NUM_TOKENS, H))))).astype(np.float32)
    pool = rng.normal(size=(NUM_SLOTS, H, K, V)).astype(np.float32) * 0.5
    return q, k, v, g, beta, pool


def naive_delta(q, k, v, g, beta, S):
    """One token: S [H, K, V] -> (o [H, V], S)."""
    q = q / np.sqrt(q.shape[-1])
    S = S * np.exp(g)[:, None, None]
    delta = (v - np.einsum("hkv,hk->hv", S, k)) * beta[:, None]
    S = S + k[:, :, None] * delta[:, None, :]
    return np.einsum("hkv,hk->hv", S, q), S


@pytest.mark.parametrize("chunk_size", [4, 64])
def test_chunked_delta_rule_matches_the_recurrence(chunk_size):
    q, k, v, g, beta, pool = delta_inputs(np.random.default_rng(3))
    md, slots = metadata()
    fn = jax.jit(delta_rule_reference.chunked_delta_rule, static_argnames="chunk_size")
    pools = layered(pool)
    o, new_pools = fn(q, k, v, g, beta, pools, jnp.int32(LAYER), slots, md, chunk_size=chunk_size)
    new_pool = own_layer(new_pools, pools)
    for b, start, toks in row_tokens():
        S = np.zeros_like(pool[0]) if start == 0 else pool[SLOTS[b]]
        for t in toks:
            want, S = naive_delta(q[t], k[t], v[t], g[t], beta[t], S)
            np.testing.assert_allclose(o[t], want, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(new_pool[SLOTS[b]], S, rtol=1e-4, atol=1e-4)
    for s in set(range(1, NUM_SLOTS)) - set(SLOTS):
        np.testing.assert_array_equal(new_pool[s], pool[s])


def test_delta_rule_update_is_one_step_of_the_recurrence():
    q, k, v, g, beta, pool = delta_inputs(np.random.default_rng(4))
    slots = np.array([2, 5], np.int32)
    pools = layered(pool)
    o, new_pools = jax.jit(delta_rule_reference.delta_rule_update)(q[:2], k[:2], v[:2], g[:2], beta[:2], pools,
                                                                   jnp.int32(LAYER), slots)
    new_pool = own_layer(new_pools, pools)
    for r in range(2):
        want, S = naive_delta(q[r], k[r], v[r], g[r], beta[r], pool[slots[r]])
        np.testing.assert_allclose(o[r], want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(new_pool[slots[r]], S, rtol=1e-5, atol=1e-5)
