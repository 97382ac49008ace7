"""Paged attention in Pallas: one kernel for decode rows, prefill chunks and mixed batches.

The ragged batch is cut into query blocks: each block holds up to `block_q` consecutive
tokens of ONE row, so a program sees one page table. A program takes one query block and
one KV head with all the query heads of that KV head (GQA): its block_q * group query
rows share every K/V page it loads, so each page is read once per block.

Decode buckets (T <= B) use block_q = 1 and, when that leaves the GPU under-filled, split
each row's pages over several programs (split-K); the partial softmax states are merged
with an online-softmax combine in XLA. Prefill uses block_q * group ~= 64 query rows.

int8 KV cache (QuantizedKV pools): the kernel loads the int8 pages and their per-(token, head)
scales, so it reads about half the bytes of a bf16 cache. It never dequantizes a tile: the
int8 values go into the dots as they are (exact in bf16), K's scales multiply the score
columns and V's scales the probabilities, (p * s_v) . V_int8 = p . (s_v * V_int8).

Pallas' Triton backend. The engine runs paged_attention_mosaic.py (Mosaic GPU)
wherever it applies, and this kernel for float32 and for int8 KV pools with pages of 8 or 16 tokens
(pallas_mode.py says why).
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from jlight.pallas_kernels import attention_reference, pallas_mode
from jlight.core.batch_metadata import BatchMetadata, query_blocks
from jlight.core.quantization import QuantizedKV
from jlight.pallas_kernels.tiling import NUM_SMS, next_pow2

_MASKED = -1e30
# Query rows (tokens x heads of one KV head) per prefill program, for rows of up to _Q_ROW_BYTES; wider rows
# (float32 at head_dim 512) take proportionally fewer, so the query tile stays the bytes float32 head_dim 256 runs
# with: 64 float32 rows of 512 with their 32-position K/V tiles asked for 320 KB of an H100's 227 KB.
_PREFILL_ROWS = 64
_Q_ROW_BYTES = 1024
# K/V positions processed per inner step (pages_per_step * page_size) for positions of up to _KV_ROW_BYTES (a
# 16-bit head_dim 256); wider positions take proportionally fewer, so a step's K and V tiles stay the bytes that
# 16-bit head_dim 256 runs with on the GPU (64 x 512 bytes each). float32 at head_dim 512 with 32 positions a
# step asked for 256 KB of an H100's 227 KB.
_KV_PER_STEP = 64
_KV_ROW_BYTES = 512

# XLA's scatter already writes the donated cache in place and moves only the T new K/V
# vectors; a kernel could not move fewer bytes, so the reference is used as is.
write_kv = attention_reference.write_kv


def _kernel(row_ref, start_ref, end_ref, page_table_ref, pos_ref, q_ref, k_ref, v_ref, *refs,
            group, block_q, block_rows, page_size, pages_per_step, pages_per_split, scale, sliding_window, quantized):
    if quantized:  # int8 pages: their scales come next, [pages, page_size] of this KV head each
        k_scale_ref, v_scale_ref, *out_refs = refs
    else:
        out_refs = refs
    block, split = pl.program_id(0), pl.program_id(2)
    row, start, end = row_ref[block], start_ref[block], end_ref[block]
    r = jnp.arange(block_rows)
    valid = (r < block_q * group) & (start + r // group < end)  # [block_rows]
    rows = pl.ds(start * group, block_rows)
    q = pltr.load(q_ref.at[rows, :], mask=valid[:, None], other=0)  # [block_rows, head_dim]
    pos = pltr.load(pos_ref.at[rows], mask=valid, other=-1)  # [block_rows]
    head_dim = q.shape[-1]
    kv_per_step = pages_per_step * page_size
    full_f32 = q.dtype == jnp.float32

    # Pages this program reads: its split's share, cut at the block's last position.
    num_pages = (jnp.max(pos) + page_size) // page_size
    first_page = split * pages_per_split
    last_page = jnp.minimum(first_page + pages_per_split, num_pages)
    if sliding_window is not None:
        lowest = jnp.min(jnp.where(valid, pos, jnp.iinfo(jnp.int32).max))
        first_page = jnp.maximum(first_page, jnp.maximum(lowest - sliding_window + 1, 0) // page_size)
    first_step = first_page // pages_per_step
    last_step = (last_page + pages_per_step - 1) // pages_per_step

    def body(step, carry):
        m, l, acc = carry
        pages = page_table_ref[row, pl.ds(step * pages_per_step, pages_per_step)]  # [pages_per_step]
        k = k_ref[pages].reshape(kv_per_step, head_dim)  # [kv_per_step, head_dim]
        v = v_ref[pages].reshape(kv_per_step, head_dim)
        if k.dtype != q.dtype:  # int8 or fp8 -> q's dtype is exact; int8's scales are applied to s and p below
            k, v = k.astype(q.dtype), v.astype(q.dtype)
        # float32 operands: true float32 products (Triton's default is TF32), as the XLA reference and a
        # float32 model's other matmuls (model_runner.matmul_precision) have them
        s = pltr.dot(q, k, trans_b=True, allow_tf32=not full_f32).astype(jnp.float32) * scale  # [block_rows, kv_per_step]
        if quantized:
            s = s * k_scale_ref[pages].reshape(1, kv_per_step)
        kv_pos = step * kv_per_step + jnp.arange(kv_per_step)
        mask = kv_pos[None, :] <= pos[:, None]
        if sliding_window is not None:
            mask &= kv_pos[None, :] > pos[:, None] - sliding_window
        s = jnp.where(mask, s, _MASKED)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        correction = jnp.exp(m - m_new)
        l = l * correction + jnp.sum(p, axis=1)
        if quantized:
            p = p * v_scale_ref[pages].reshape(1, kv_per_step)
        acc = acc * correction[:, None] + pltr.dot(p.astype(v.dtype), v, allow_tf32=not full_f32).astype(jnp.float32)
        return m_new, l, acc

    init = (
        jnp.full((block_rows,), _MASKED, jnp.float32),
        jnp.zeros((block_rows,), jnp.float32),
        jnp.zeros((block_rows, head_dim), jnp.float32),
    )
    m, l, acc = jax.lax.fori_loop(first_step, last_step, body, init)
    if len(out_refs) == 1:  # one split: normalise here
        (o_ref,) = out_refs
        out = acc / jnp.maximum(l, 1e-30)[:, None]
        pltr.store(o_ref.at[rows, :], out.astype(o_ref.dtype), mask=valid[:, None])
    else:  # split-K: hand the unnormalised state to the combine
        o_ref, l_ref, m_ref = out_refs
        pltr.store(o_ref.at[rows, :], acc, mask=valid[:, None])
        pltr.store(l_ref.at[rows], l, mask=valid)
        pltr.store(m_ref.at[rows], m, mask=valid)


def merge_splits(acc, l, m, exp):
    """The online-softmax combine of split-K partial states along axis 0: acc [splits, ..., D] and
    l, m [splits, ...] (m in the units of `exp`: jnp.exp, or jnp.exp2 for log2-scaled scores)."""
    weight = exp(m - jnp.max(m, axis=0)[None])
    l_total = jnp.sum(l * weight, axis=0)
    return jnp.sum(acc * weight[..., None], axis=0) / jnp.maximum(l_total, 1e-30)[..., None]


def _choose_splits(num_programs: int, num_steps: int) -> int:
    """Split the context only when the programs would not fill the GPU twice over."""
    if num_programs >= 2 * NUM_SMS:
        return 1
    return max(1, min(-(-2 * NUM_SMS // num_programs), num_steps // 2))


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "interpret", "num_splits", "pages_per_step", "num_warps", "num_stages"))
def paged_attention(q, k_cache, v_cache, layer, md: BatchMetadata, *, scale: float, sliding_window: int | None = None,
                    interpret: bool | None = None, num_splits: int | None = None, pages_per_step: int | None = None,
                    num_warps: int = 4, num_stages: int = 2):
    """Same contract as attention_reference.paged_attention; q: [T, num_heads, head_dim].

    k_cache, v_cache: pools of q's dtype or of fp8 (e4m3), or int8 QuantizedKV pools (both alike).
    Outputs of padding tokens (beyond query_start[B]) are zeros.
    """
    quantized = isinstance(k_cache, QuantizedKV)
    if quantized != isinstance(v_cache, QuantizedKV):
        raise ValueError("k_cache and v_cache must both be int8 QuantizedKV pools or both plain arrays")
    num_tokens, num_heads, head_dim = q.shape
    num_layers, num_pages, page_size, num_kv_heads, _ = k_cache.shape
    num_rows, max_pages = md.page_table.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    if page_size & (page_size - 1) or head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"page_size={page_size} and head_dim={head_dim} must be powers of two (head_dim >= 16) for the Pallas kernel; use attention_impl='reference'")
    group = num_heads // num_kv_heads
    prefill_rows = _PREFILL_ROWS * _Q_ROW_BYTES // max(head_dim * q.dtype.itemsize, _Q_ROW_BYTES)
    block_q = 1 if num_tokens <= num_rows else max(1, prefill_rows // group)
    block_rows = max(16, next_pow2(block_q * group))  # tensor-core dots need >= 16 rows
    num_blocks = num_tokens if block_q == 1 else -(-num_tokens // block_q) + num_rows
    kv_row_bytes = head_dim * jnp.dtype((k_cache.values if quantized else k_cache).dtype).itemsize
    kv_per_step = _KV_PER_STEP * _KV_ROW_BYTES // max(kv_row_bytes, _KV_ROW_BYTES)
    pages_per_step = pages_per_step or max(1, min(kv_per_step // page_size, next_pow2(max_pages)))
    num_steps = -(-max_pages // pages_per_step)
    num_splits = num_splits or (_choose_splits(num_blocks * num_kv_heads, num_steps) if block_q == 1 else 1)
    steps_per_split = -(-num_steps // num_splits)
    pages_per_split = steps_per_split * pages_per_step

    # Global page ids in the [layers * pages] view of the pool (a free reshape), padded so
    # every split reads whole steps inside the table; the padding points at scratch page 0.
    page_table = md.page_table + layer * num_pages
    page_table = jnp.pad(page_table, ((0, 0), (0, num_splits * pages_per_split - max_pages)))  # [B, padded_pages]
    kv_args = []
    for cache in (k_cache, v_cache):
        values = cache.values if quantized else cache
        kv_args.append(values.reshape(num_layers * num_pages, page_size, num_kv_heads, head_dim))
    if quantized:
        kv_args += [c.scales.reshape(num_layers * num_pages, num_kv_heads, page_size) for c in (k_cache, v_cache)]
    # Query rows grouped by KV head, padded by one block so no program reads past the end.
    num_q_rows = num_tokens * group
    q_rows = q.reshape(num_tokens, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)
    q_rows = jnp.pad(q_rows.reshape(num_kv_heads, num_q_rows, head_dim), ((0, 0), (0, block_rows), (0, 0)))  # [KVH, T*G + pad, D]
    pos_rows = jnp.pad(jnp.repeat(md.positions, group), (0, block_rows), constant_values=-1)  # [T*G + pad]
    padded_rows = num_q_rows + block_rows
    row, start, end = query_blocks(md.query_start, num_blocks, block_q)

    full = lambda shape: pl.BlockSpec(shape, lambda b, h, s: (0,) * len(shape))
    kv_spec = pl.BlockSpec((num_layers * num_pages, page_size, None, head_dim), lambda b, h, s: (0, 0, h, 0))
    in_specs = [
        full((num_blocks,)), full((num_blocks,)), full((num_blocks,)), full(page_table.shape), full((padded_rows,)),
        pl.BlockSpec((None, padded_rows, head_dim), lambda b, h, s: (h, 0, 0)), kv_spec, kv_spec,
    ]
    if quantized:
        scale_spec = pl.BlockSpec((num_layers * num_pages, None, page_size), lambda b, h, s: (0, h, 0))
        in_specs += [scale_spec, scale_spec]
    if num_splits == 1:
        out_shape = jax.ShapeDtypeStruct((num_kv_heads, padded_rows, head_dim), q.dtype)
        out_specs = pl.BlockSpec((None, padded_rows, head_dim), lambda b, h, s: (h, 0, 0))
    else:
        out_shape = [
            jax.ShapeDtypeStruct((num_splits, num_kv_heads, padded_rows, head_dim), jnp.float32),  # acc
            jax.ShapeDtypeStruct((num_splits, num_kv_heads, padded_rows), jnp.float32),  # l
            jax.ShapeDtypeStruct((num_splits, num_kv_heads, padded_rows), jnp.float32),  # m
        ]
        out_specs = [
            pl.BlockSpec((None, None, padded_rows, head_dim), lambda b, h, s: (s, h, 0, 0)),
            pl.BlockSpec((None, None, padded_rows), lambda b, h, s: (s, h, 0)),
            pl.BlockSpec((None, None, padded_rows), lambda b, h, s: (s, h, 0)),
        ]
    kernel = functools.partial(
        _kernel, group=group, block_q=block_q, block_rows=block_rows, page_size=page_size,
        pages_per_step=pages_per_step, pages_per_split=pages_per_split, scale=scale, sliding_window=sliding_window,
        quantized=quantized)
    result = pl.pallas_call(
        kernel,
        grid=(num_blocks, num_kv_heads, num_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=pallas_mode.resolve(interpret),
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"paged_attention_bq{block_q}_g{group}_s{num_splits}{'_int8kv' if quantized else ''}",
    )(row, start, end, page_table, pos_rows, q_rows, *kv_args)

    out = result if num_splits == 1 else merge_splits(*result, exp=jnp.exp)
    out = out[:, :num_q_rows].reshape(num_kv_heads, num_tokens, group, head_dim).transpose(1, 0, 2, 3)
    out = out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
    is_real_token = jnp.arange(num_tokens) < md.query_start[-1]
    return jnp.where(is_real_token[:, None, None], out, jnp.zeros((), q.dtype))
