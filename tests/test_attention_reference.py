"""The XLA reference paged attention (attention_reference.py, the CPU path and the yardstick of every
kernel) against a naive float64 attention written here in numpy: for each token, its sequence's
K/V gathered position by position from the pages, a dense causal softmax. The cases cover the
reference's query blocks (1, 2 and 64 tokens a block), rows of one and many pages, empty rows,
padding tokens, GQA 1/3/8, a sliding window and int8 pools; and the per-layer attention kinds
(soft-capping, sink logits, a window traced per layer) with the dispatch that keeps them off the
GPU kernels."""
import numpy as np
import jax.numpy as jnp
import pytest

from kernel_batches import dequantize_pool, quantize_pool, random_batch, reference_attention
from jlight.pallas_kernels import attention_reference

PAGE_SIZE, NUM_KV_HEADS = 16, 2


def naive_attention(q, k_pool, v_pool, layer, md, scale, sliding_window=None, soft_cap=None, sinks=None):
    q, k_pool, v_pool = (np.asarray(a, np.float64) for a in (q, k_pool, v_pool))
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // NUM_KV_HEADS
    out = np.zeros_like(q)
    for t in range(int(md.query_start[-1])):
        row, pos = int(md.token_seq[t]), int(md.positions[t])
        first = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
        ctx = np.arange(first, pos + 1)
        pages = np.asarray(md.page_table)[row, ctx // PAGE_SIZE]
        k, v = k_pool[layer, pages, ctx % PAGE_SIZE], v_pool[layer, pages, ctx % PAGE_SIZE]  # [ctx, kv_heads, d]
        for h in range(num_heads):
            s = k[:, h // group] @ q[t, h] * scale
            if soft_cap is not None:
                s = soft_cap * np.tanh(s / soft_cap)
            sink = -np.inf if sinks is None else float(sinks[h])  # an extra softmax column without a value
            m = max(s.max(), sink)
            p = np.exp(s - m)
            out[t, h] = p @ v[:, h // group] / (p.sum() + np.exp(sink - m))
    return out


# (name, group, q_lens, context_lens, num_tokens incl. padding, sliding_window)
CASES = [
    ("decode_blocks_of_1", 4, [1, 1, 1, 0, 1], [1, 16, 17, 0, 300], 6, None),
    ("mixed_blocks_of_2", 3, [20, 1, 7, 1], [20, 90, 130, 33], 32, None),
    ("prefill_blocks_of_64", 1, [200], [450], 256, None),
    ("two_chunks_gqa8", 8, [100, 60], [100, 200], 160, None),
    ("sliding_window", 4, [1, 40], [500, 300], 48, 64),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("int8", [False, True], ids=["float32", "int8"])
def test_reference_matches_naive_attention(case, int8):
    name, group, q_lens, ctx_lens, num_tokens, window = case
    rng = np.random.default_rng(sum(map(ord, name)))
    num_pages = sum(-(-c // PAGE_SIZE) for c in ctx_lens) + 3
    md = random_batch(rng, q_lens, ctx_lens, page_size=PAGE_SIZE, num_pages=num_pages, num_tokens=num_tokens)
    shape = (2, num_pages, PAGE_SIZE, NUM_KV_HEADS, 32)
    k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((num_tokens, NUM_KV_HEADS * group, 32)), jnp.float32)
    if int8:
        k, v = quantize_pool(k), quantize_pool(v)
        dense_k, dense_v = dequantize_pool(k), dequantize_pool(v)
    else:
        dense_k, dense_v = k, v
    # jitted, as the engine runs it (kernel_batches.reference_attention: one compile, not one per operation)
    got = np.asarray(reference_attention(q, k, v, jnp.int32(1), md, scale=0.2, sliding_window=window))
    want = naive_attention(q, dense_k, dense_v, 1, md, 0.2, window)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)  # padding tokens: zeros in both


def test_query_block_size():
    size = attention_reference.query_block_size
    assert size(8, 8) == 1 and size(64, 64) == 1  # decode steps: a block per token
    assert size(32, 4) == 8 and size(48, 4) == 8 and size(512, 8) == 64 and size(4096, 2) == 64  # at most 64
    for tokens, rows in ((32, 4), (512, 8), (100, 3), (7, 2), (300, 256)):  # padded rows: under twice the tokens
        b = size(tokens, rows)
        assert b * rows <= tokens or b == 1
        assert (-(-tokens // b) + rows) * b <= 2 * tokens + b


def _kinds_case():
    rng = np.random.default_rng(5)
    q_lens, ctx_lens, num_tokens, group = [20, 1, 7, 1], [20, 90, 130, 33], 32, 3
    num_pages = sum(-(-c // PAGE_SIZE) for c in ctx_lens) + 3
    md = random_batch(rng, q_lens, ctx_lens, page_size=PAGE_SIZE, num_pages=num_pages, num_tokens=num_tokens)
    k, v = (jnp.asarray(rng.standard_normal((2, num_pages, PAGE_SIZE, NUM_KV_HEADS, 32)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((num_tokens, NUM_KV_HEADS * group, 32)), jnp.float32)
    sinks = jnp.asarray(rng.standard_normal(NUM_KV_HEADS * group) * 2, jnp.float32)
    return q, k, v, md, sinks


def test_soft_cap_sinks_and_traced_window_match_naive_attention():
    import jax

    q, k, v, md, sinks = _kinds_case()
    layer = jnp.int32(1)
    # a traced window (a scanned stack of mixed layers) and a static one, soft-capped, with sinks
    traced = jax.jit(lambda window: attention_reference.paged_attention(q, k, v, layer, md, scale=0.2, sliding_window=window,
                                                                        soft_cap=1.5, sinks=sinks))
    want = naive_attention(q, k, v, 1, md, 0.2, 24, soft_cap=1.5, sinks=np.asarray(sinks))
    np.testing.assert_allclose(np.asarray(traced(jnp.int32(24))), want, atol=2e-5, rtol=2e-5)
    # a traced window that covers everything is no window
    want = naive_attention(q, k, v, 1, md, 0.2, None, soft_cap=1.5, sinks=np.asarray(sinks))
    np.testing.assert_allclose(np.asarray(traced(jnp.int32(1 << 30))), want, atol=2e-5, rtol=2e-5)
    static = jax.jit(lambda q: attention_reference.paged_attention(q, k, v, layer, md, scale=0.2, sinks=sinks))
    np.testing.assert_allclose(np.asarray(static(q)), naive_attention(q, k, v, 1, md, 0.2, sinks=np.asarray(sinks)),
                               atol=2e-5, rtol=2e-5)


def test_dispatch_keeps_kinds_the_kernels_lack_on_the_reference():
    """get_kernels' GPU attention takes static windows to its kernel and everything else (soft-capping,
    sinks, traced windows) to the XLA reference, never to a kernel that would drop it."""
    import jax

    from jlight.pallas_kernels import dispatch

    q, k, v, md, sinks = _kinds_case()
    calls = []

    def kernel(*args, scale, sliding_window):
        calls.append(sliding_window)
        return "kernel"

    run = lambda **kw: dispatch.kernel_or_reference_attention(kernel, q, k, v, jnp.int32(1), md, scale=0.2, **kw)
    assert run(sliding_window=24) == "kernel" and run() == "kernel" and calls == [24, None]
    for kw in (dict(soft_cap=1.5), dict(sinks=sinks)):
        np.testing.assert_allclose(np.asarray(run(**kw)), naive_attention(q, k, v, 1, md, 0.2, **{
            n: (np.asarray(a) if n == "sinks" else a) for n, a in kw.items()}), atol=2e-5, rtol=2e-5)
    traced = jax.jit(lambda w: run(sliding_window=w))(jnp.int32(24))
    np.testing.assert_allclose(np.asarray(traced), naive_attention(q, k, v, 1, md, 0.2, 24), atol=2e-5, rtol=2e-5)
    assert calls == [24, None]  # none of these reached the kernel
    assert dispatch.get_kernels("triton").paged_attention.func is dispatch.kernel_or_reference_attention
