"""The Mosaic GPU paged attention (pallas_kernels/paged_attention_mosaic.py) on the CPU, over bf16
and int8 (QuantizedKV) page pools.

Three checks stand in for the GPU: Mosaic GPU's interpret mode runs the kernel's TMA copies,
barriers and slot logic against the XLA reference (its buffers start as NaN, so an output the
kernel forgets to write fails); its race detector checks the copy/barrier protocol; and the
kernel's real wgmma path is lowered for CUDA at the H200 benchmark shapes, which runs Mosaic GPU's
layout inference (the step that rejected a misaligned TMA in jax 0.11.2, 2026-12-01).
"""
import numpy as np
import jax
import jax.numpy as jnp
import pytest

from kernel_batches import check_attention_output, cuda_lowering_text, random_batch, random_int8_pool, reference_attention
from jlight.pallas_kernels import dispatch, paged_attention_mosaic, paged_attention_pallas, split_kv
from jlight.core.quantization import QuantizedKV, kv_scales_shape, quantize_kv_pool

PAGE_SIZE = 16
NUM_KV_HEADS = 2

# (name, group, head_dim, q_lens, context_lens, num_tokens incl. padding, sliding_window, num_items)
CASES = [
    # decode rows at page boundaries (16, 17, 64, 65), an empty row, work items over ragged rows
    ("decode_items", 4, 128, [1, 1, 1, 0, 1, 1, 1], [1, 16, 17, 0, 64, 65, 700], 7, None, 12),
    ("decode_gqa1", 1, 64, [1, 1, 0, 1], [1, 33, 0, 15], 4, None, 0),  # one program per (block, head)
    # batch-1 decode padded to 8 tokens, by the cost rule: one long row cut into many items
    ("decode_batch1_items", 4, 128, [1], [3000], 8, None, None),
    ("decode_window_items", 8, 64, [1, 1, 1], [900, 40, 300], 4, 128, 9),
    # mixed prefill chunks (earlier context in pages) + decode + empty row + padding tokens
    ("mixed_gqa8", 8, 64, [37, 1, 0, 16, 5], [37, 200, 0, 48, 70], 64, None, None),
    ("mixed_gqa3", 3, 64, [20, 1, 7], [20, 90, 130], 32, None, None),  # SmolLM2's 9/3 heads
    ("small_step_chunks", 4, 64, [5, 1, 3], [70, 16, 3], 12, None, None),  # <= 16 tokens: one token a block
    ("prefill_chunk", 4, 128, [40], [1000], 48, None, None),
    ("sliding_window", 4, 64, [1, 20], [500, 300], 24, 64, None),
]


def _inputs(rng, group, head_dim, q_lens, ctx_lens, num_tokens, num_layers=2, page_size=PAGE_SIZE):
    num_pages = sum(-(-c // page_size) for c in ctx_lens) + 4
    md = random_batch(rng, q_lens, ctx_lens, page_size=page_size, num_pages=num_pages, num_tokens=num_tokens)
    shape = (num_layers, num_pages, page_size, NUM_KV_HEADS, head_dim)
    k, v = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((num_tokens, NUM_KV_HEADS * group, head_dim)), jnp.bfloat16)
    return q, k, v, md


# With -m extended only (each repeats paths the default cases run): batch-1 decode with the cost rule's items (264
# programs to interpret; the same rule, grid and chunked combine run over fp8 pools in test_kv_cache_fp8's
# decode_batch1_p64, and bf16 items in decode_items), group-8 prefill blocks (the same batch runs with sinks and
# soft-capping in test_soft_cap_and_sinks_match_reference, and int8's prefill_gqa8_p32), a window over work items
# (decode_items_all_kinds: a window of 128 over 12 items).
EXTENDED_CASES = ("decode_batch1_items", "mixed_gqa8", "decode_window_items")


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.extended) if c[0] in EXTENDED_CASES else c
                                  for c in CASES], ids=[c[0] for c in CASES])
def test_matches_reference(case):
    name, group, head_dim, q_lens, ctx_lens, num_tokens, window, num_items = case
    q, k, v, md = _inputs(np.random.default_rng(sum(map(ord, name))), group, head_dim, q_lens, ctx_lens, num_tokens)
    kw = dict(scale=head_dim ** -0.5, sliding_window=window)
    f32 = lambda a: a.astype(jnp.float32)
    want = reference_attention(f32(q), f32(k), f32(v), jnp.int32(1), md, **kw)  # the reference, jitted (kernel_batches)
    got = paged_attention_mosaic.paged_attention(q, k, v, jnp.int32(1), md, num_items=num_items, **kw)
    check_attention_output(got, want, md, jnp.bfloat16)


