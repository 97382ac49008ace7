"""Decode attention over fp8 (e4m3) K/V pages on Mosaic GPU with the products transposed (K and V on the
wgmma's M side, the query heads on its N side).

Same contract as attention_reference.paged_attention, for the steps whose query blocks hold one token
(decode buckets and small steps: paged_attention_mosaic.uses_prefill_blocks is False) over fp8 pools
with a 16-bit q. A program takes one query block (or one work item of it, split_kv) and one KV head;
the block's `group` query heads sit in the N side of two wgmmas, padded to 16 columns:
- S^T = K Q^T: [kv_per_step, 16], K from registers (the slot's bytes converted to float16 in
  registers, no shared-memory round trip);
- O^T += V^T P^T: [head_dim, 16], V^T the slot converted to float16 into one shared-memory tile and
  read transposed, P^T the probabilities written to a [kv_per_step, 16] tile.
The softmax runs over the kv_per_step x 16 tile (columns: query heads), not over 64 padded rows as
in paged_attention_mosaic, whose fp8 steps spend their time on that per-position work rather than
on their reads. 16-bit pools stay on paged_attention_mosaic: there this layout lost at every
measured shape (docs/BENCHMARKS.md, Kernels).

Every position of a block's step has one query position (the block's token), so the masks (causal,
sliding window) are functions of the K/V position alone. Sinks open each column's softmax (m = the
sink, l = 1, no value), in a block's first work item only. The P^T and converted-V tiles use a 32-byte
swizzle: the wgmma's two operands share one swizzle, and P^T's rows are 32 bytes.

Outputs leave transposed ([blocks or items, KVH, head_dim, 16]) and the wrapper turns them into
paged_attention_mosaic's layout; items go through split_kv.combine.

CPU tests run it in Mosaic GPU's interpret mode, with plain dots for the two products; the wgmma path
is lowered for CUDA separately (tests/test_mosaic_decode.py).

`takes` is the cost rule paged attention dispatches by (pallas_kernels/dispatch.py).
"""
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jlight.core.batch_metadata import BatchMetadata
from jlight.pallas_kernels import pallas_mode, split_kv
from jlight.pallas_kernels.mosaic_common import interpret_params, kernel_name, swizzled_smem, upcast_tile
from jlight.pallas_kernels.paged_attention_mosaic import (FP8_DTYPE, PAGE_SIZES, kernel_meta, logits_log2,
                                                          uses_prefill_blocks, work_item_count)

_MASKED = -1e30
_COLS = 16  # query heads of a KV head on the wgmmas' N side (group <= 16), padded


def supports(q, k_cache, md: BatchMetadata) -> bool:
    """Whether this kernel can run the step: one-token query blocks, q in bf16/f16, fp8 pools, head_dim 64 or
    128, a page size of PAGE_SIZES, at most 16 query heads a KV head."""
    if q.dtype not in (jnp.bfloat16, jnp.float16) or getattr(k_cache, "dtype", None) != FP8_DTYPE:
        return False
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, page_size = k_cache.shape[3], k_cache.shape[2]
    return (not uses_prefill_blocks(num_tokens, md.page_table.shape[0]) and head_dim in (64, 128)
            and page_size in PAGE_SIZES and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= _COLS)


# Steps of fewer query blocks stay on paged_attention_mosaic: on the H100, Llama-3-8B shape, the engine's
# batch-1 decode (the 8-token bucket) ran 0.10-0.18 ms a token slower here from 1k to 16k of context and level
# at 32k, batch 16 3-6% faster from 1k to 16k (docs/BENCHMARKS.md, Attention across context).
MIN_BLOCKS = 16


def takes(q, k_cache, md: BatchMetadata) -> bool:
    """The cost rule: the steps `supports` of at least MIN_BLOCKS one-token query blocks."""
    return supports(q, k_cache, md) and q.shape[0] >= MIN_BLOCKS


def _smem32(shape, dtype):
    """A shared-memory tile with a 32-byte swizzle (the transposed products' operands)."""
    minor = 32 // jnp.dtype(dtype).itemsize
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, minor)), plgpu.SwizzleTransform(32)))


