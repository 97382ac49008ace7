"""Random ragged batches and paged caches for the kernel tests and benchmarks, and random GGUF K-quant blocks."""
import numpy as np
import jax
import jax.numpy as jnp

from jlight.pallas_kernels import attention_reference
from jlight.core.batch_metadata import BatchMetadata
from jlight.core.quantization import dequantize_kv_pool, quantize_kv_pool, to_fp8_kv

# The XLA reference attention compiled as one program, as the engine runs it (inside its jitted step).
# Called outside jit, JAX dispatches it operation by operation and compiles each of its ~30 operations
# on its own for every new shape: 2-4 s a call on the 2-core CI host, against one compile here.
# Its matmuls in true float32 on a GPU too, where XLA's default is TF32 (the kernels take float32 at
# full precision, as a float32 model's step does: model_runner.matmul_precision).


def _reference_attention(*args, **kwargs):
    with jax.default_matmul_precision("highest"):
        return attention_reference.paged_attention(*args, **kwargs)


reference_attention = jax.jit(_reference_attention, static_argnames=("scale", "sliding_window", "soft_cap"))
# The same for the int8 pools' quantization (elementwise, and a max: the same values either way).
quantize_pool = jax.jit(quantize_kv_pool)
dequantize_pool = jax.jit(dequantize_kv_pool)