# (name, group, head_dim, q_lens, context_lens, num_tokens, sliding_window, soft_cap, num_items)
KIND_CASES = [
    # decode over work items (the long rows cut into several: the sink joins a block's first item only),
    # a window, soft-capping, sinks; an empty row and a row at a page boundary
    ("decode_items_all_kinds", 4, 128, [1, 1, 1, 0, 1], [1, 17, 300, 0, 700], 5, 128, 3.0, 12),
    # prefill blocks (group 8: 8 tokens a block) with sinks and soft-capping over earlier context, padding tokens
    ("mixed_sinks_softcap_gqa8", 8, 64, [37, 1, 0, 16, 5], [37, 200, 0, 48, 70], 64, None, 2.0, None),
]


@pytest.mark.parametrize("case", KIND_CASES, ids=[c[0] for c in KIND_CASES])
def test_soft_cap_and_sinks_match_reference(case):
    """Logit soft-capping (Gemma 2) and sink logits (gpt-oss), one learned logit per query head in the
    softmax's denominator, against the reference."""
    name, group, head_dim, q_lens, ctx_lens, num_tokens, window, cap, num_items = case
    rng = np.random.default_rng(sum(map(ord, name)))
    q, k, v, md = _inputs(rng, group, head_dim, q_lens, ctx_lens, num_tokens)
    sinks = jnp.asarray(rng.standard_normal(NUM_KV_HEADS * group) * 2, jnp.float32)
    kw = dict(scale=head_dim ** -0.5, sliding_window=window, soft_cap=cap, sinks=sinks)
    f32 = lambda a: a.astype(jnp.float32)
    want = reference_attention(f32(q), f32(k), f32(v), jnp.int32(1), md, **kw)
    got = paged_attention_mosaic.paged_attention(q, k, v, jnp.int32(1), md, num_items=num_items, **kw)
    check_attention_output(got, want, md, jnp.bfloat16)


# Pages of 32 and 64 with -m extended: the int8 cases below walk the same tables (2 and 1 pages a step) over
# pages of 32 (decode items and prefill) and 64 (a mixed step).
@pytest.mark.parametrize("page_size", [8] + [pytest.param(p, marks=pytest.mark.extended) for p in (32, 64)])
def test_other_page_sizes_match_reference(page_size):
    """Pages of 8, 32 and 64 tokens (a step's 64 positions are 8, 2 or 1 pages): decode rows at and
    across page boundaries, and a prefill chunk over earlier context."""
    q_lens, ctx_lens = [1, 1, 1, 0, 30], [1, page_size, page_size + 1, 0, 200]
    q, k, v, md = _inputs(np.random.default_rng(page_size), 4, 64, q_lens, ctx_lens, 40, page_size=page_size)
    f32 = lambda a: a.astype(jnp.float32)
    want = reference_attention(f32(q), f32(k), f32(v), jnp.int32(1), md, scale=0.125)
    got = paged_attention_mosaic.paged_attention(q, k, v, jnp.int32(1), md, scale=0.125)
    check_attention_output(got, want, md, jnp.bfloat16)


# int8 pools: (name, group, head_dim, q_lens, context_lens, num_tokens, num_items, page_size)
INT8_CASES = [
    ("decode_items_p32", 4, 128, [1, 1, 1, 0, 1], [1, 32, 33, 0, 700], 5, 9, 32),
    ("mixed_gqa3_p64", 3, 64, [20, 1, 7], [20, 90, 130], 32, None, 64),
    ("prefill_gqa8_p32", 8, 64, [40, 1], [300, 65], 48, None, 32),
]


def _int8_pools(rng, shape):
    return [random_int8_pool(rng, shape)[0] for _ in range(2)]