def _kernel(meta_ref, layer_ref, q_ref, k_ref, v_ref, *refs, num_blocks, num_items, item_base, table_base,
            table_width, page_size, pages_per_step, num_stages, scale, sliding_window, soft_cap, has_sinks,
            interpreting, slot_types, out_types):
    if has_sinks:  # each column's sink logit ([kv_heads, 16], log2 units)
        sink_ref, *refs = refs
    *out_refs, q_smem, q_bar, k_bar, v_bar = refs
    work = num_items > 0
    head = lax.axis_index("head")
    if work:
        item = lax.axis_index("item")
        block = meta_ref[item_base + item]
    else:
        block = lax.axis_index("block")
    kv_per_step = pages_per_step * page_size
    page_offset = layer_ref[0]
    # meta: row, start, end of every block, the positions, the work items, the page table (as the decode kernel's)
    row, start, end = meta_ref[block], meta_ref[num_blocks + block], meta_ref[2 * num_blocks + block]
    used = end > start
    pos = meta_ref[3 * num_blocks + start]  # the block's one token
    if work:
        first_step, last_step = meta_ref[item_base + num_items + item], meta_ref[item_base + 2 * num_items + item]
    else:
        last_step = jnp.where(used, pos // kv_per_step + 1, 0)
        first_step = jnp.int32(0)
        if sliding_window is not None:
            first_step = jnp.minimum(jnp.maximum(pos - sliding_window + 1, 0) // kv_per_step, last_step)

    plgpu.copy_gmem_to_smem(q_ref.at[block, head], q_smem, q_bar)
    if interpreting:
        col_vec = lambda x: x
        iota = lambda shape, dim: lax.broadcasted_iota(jnp.int32, shape, dim)
        tile = lambda x: x
    else:
        col_vec = functools.partial(plgpu.layout_cast, new_layout=plgpu.Layout.WGMMA.reduce(0))
        iota = lambda shape, dim: plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)
        tile = functools.partial(plgpu.layout_cast, new_layout=plgpu.Layout.WGMMA)

    def stream(k_smem, v_smem, p_smem, vd_smem):

        def issue(step, slot):
            for i in range(pages_per_step):
                page = page_offset + meta_ref[table_base + row * table_width + step * pages_per_step + i]
                dst = pl.ds(i * page_size, page_size)
                plgpu.copy_gmem_to_smem(k_ref.at[page, :, head], k_smem.at[slot, dst], k_bar.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[page, :, head], v_smem.at[slot, dst], v_bar.at[slot])

        for s in range(num_stages):
            @pl.when(first_step + s < last_step)
            def _():
                issue(first_step + s, s)

        plgpu.barrier_wait(q_bar)
        shape = (kv_per_step, _COLS)
        head_dim = q_smem.shape[-1]

        def body(step, carry):
            acc, m, l = carry  # acc: O^T [head_dim, 16]; m, l: [16] (one per query head)
            slot = lax.rem(step - first_step, num_stages)
            plgpu.barrier_wait(k_bar.at[slot])
            k_slot = k_smem.at[slot]
            if interpreting:
                s = jnp.dot(k_slot[...].astype(q_smem.dtype), q_smem[...].T, preferred_element_type=jnp.float32)
            else:
                def qk(acc_ref):  # fp8 K to float16 in registers, the wgmma's A operand
                    k_regs = plgpu.load(k_slot, (), layout=plgpu.Layout.WGMMA_UPCAST_2X).astype(q_smem.dtype)
                    plgpu.wgmma(acc_ref, plgpu.layout_cast(k_regs, plgpu.Layout.WGMMA),
                                plgpu.transpose_ref(q_smem, (1, 0)))
                    return acc_ref[...]
                s = pl.run_scoped(qk, plgpu.ACC(shape, jnp.float32))
            kv_pos = step * kv_per_step + iota(shape, 0)
            mask = kv_pos <= pos
            if sliding_window is not None:
                mask = mask & (kv_pos > pos - sliding_window)
            s = jnp.where(mask, logits_log2(s, scale, soft_cap), _MASKED)
            m_new = jnp.maximum(m, s.max(axis=0))
            p = jnp.where(mask, jnp.exp2(s - lax.broadcast_in_dim(m_new, shape, [1])), 0.0)
            alpha = jnp.exp2(m - m_new)
            l = l * alpha + p.sum(axis=0)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [1])
            p_smem[...] = p.astype(p_smem.dtype)
            plgpu.barrier_wait(v_bar.at[slot])
            upcast_tile(v_smem.at[slot], vd_smem, interpreting)
            plgpu.commit_smem()  # P^T and V converted visible to the wgmma; the slot's reads before its refill
            if interpreting:
                acc = acc + jnp.dot(vd_smem[...].T, p_smem[...], preferred_element_type=jnp.float32)
                plgpu.commit_smem()  # the interpreter's reads (generic proxy) ordered before the slot's TMA refill
            else:
                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, plgpu.transpose_ref(vd_smem, (1, 0)), p_smem)
                acc = pl.run_state(pv)(plgpu.ACC.init(acc))

            @pl.when(step + num_stages < last_step)
            def _():
                issue(step + num_stages, slot)
            return acc, m_new, l

        m0 = col_vec(jnp.full((_COLS,), _MASKED, jnp.float32))
        l0 = col_vec(jnp.zeros((_COLS,), jnp.float32))
        if has_sinks:
            sink = sink_ref[head] if interpreting else plgpu.load(sink_ref.at[head], (), layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)
            one = col_vec(jnp.ones((_COLS,), jnp.float32))
            if work:
                first_item = (item == 0) | (meta_ref[item_base + jnp.maximum(item - 1, 0)] != block)
                with_sink = first_item.astype(jnp.float32)
                m0, l0 = sink + (1.0 - with_sink) * _MASKED, one * with_sink
            else:
                m0, l0 = sink, one
        init = (tile(jnp.zeros((head_dim, _COLS), jnp.float32)), m0, l0)
        return lax.fori_loop(first_step, last_step, body, init)

    acc, m, l = pl.run_scoped(stream, *slot_types)

    def write(o_smem, *stat_smem):
        if work:
            o_ref, l_ref, m_ref = out_refs
            o_smem[...] = acc
            stat_smem[0][...] = l
            stat_smem[1][...] = m
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_ref.at[item, head])
            plgpu.copy_smem_to_gmem(stat_smem[0], l_ref.at[item, head])
            plgpu.copy_smem_to_gmem(stat_smem[1], m_ref.at[item, head])
        else:
            (o_ref,) = out_refs
            o_smem[...] = (acc / lax.broadcast_in_dim(jnp.maximum(l, 1e-30), acc.shape, [1])).astype(o_smem.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_ref.at[block, head])
        plgpu.wait_smem_to_gmem(0)
    pl.run_scoped(write, *out_types)


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "soft_cap", "interpret", "num_items",
                                             "num_stages", "kv_per_step", "min_steps_per_item"))