def random_batch(rng: np.random.Generator, q_lens, context_lens, *, page_size: int, num_pages: int,
                 max_pages: int | None = None, num_tokens: int | None = None) -> BatchMetadata:
    """Rows b with q_lens[b] new tokens ending at context_lens[b]; pages drawn at random.

    Page 0 is scratch: unused page-table entries and padding tokens point at it.
    """
    q_lens, context_lens = list(q_lens), list(context_lens)
    need = [-(-c // page_size) for c in context_lens]
    max_pages = max_pages or max(1, max(need))
    if sum(need) > num_pages - 1:
        raise ValueError(f"{sum(need)} pages needed but the pool has {num_pages - 1} usable")
    pool = rng.permutation(np.arange(1, num_pages))
    page_table = np.zeros((len(q_lens), max_pages), np.int32)  # [B, max_pages]
    used = 0
    for b, n in enumerate(need):
        page_table[b, :n] = pool[used:used + n]
        used += n
    real = sum(q_lens)
    num_tokens = num_tokens or real
    positions = np.zeros(num_tokens, np.int32)  # [T]
    token_seq = np.zeros(num_tokens, np.int32)
    slot_mapping = np.zeros(num_tokens, np.int32)  # padding tokens write to scratch page 0
    query_start = np.zeros(len(q_lens) + 1, np.int32)  # [B + 1]
    t = 0
    for b, (n, c) in enumerate(zip(q_lens, context_lens)):
        pos = np.arange(c - n, c)
        positions[t:t + n] = pos
        token_seq[t:t + n] = b
        slot_mapping[t:t + n] = page_table[b, pos // page_size] * page_size + pos % page_size
        t += n
        query_start[b + 1] = t
    logits_indices = np.maximum(query_start[1:] - 1, 0)
    return BatchMetadata(*(jnp.asarray(a) for a in (positions, slot_mapping, token_seq, page_table,
                                                     np.asarray(context_lens, np.int32), query_start, logits_indices)))


def check_attention_output(got, want, md: BatchMetadata, dtype) -> None:
    """A Pallas attention output against its reference: every real token's output written and
    close (tolerance by input dtype), every padding token's output zero."""
    got, want = np.asarray(got, np.float32), np.asarray(want)
    real = int(md.query_start[-1])
    assert np.all(np.isfinite(got)), "some output elements were never written"
    assert np.all(got[real:] == 0), "padding tokens must get zeros"
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(got[:real], want[:real], atol=tol, rtol=tol)


def random_int8_pool(rng: np.random.Generator, shape):
    """An int8 K or V pool (QuantizedKV) of random vectors whose magnitudes vary by token and head, so
    the scales matter, and the float32 pool it was quantized from."""
    x = jnp.asarray(rng.standard_normal(shape) * rng.uniform(0.2, 3.0, size=tuple(shape[:-1]) + (1,)), jnp.float32)
    return quantize_pool(x), x


def cuda_lowering_text(kernel, q_lens, context_lens, num_tokens: int, *, page_size: int, num_heads: int,
                       head_dim: int, pool, **kw) -> str:
    """kernel(q, k, v, layer 1, md, scale=0.088, interpret=False, **kw) lowered for CUDA on a host without a GPU
    (the wgmma path, layout inference included), as text: q a bf16 [num_tokens, num_heads, head_dim] shape,
    md a random batch of those rows (random_batch), and pool(shape) the K and V pools' shape-only stand-ins for
    [2 layers, the pages the contexts need + 1, page_size, 8 KV heads, head_dim]."""
    num_pages = sum(-(-c // page_size) for c in context_lens) + 1
    md = random_batch(np.random.default_rng(0), q_lens, context_lens, page_size=page_size, num_pages=num_pages,
                      num_tokens=num_tokens)
    kv = pool((2, num_pages, page_size, 8, head_dim))
    fn = lambda q, k, v, md: kernel(q, k, v, jnp.int32(1), md, scale=0.088, interpret=False, **kw)
    q = jax.ShapeDtypeStruct((num_tokens, num_heads, head_dim), jnp.bfloat16)
    return jax.jit(fn).trace(q, kv, kv, md).lower(lowering_platforms=("cuda",)).as_text()


def random_attention_inputs(rng: np.random.Generator, group: int, head_dim: int, q_lens, context_lens, num_tokens: int,
                            page_size: int, kv_heads: int = 2, num_layers: int = 2, pools: str = "bf16"):
    """(q [num_tokens, kv_heads * group, head_dim] bf16, K and V pools, md) of a random batch (random_batch) with
    4 spare pages; pools "bf16", or "fp8" with magnitudes that vary by token, so some values sit in e4m3's
    subnormal range."""
    num_pages = sum(-(-c // page_size) for c in context_lens) + 4
    md = random_batch(rng, q_lens, context_lens, page_size=page_size, num_pages=num_pages, num_tokens=num_tokens)
    shape = (num_layers, num_pages, page_size, kv_heads, head_dim)
    if pools == "fp8":
        k, v = (to_fp8_kv(jnp.asarray(rng.standard_normal(shape) * rng.uniform(0.005, 4, shape[:-1] + (1,)), jnp.float32))
                for _ in range(2))
    else:
        k, v = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((num_tokens, kv_heads * group, head_dim)), jnp.bfloat16)
    return q, k, v, md


# A GGUF K-quant super-block (256 values): its bytes and the offsets of its float16 scales (d; Q4_K / Q5_K: dmin).
K_QUANT_LAYOUT = {"Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,))}


def random_k_quant_blocks(rng: np.random.Generator, type_name: str, rows: int, k: int, scale: float | None = None):
    """A [rows, k] GGUF K-quant tensor of random bytes ([rows, row bytes], k a multiple of 256) with finite float16
    scales: any finite float16 (both signs, subnormals, up to 65504) by default, else `scale` times standard
    normal ones (weights of a size a model runs on)."""
    size, offsets = K_QUANT_LAYOUT[type_name]
    data = rng.integers(0, 256, (rows, k // 256, size), dtype=np.uint8)
    for at in offsets:
        if scale is None:
            bits = rng.integers(0, 1 << 16, (rows, k // 256), dtype=np.uint16)
            bits[(bits >> 10) & 0x1F == 0x1F] &= np.uint16(0xBFFF)  # infinities and NaNs -> finite (exponent 15)
            halves = bits.view(np.float16)
        else:
            halves = (rng.standard_normal((rows, k // 256)) * scale).astype(np.float16)
        data[..., at:at + 2] = halves[..., None].view(np.uint8)
    return data.reshape(rows, -1)