@pytest.mark.parametrize("case", INT8_CASES, ids=[c[0] for c in INT8_CASES])
def test_int8_pools_match_reference(case):
    """int8 pages against the XLA reference over the same int8 pools (which dequantizes in float32)."""
    name, group, head_dim, q_lens, ctx_lens, num_tokens, num_items, page_size = case
    rng = np.random.default_rng(sum(map(ord, name)))
    q, k, _, md = _inputs(rng, group, head_dim, q_lens, ctx_lens, num_tokens, page_size=page_size)
    kq, vq = _int8_pools(rng, k.shape)
    assert paged_attention_mosaic.supports(q, kq)
    kw = dict(scale=head_dim ** -0.5)
    want = reference_attention(q.astype(jnp.float32), kq, vq, jnp.int32(1), md, **kw)
    got = paged_attention_mosaic.paged_attention(q, kq, vq, jnp.int32(1), md, num_items=num_items, **kw)
    check_attention_output(got, want, md, jnp.bfloat16)


def test_no_races_in_the_copy_protocol(monkeypatch):
    """The interpreter's happens-before race detector over the TMA slots, with and without split-K,
    on bf16 pools and on int8 pools (values and scales share a slot's barrier; the tiles converted
    for the wgmmas are rewritten every step)."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call, params

    monkeypatch.setattr(paged_attention_mosaic, "interpret_params", lambda: params.InterpretGPUParams(detect_races=True))
    rng = np.random.default_rng(3)
    q, k, v, md = _inputs(rng, 4, 64, [1, 1], [300, 129], 2, num_layers=1)
    q8, k8, _, md8 = _inputs(rng, 4, 64, [1, 1], [300, 129], 2, num_layers=1, page_size=32)
    pools = {"bf16": (q, k, v, md), "int8": (q8, *_int8_pools(rng, k8.shape), md8)}
    for kind, (q_, k_, v_, md_) in pools.items():
        for items in (0, 5):
            # interpret=True: the detector lives in the interpreter, which a GPU would otherwise skip
            jax.block_until_ready(paged_attention_mosaic.paged_attention(q_, k_, v_, jnp.int32(0), md_, scale=0.125,
                                                                         num_items=items, interpret=True))
            assert not interpret_pallas_call.get_races().races_found, f"races with {kind} pools, num_items={items}"


S = jax.ShapeDtypeStruct


@pytest.mark.parametrize("batch,cfg,page_size,kv", [
    ("decode", {}, PAGE_SIZE, "bf16"), ("decode", dict(num_items=0), PAGE_SIZE, "bf16"),
    ("decode", dict(kv_per_step=128, num_stages=2), PAGE_SIZE, "bf16"), ("prefill", {}, PAGE_SIZE, "bf16"),
    ("decode", {}, 8, "bf16"), ("prefill", {}, 64, "bf16"),
    ("decode", {}, 32, "int8"), ("decode", dict(num_items=0), 64, "int8"), ("prefill", {}, 32, "int8"),
    ("decode", {}, 32, "int8-d64"),  # int8 rows of 64 bytes: a 64-byte swizzle
    ("decode", {}, PAGE_SIZE, "fp8"), ("decode", dict(num_items=0, kv_per_step=128), 64, "fp8"),
    # the attention kinds: soft-capping and sinks (gpt-oss's 128-token window; Gemma 2's cap of 50)
    ("decode", dict(sliding_window=128, sinks=True), PAGE_SIZE, "bf16"),
    ("decode", dict(num_items=0, soft_cap=50.0, sinks=True), PAGE_SIZE, "bf16"),
    ("prefill", dict(sliding_window=4096, soft_cap=50.0, sinks=True), 32, "fp8"),
])
def test_cuda_lowering_at_h200_shapes(batch, cfg, page_size, kv):
    """The wgmma path (not the interpreter's dots) lowers for CUDA, layout inference included."""
    q_lens, ctx_lens, num_tokens = ([1] * 8, [4096] * 8, 8) if batch == "decode" else ([256, 1], [3000, 700], 264)
    if kv in ("bf16", "fp8"):
        pool = lambda shape: S(shape, jnp.bfloat16 if kv == "bf16" else paged_attention_mosaic.FP8_DTYPE)
    else:
        pool = lambda shape: QuantizedKV(S(shape, jnp.int8), S(kv_scales_shape(shape), jnp.float32))
    cfg = dict(cfg, sinks=jnp.zeros(32, jnp.float32) if cfg.get("sinks") else None)
    text = cuda_lowering_text(paged_attention_mosaic.paged_attention, q_lens, ctx_lens, num_tokens, page_size=page_size,
                              num_heads=32, head_dim=64 if kv.endswith("d64") else 128, pool=pool, **cfg)
    assert "mosaic_gpu" in text


def test_supports_and_fallback(monkeypatch):
    q = jnp.zeros((2, 8, 64), jnp.bfloat16)
    pool = jnp.zeros((1, 4, PAGE_SIZE, 2, 64), jnp.bfloat16)
    assert paged_attention_mosaic.supports(q, pool)
    assert not paged_attention_mosaic.supports(q.astype(jnp.float32), pool.astype(jnp.float32))  # wgmma: 16-bit only
    assert not paged_attention_mosaic.supports(q, quantize_kv_pool(pool))  # int8 pages of 16: the Triton kernel
    int8_p32 = quantize_kv_pool(jnp.zeros((1, 4, 32, 2, 64), jnp.float32))
    assert paged_attention_mosaic.supports(q, int8_p32)  # int8 pages of 32 (and 64): this kernel
    assert not paged_attention_mosaic.supports(jnp.zeros((2, 8, 32), jnp.bfloat16), pool[..., :32])  # head_dim 32
    assert paged_attention_mosaic.supports(q, jnp.zeros((1, 4, 32, 2, 64), jnp.bfloat16))  # pages of 32: run on the H200
    assert not paged_attention_mosaic.supports(q, jnp.zeros((1, 4, 128, 2, 64), jnp.bfloat16))  # pages of 128: not run on a GPU
    with pytest.raises(ValueError, match="Triton kernel"):
        paged_attention_mosaic.paged_attention(q.astype(jnp.float32), pool.astype(jnp.float32), pool.astype(jnp.float32),
                                               jnp.int32(0), random_batch(np.random.default_rng(0), [1, 1], [3, 5],
                                                                          page_size=PAGE_SIZE, num_pages=4), scale=0.1)


def test_dispatch_names_the_backend():
    assert dispatch.get_kernels("mosaic").paged_attention.args[0] is dispatch.mosaic_or_triton_attention
    assert dispatch.get_kernels("triton").paged_attention.args[0] is paged_attention_pallas.paged_attention
    # under a mesh "pallas" keeps the Triton kernel (the one run under tp/ep on GPUs); "mosaic" is honoured
    assert dispatch.get_kernels("pallas", sharded=True).paged_attention.args[0] is paged_attention_pallas.paged_attention
    assert dispatch.get_kernels("mosaic", sharded=True).paged_attention.args[0] is dispatch.mosaic_or_triton_attention
    with pytest.raises(ValueError, match="attention_impl='cuda'"):
        dispatch.get_kernels("cuda")


def test_dispatch_runs_soft_cap_and_sinks_on_the_mosaic_kernel(monkeypatch):
    """get_kernels("mosaic") gives a sink, soft-capped layer to the Mosaic GPU kernel (run here, interpreted);
    the same layer in float32, which the Triton kernel would run, goes to the XLA reference instead."""
    q, k, v, md = _inputs(np.random.default_rng(4), 4, 64, [1, 1], [40, 17], 2)
    kw = dict(scale=0.125, sliding_window=None, soft_cap=2.0, sinks=jnp.asarray(np.linspace(-2, 2, 8), jnp.float32))
    f32 = lambda a: a.astype(jnp.float32)
    with jax.default_matmul_precision("highest"):  # a GPU's float32 dots default to TF32
        want = reference_attention(f32(q), f32(k), f32(v), jnp.int32(1), md, **kw)
    kernels = dispatch.get_kernels("mosaic")
    attention = jax.jit(lambda q, k, v: kernels.paged_attention(q, k, v, jnp.int32(1), md, **kw))  # one compile, as in a step
    triton = lambda *a, **k: pytest.fail("the Triton kernel has no soft-capping or sinks")
    monkeypatch.setattr(paged_attention_pallas, "paged_attention", triton)
    monkeypatch.setattr(split_kv, "use_work_items", lambda *a: False)  # one program per (block, KV head): quick to interpret
    check_attention_output(attention(q, k, v), want, md, jnp.bfloat16)
    with jax.default_matmul_precision("highest"):
        check_attention_output(attention(f32(q), f32(k), f32(v)), want, md, jnp.float32)


def test_mosaic_or_triton_routes_float32_to_triton(monkeypatch):
    calls = []
    monkeypatch.setattr(paged_attention_pallas, "paged_attention", lambda *a, **k: calls.append("triton"))
    q, k, v, md = _inputs(np.random.default_rng(1), 4, 64, [1], [5], 1)
    dispatch.mosaic_or_triton_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                                        jnp.int32(0), md, scale=0.125)
    assert calls == ["triton"]