def paged_attention(q, k_cache, v_cache, layer, md: BatchMetadata, *, scale: float, sliding_window: int | None = None,
                    soft_cap: float | None = None, sinks=None, interpret: bool | None = None, num_items: int | None = None,
                    num_stages: int = 2, kv_per_step: int = 128, min_steps_per_item: int = 2):
    """Same contract as attention_reference.paged_attention for the steps `supports` accepts. num_items:
    work items (split_kv) as in paged_attention_mosaic: None by the cost rule, 0 none. kv_per_step: K/V
    positions a pipeline step loads, 64 or 128."""
    if not supports(q, k_cache, md):
        raise ValueError(f"the transposed Mosaic GPU decode kernel does not take q {q.dtype}{q.shape} with pools "
                         f"{getattr(k_cache, 'dtype', type(k_cache).__name__)}{k_cache.shape} and "
                         f"{md.page_table.shape[0]} rows; use paged_attention_mosaic")
    if kv_per_step % 64 or kv_per_step > 128:
        raise ValueError(f"kv_per_step={kv_per_step} must be 64 or 128")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) must be pools of one dtype")
    interpreting = pallas_mode.resolve(interpret)
    num_tokens, num_heads, head_dim = q.shape
    num_layers, num_pages, page_size, num_kv_heads, _ = k_cache.shape
    max_pages = md.page_table.shape[1]
    group = num_heads // num_kv_heads
    num_blocks = num_tokens
    pages_per_step = max(1, kv_per_step // page_size)
    kv_per_step = pages_per_step * page_size
    num_items = work_item_count(num_items, num_blocks, num_kv_heads, max_pages * page_size, True)
    meta, _, items, table_width = kernel_meta(md, num_blocks, 1, page_size, pages_per_step, sliding_window, num_items,
                                              min_steps_per_item)
    layer_offset = jnp.reshape(jnp.asarray(layer, jnp.int32) * num_pages, (1,))
    pools = [c.reshape(num_layers * num_pages, page_size, num_kv_heads, head_dim) for c in (k_cache, v_cache)]
    dtype = jnp.float16  # the products' operands: fp8 K and V converted, q cast
    q_cols = jnp.pad(q.reshape(num_tokens, num_kv_heads, group, head_dim),
                     ((0, 0), (0, 0), (0, _COLS - group), (0, 0))).astype(dtype)  # [blocks, KVH, 16, D]

    kv_tile = (num_stages, kv_per_step, head_dim)
    # K and V slots: 128-byte swizzle (K: the registers' load); each V slot is converted into one
    # 32-byte-swizzled float16 tile, as P^T (the two operands of O^T += V^T P^T share one swizzle).
    slot_types = [swizzled_smem(kv_tile, k_cache.dtype), swizzled_smem(kv_tile, k_cache.dtype),
                  _smem32((kv_per_step, _COLS), dtype), _smem32(kv_tile[1:], dtype)]
    scratch = [swizzled_smem((_COLS, head_dim), dtype),  # the query columns (Q: [16, D])
               plgpu.Barrier(num_arrivals=1),
               plgpu.Barrier(num_arrivals=pages_per_step, num_barriers=num_stages),
               plgpu.Barrier(num_arrivals=pages_per_step, num_barriers=num_stages)]
    if num_items:
        tile = (num_items, num_kv_heads)
        out_type = (jax.ShapeDtypeStruct(tile + (head_dim, _COLS), jnp.float32),  # acc^T
                    jax.ShapeDtypeStruct(tile + (_COLS,), jnp.float32),  # l
                    jax.ShapeDtypeStruct(tile + (_COLS,), jnp.float32))  # m (log2 units)
        out_types = [plgpu.SMEM((head_dim, _COLS), jnp.float32), plgpu.SMEM((_COLS,), jnp.float32),
                     plgpu.SMEM((_COLS,), jnp.float32)]
        grid, grid_names = (num_items, num_kv_heads), ("item", "head")
    else:
        out_type = jax.ShapeDtypeStruct((num_blocks, num_kv_heads, head_dim, _COLS), dtype)
        out_types = [plgpu.SMEM((head_dim, _COLS), dtype)]
        grid, grid_names = (num_blocks, num_kv_heads), ("block", "head")
    has_sinks = sinks is not None
    sink_cols = None
    if has_sinks:
        per_head = (sinks.astype(jnp.float32) * math.log2(math.e)).reshape(num_kv_heads, group)  # log2 units
        sink_cols = jnp.pad(per_head, ((0, 0), (0, _COLS - group)))
    item_base = 3 * num_blocks + num_tokens + 1
    kernel = functools.partial(
        _kernel, num_blocks=num_blocks, num_items=num_items, item_base=item_base, table_base=item_base + 3 * num_items,
        table_width=table_width, page_size=page_size, pages_per_step=pages_per_step, num_stages=num_stages,
        scale=scale, sliding_window=sliding_window, soft_cap=soft_cap, has_sinks=has_sinks,
        interpreting=interpreting, slot_types=tuple(slot_types), out_types=tuple(out_types))
    result = plgpu.kernel(
        kernel,
        out_type=out_type,
        scratch_types=scratch,
        grid=grid,
        grid_names=grid_names,
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret_params() if interpreting else None,
        kernel_name=kernel_name("jlight_paged_decode_t", out=repr(out_type), pools=repr([(p.shape, p.dtype) for p in pools]),
                                q=repr((q_cols.shape, q_cols.dtype)), meta=meta.shape[0],
                                **{k: v for k, v in kernel.keywords.items() if not k.endswith("_types")}),
    )(meta, layer_offset, q_cols, *pools, *([sink_cols] if has_sinks else []))

    if num_items:
        acc_t, l, m = result
        acc = jnp.swapaxes(acc_t, 2, 3)[:, :, :group]  # [items, KVH, group, D]
        out = split_kv.combine(items, acc, l[:, :, :group], m[:, :, :group], out_dtype=q.dtype, interpret=interpret)
    else:
        out = jnp.swapaxes(result, 2, 3)[:, :, :group].astype(q.dtype)
    return out.reshape(num_tokens, num_heads, head_dim)
