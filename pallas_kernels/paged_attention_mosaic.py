"""Paged attention on Pallas' Mosaic GPU backend (Hopper: TMA copies, mbarriers, wgmma).

Same contract and blocking as paged_attention_pallas.py (the Triton kernel): the ragged batch is
cut into query blocks of consecutive tokens of one row, and a program takes one query block and
one KV head with all the query heads of that KV head (GQA), so each K/V page is read once per
block. A block's query rows (tokens x heads) sit in the 64 rows of one wgmma tile: a one-token
block (decode, and any step of <= 16 tokens) has `group` real rows, a prefill block 64 // group
tokens. The padding rows cost tensor-core work only; the kernel is bound by reading K/V.

Per program: the query rows are copied to shared memory once; K and V pages stream through
`num_stages` shared-memory slots by TMA (one copy per page, each [page_size, head_dim] of one KV
head, all copies of a step arriving on one barrier), so the next step's pages are in flight while
the current one is multiplied: S = Q K^T (wgmma), online softmax in registers, O += P V (wgmma,
P from registers). Two stages of 64 positions keep a program at 80 KB of shared memory, so two
run on each SM. Inputs and outputs are token-major ([blocks, KVH, rows, D]): a decode step needs
no gather or transpose around the kernel.

Decode steps with few blocks over tables wider than split_kv.SHORT_SPAN positions (split_kv.use_work_items)
run as work items (flash-decoding,
split_kv.py): each block's K/V steps are cut into equal chunks computed on the device from the real
context lengths, a program takes one (item, KV head) and writes its unnormalised softmax state (through
the slots' shared memory, so two programs still fit an SM), and split_kv.combine merges each block's
items. Batch-1 decode of a model with 8 KV heads thus runs one wave of about 256 programs at any
context length, not 8.

The kernel's integer inputs (blocks, positions, work items, the page table) do not depend on the
layer, so the layers of a step share one computation of them; the layer reaches the kernel as
its first page in the [layers * pages] view of the pool.

int8 KV pools (QuantizedKV): the int8 pages and their scales (one float32 per token and KV head,
head-major in the pool so that a page's scales of one head are one TMA copy) stream through the
slots at half the bytes. Each step converts its K and V tiles to q's dtype (exact for int8) in
registers, into one shared-memory tile each for the two wgmmas, and applies the scales in float32
as the Triton kernel does: K's to the score columns, V's to the probabilities that multiply V.
fp8 (e4m3) pools are plain arrays with no scales (scale 1, as vLLM's uncalibrated fp8 cache):
their tiles are converted the same way, to float16 (exact; Mosaic GPU converts e4m3 to bfloat16 only
through float32), and both products run in float16 (q converted once, P in float16).

Attention kinds, as the reference: a static sliding window starts a block's steps at the first its
first row's window reaches and masks `kv_pos > row_pos - window`; soft-capping turns the scaled
scores into soft_cap * tanh(s / soft_cap) (the GPU's approximate tanh under approx_math, as
FlashAttention's soft-capping); sink logits (one per query head, [KVH, 64] rows in log2 units,
copied with the query) open each row's softmax as m = the sink, l = 1, with no value: in a
block's first work item only, so the combine counts the sink once.

Contract the kernel relies on: the tokens of a row in one step have consecutive positions
(a prefill chunk or one decode token), so a block's row positions follow from its first token's.

CPU tests run it in Mosaic GPU's interpret mode (jax 0.10.2 and 0.11.2). That interpreter runs the
TMA copies, barriers and slots (with a race detector) but not wgmma on a transposed or a register
operand, so there the two products are plain dots on the same tiles (`interpreting`); the real
wgmma path is lowered for CUDA on CPU separately (tests/test_mosaic_attention.py).
"""
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jlight.pallas_kernels import pallas_mode, split_kv
from jlight.core.batch_metadata import BatchMetadata, query_blocks, token_blocks
from jlight.pallas_kernels.mosaic_common import interpret_params, kernel_name, swizzled_smem, upcast_tile
from jlight.core.quantization import QuantizedKV

_MASKED = -1e30
_ROWS = 64  # query rows per program: one wgmma tile
_LOG2E = math.log2(math.e)
# Tokens per KV page that run on the H200 (the check grid against the reference, and
# batch-64 decode at 4k context in 268 / 256 / 254 / 253 us for pages of 8 / 16 / 32 / 64; docs/BENCHMARKS.md).
PAGE_SIZES = (8, 16, 32, 64)
_ONE_TOKEN_BLOCKS_UP_TO = 16  # steps of at most this many tokens run one token per block
# int8 KV pools (QuantizedKV) take pages of these sizes: one page's scales of one KV head are
# page_size x 4 bytes, and a TMA copy here must move a multiple of 128 bytes (each thread of the
# warpgroup arrives on the barrier with an equal share), so pages of 8 and 16 tokens keep int8 pools
# on the Triton kernel. fp8 pools have no scales and take every page size.
INT8_PAGE_SIZES = (32, 64)
FP8_DTYPE = jnp.float8_e4m3fn


def wgmma_layouts(interpreting: bool):
    """(iota(shape, dim), tile(x), row_vec(x)) in the register layouts of the wgmma accumulator and of
    its rows; identities (and a plain iota) in the interpreter, which has no register layouts."""
    if interpreting:
        return (lambda shape, dim: lax.broadcasted_iota(jnp.int32, shape, dim)), (lambda x: x), (lambda x: x)
    return ((lambda shape, dim: plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)),
            functools.partial(plgpu.layout_cast, new_layout=plgpu.Layout.WGMMA),
            functools.partial(plgpu.layout_cast, new_layout=plgpu.Layout.WGMMA.reduce(1)))


def logits_log2(s, scale: float, soft_cap: float | None):
    """Raw scores (q . k) as the reference's logits in log2 units (exp2 is the hardware's exponential):
    scaled, then soft-capped to soft_cap * tanh(logit / soft_cap) where the layer has a cap (Gemma 2)."""
    if soft_cap is None:
        return s * (scale * _LOG2E)
    return jnp.tanh(s * (scale / soft_cap)) * (soft_cap * _LOG2E)


def sink_rows(sinks, num_kv_heads: int, rows: int):
    """Each query row's sink logit in log2 units, [num_kv_heads, rows] float32: row r of a KV head's
    tile is its query head r % group (token-major rows; a decode block's first `group` rows)."""
    group = sinks.shape[0] // num_kv_heads
    per_head = (sinks.astype(jnp.float32) * _LOG2E).reshape(num_kv_heads, group)
    return per_head[:, jnp.arange(rows) % group]


def row_values(smem, interpreting: bool):
    """A shared-memory vector of one value per query row in the layout of the accumulator's rows."""
    return smem[...] if interpreting else plgpu.load(smem, (), layout=plgpu.Layout.WGMMA.reduce(1))


def supports(q, k_cache) -> bool:
    """Whether this kernel takes these inputs (else the Triton kernel does)."""
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return False  # wgmma on 16-bit floats only; float32 goes to the Triton kernel
    if isinstance(k_cache, QuantizedKV):
        if k_cache.values.dtype != jnp.int8 or k_cache.shape[2] not in INT8_PAGE_SIZES:
            return False
    elif not hasattr(k_cache, "dtype") or k_cache.dtype not in (q.dtype, FP8_DTYPE):
        return False
    head_dim, page_size = q.shape[-1], k_cache.shape[2]
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[3]
    # What has run on the H200: head_dim 64 and 128, the page sizes in PAGE_SIZES. Other sizes lower
    # for CUDA but have not been compiled and checked on a GPU, so they stay on Triton.
    return head_dim in (64, 128) and page_size in PAGE_SIZES \
        and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= _ROWS


def _kernel(meta_ref, layer_ref, q_ref, k_ref, v_ref, *refs, num_blocks, num_items, item_base, table_base, table_width,
            group, page_size, pages_per_step, num_stages, scale, sliding_window, soft_cap, has_sinks, convert, scaled,
            interpreting, slot_types, partial_types):
    if scaled:  # int8 pools: their scales ([pages, kv_heads, page_size]) follow the values
        ks_ref, vs_ref, *refs = refs
    if has_sinks:  # each query row's sink logit ([kv_heads, 64], log2 units)
        sink_ref, *refs = refs
        *refs, sink_smem = refs
    *out_refs, q_smem, q_bar, k_bar, v_bar = refs
    work = num_items > 0  # flash-decoding: program = (work item, KV head), partial states out
    head = lax.axis_index("head")
    if work:
        item = lax.axis_index("item")
        block = meta_ref[item_base + item]
    else:
        block = lax.axis_index("block")
    kv_per_step = pages_per_step * page_size
    page_offset = layer_ref[0]  # the layer's first page in the [layers * pages] view of the pool
    # meta (built in the wrapper): row, start, end of every block, the positions, the work items, the page table.
    row, start, end = meta_ref[block], meta_ref[num_blocks + block], meta_ref[2 * num_blocks + block]
    num_tokens = end - start  # 0 for an unused block
    first_pos = meta_ref[3 * num_blocks + start]

    if work:  # the item's steps, cut by split_kv.work_items
        first_step, last_step = meta_ref[item_base + num_items + item], meta_ref[item_base + 2 * num_items + item]
    else:  # all the block's steps, cut at its last position
        last_pos = first_pos + num_tokens - 1
        num_pages = jnp.where(num_tokens > 0, (last_pos + page_size) // page_size, 0)
        last_step = (num_pages + pages_per_step - 1) // pages_per_step
        first_step = jnp.int32(0)
        if sliding_window is not None:
            first_step = jnp.minimum(jnp.maximum(first_pos - sliding_window + 1, 0) // kv_per_step, last_step)

    # The block's query rows ([rows, head_dim]: 8 * ceil(group / 8) for decode, 64 for prefill) into
    # the top of the tile; rows below them are never written and are masked out (row_ok).
    io_rows = q_ref.shape[2]
    plgpu.copy_gmem_to_smem(q_ref.at[block, head], q_smem.at[pl.ds(0, io_rows)], q_bar)
    if has_sinks:
        plgpu.copy_gmem_to_smem(sink_ref.at[head], sink_smem, q_bar)

    def stream(k_smem, v_smem, *more):
        """The K/V loop, in a scope of its own: the slots' shared memory is free again after it."""
        if convert:  # int8 / fp8 pools: the K and V tiles in the products' dtype, where the wgmmas read them
            kd_smem, vd_smem, *more = more
        if scaled:
            ks_smem, vs_smem = more  # scale slots

        def issue(step, slot):  # TMA the step's pages of this KV head into the slot
            for i in range(pages_per_step):
                page = page_offset + meta_ref[table_base + row * table_width + step * pages_per_step + i]
                dst = pl.ds(i * page_size, page_size)
                plgpu.copy_gmem_to_smem(k_ref.at[page, :, head], k_smem.at[slot, dst], k_bar.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[page, :, head], v_smem.at[slot, dst], v_bar.at[slot])
                if scaled:
                    plgpu.copy_gmem_to_smem(ks_ref.at[page, head], ks_smem.at[slot, dst], k_bar.at[slot])
                    plgpu.copy_gmem_to_smem(vs_ref.at[page, head], vs_smem.at[slot, dst], v_bar.at[slot])

        for s in range(num_stages):
            @pl.when(first_step + s < last_step)
            def _():
                issue(first_step + s, s)

        plgpu.barrier_wait(q_bar)
        iota, tile, row_vec = wgmma_layouts(interpreting)
        shape = (_ROWS, kv_per_step)
        r, c = iota(shape, 0), iota(shape, 1)

        def converted(values_smem, tile_smem):
            """An int8 or fp8 slot in the products' dtype (exact) in tile_smem, where the wgmmas read it."""
            upcast_tile(values_smem, tile_smem, interpreting, wide=not scaled)
            plgpu.commit_smem()  # visible to the wgmma; also orders the slot's reads before its TMA refill
            return tile_smem

        def column_scales(scales_smem):
            """A slot's per-token scales broadcast over the rows of a [rows, positions] tile."""
            scales = scales_smem[...] if interpreting else plgpu.load(scales_smem, (), layout=plgpu.Layout.WGMMA.reduce(0))
            return lax.broadcast_in_dim(scales, shape, [1])
        row_pos = first_pos + lax.div(r, jnp.int32(group))
        row_ok = r < num_tokens * group  # rows past the block belong to other blocks

        def body(step, carry):
            acc, m, l = carry
            slot = lax.rem(step - first_step, num_stages)
            plgpu.barrier_wait(k_bar.at[slot])
            k_tile = converted(k_smem.at[slot], kd_smem) if convert else k_smem.at[slot]

            def v_converted():  # V's tile in q's dtype, converted while the Q K^T wgmma runs
                plgpu.barrier_wait(v_bar.at[slot])
                return converted(v_smem.at[slot], vd_smem)

            if interpreting:
                s = jnp.dot(q_smem[...], k_tile[...].T, preferred_element_type=jnp.float32)
                v_tile = v_converted() if convert else None
            else:
                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_tile, (1, 0)))
                    if convert:
                        v_converted()
                    return acc_ref[...]  # reading the accumulator waits for the wgmma
                s = pl.run_scoped(qk, plgpu.ACC(shape, jnp.float32))
                v_tile = vd_smem if convert else None
            if scaled:
                s = s * column_scales(ks_smem.at[slot])
            kv_pos = step * kv_per_step + c
            mask = row_ok & (kv_pos <= row_pos)
            if sliding_window is not None:
                mask = mask & (kv_pos > row_pos - sliding_window)
            s = jnp.where(mask, logits_log2(s, scale, soft_cap), _MASKED)
            m_new = jnp.maximum(m, s.max(axis=1))
            p = jnp.where(mask, jnp.exp2(s - lax.broadcast_in_dim(m_new, shape, [0])), 0.0)
            alpha = jnp.exp2(m - m_new)
            l = l * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            if scaled:  # (p * s_v) . V_int8 = p . (s_v * V_int8); l keeps the unscaled p
                p16 = (p * column_scales(vs_smem.at[slot])).astype(q_smem.dtype)
            else:
                p16 = p.astype(q_smem.dtype)
            if not convert:
                plgpu.barrier_wait(v_bar.at[slot])
                v_tile = v_smem.at[slot]
            if interpreting:
                acc = acc + jnp.dot(p16, v_tile[...], preferred_element_type=jnp.float32)
            else:
                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p16, v_tile)
                acc = pl.run_state(pv)(plgpu.ACC.init(acc))

            if interpreting:
                # The interpreter's dots read the slot through the generic proxy, and the TMA that
                # refills it writes through the async proxy: the memory model orders the two only
                # across a proxy fence (jax 0.11.2's race detector checks this). On the GPU both are
                # async-proxy accesses (wgmma reads, TMA writes), ordered by the wgmma waits above.
                plgpu.commit_smem()

            @pl.when(step + num_stages < last_step)  # the slot is free again: fetch a later step into it
            def _():
                issue(step + num_stages, slot)
            return acc, m_new, l

        head_dim = q_smem.shape[-1]
        m0, l0 = row_vec(jnp.full((_ROWS,), _MASKED, jnp.float32)), row_vec(jnp.zeros((_ROWS,), jnp.float32))
        if has_sinks:
            # The sink column opens the softmax (m = the sink, l = exp(0), no value), once per block: in
            # its first work item, whose output the combine merges with the others'.
            sink, one = row_values(sink_smem, interpreting), row_vec(jnp.ones((_ROWS,), jnp.float32))
            if work:
                first_item = (item == 0) | (meta_ref[item_base + jnp.maximum(item - 1, 0)] != block)
                with_sink = first_item.astype(jnp.float32)  # arithmetic: no select on a scalar predicate
                m0, l0 = sink + (1.0 - with_sink) * _MASKED, one * with_sink
            else:
                m0, l0 = sink, one
        init = (tile(jnp.zeros((_ROWS, head_dim), jnp.float32)), m0, l0)
        return lax.fori_loop(first_step, last_step, body, init)

    acc, m, l = pl.run_scoped(stream, *slot_types)

    # Only the block's rows go out (an unused block writes zeros: acc = 0, l = 0).
    rows = pl.ds(0, io_rows)
    if not work:  # normalise here; the output tile reuses the query's slot
        (o_ref,) = out_refs
        q_smem[...] = (acc / lax.broadcast_in_dim(jnp.maximum(l, 1e-30), acc.shape, [0])).astype(q_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem.at[rows], o_ref.at[block, head])
        plgpu.wait_smem_to_gmem(0)
    else:  # the item's unnormalised state goes to the combine (m in log2 units), through the slots' memory
        o_ref, l_ref, m_ref = out_refs

        def write_partials(o_smem, stat_smem):
            o_smem[...] = acc
            stat_smem[0] = l
            stat_smem[1] = m
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[rows], o_ref.at[item, head])
            plgpu.copy_smem_to_gmem(stat_smem.at[0, rows], l_ref.at[item, head])
            plgpu.copy_smem_to_gmem(stat_smem.at[1, rows], m_ref.at[item, head])
            plgpu.wait_smem_to_gmem(0)
        pl.run_scoped(write_partials, *partial_types)


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "soft_cap", "interpret", "num_items",
                                             "num_stages", "kv_per_step", "min_steps_per_item"))
def paged_attention(q, k_cache, v_cache, layer, md: BatchMetadata, *, scale: float, sliding_window: int | None = None,
                    soft_cap: float | None = None, sinks=None, interpret: bool | None = None, num_items: int | None = None,
                    num_stages: int = 2, kv_per_step: int = 64, min_steps_per_item: int = 2):
    """Same contract as attention_reference.paged_attention (every attention kind: a static sliding
    window, soft_cap, sinks); q: [T, num_heads, head_dim] in bf16/f16, K/V pools of q's dtype, fp8
    (e4m3) pools or int8 QuantizedKV pools (`supports`).

    num_items: decode steps' work items (split_kv): None picks by the cost rule, 0 runs one program
    per (block, KV head) with no combine, n >= the step's blocks forces n items."""
    if not supports(q, k_cache):
        raise ValueError(f"the Mosaic GPU attention kernel does not take q {q.dtype}{q.shape} with pools "
                         f"{getattr(k_cache, 'dtype', type(k_cache).__name__)}{k_cache.shape}; use the Triton kernel "
                         "(paged_attention_pallas) or attention_impl='reference'")
    if kv_per_step % 64 or kv_per_step > 256:
        raise ValueError(f"kv_per_step={kv_per_step} must be 64, 128, 192 or 256 (the P.V wgmma sums over 64-position chunks)")
    scaled = isinstance(k_cache, QuantizedKV)
    if scaled != isinstance(v_cache, QuantizedKV) or v_cache.dtype != k_cache.dtype:
        raise ValueError("k_cache and v_cache must be pools of one kind: both int8 QuantizedKV pools or both arrays of one dtype")
    interpreting = pallas_mode.resolve(interpret)
    num_tokens, num_heads, head_dim = q.shape
    num_layers, num_pages, page_size, num_kv_heads, _ = k_cache.shape
    num_rows, max_pages = md.page_table.shape
    group = num_heads // num_kv_heads
    block_q = _ROWS // group if uses_prefill_blocks(num_tokens, num_rows) else 1
    num_blocks = num_tokens if block_q == 1 else -(-num_tokens // block_q) + num_rows
    pages_per_step = max(1, kv_per_step // page_size)
    kv_per_step = pages_per_step * page_size
    num_items = work_item_count(num_items, num_blocks, num_kv_heads, max_pages * page_size, block_q == 1)
    layer_offset = jnp.reshape(jnp.asarray(layer, jnp.int32) * num_pages, (1,))
    pools = [(c.values if scaled else c).reshape(num_layers * num_pages, page_size, num_kv_heads, head_dim)
             for c in (k_cache, v_cache)]
    if scaled:
        pools += [c.scales.reshape(num_layers * num_pages, num_kv_heads, page_size) for c in (k_cache, v_cache)]
    meta, (start, end), items, table_width = kernel_meta(md, num_blocks, block_q, page_size, pages_per_step,
                                                         sliding_window, num_items, min_steps_per_item)
    # The products' dtype: q's, but float16 over fp8 pools (Mosaic GPU converts e4m3 to float16 in
    # registers, exactly, and to bfloat16 only through float32).
    dtype = jnp.float16 if k_cache.dtype == FP8_DTYPE else q.dtype
    q_rows = query_rows(q, num_kv_heads, block_q, start, end).astype(dtype)  # [blocks, KVH, io_rows, D]
    io_rows = q_rows.shape[2]

    if num_items:
        tile = (num_items, num_kv_heads, io_rows)
        out_type = (
            jax.ShapeDtypeStruct(tile + (head_dim,), jnp.float32),  # acc
            jax.ShapeDtypeStruct(tile, jnp.float32),  # l
            jax.ShapeDtypeStruct(tile, jnp.float32),  # m (log2 units)
        )
        grid, grid_names = (num_items, num_kv_heads), ("item", "head")
    else:
        out_type = jax.ShapeDtypeStruct((num_blocks, num_kv_heads, io_rows, head_dim), dtype)
        grid, grid_names = (num_blocks, num_kv_heads), ("block", "head")
    kv_tile = (num_stages, pages_per_step * page_size, head_dim)
    slot_dtype = k_cache.dtype
    convert = slot_dtype != dtype
    copies_per_slot = pages_per_step * (2 if scaled else 1)  # int8: each page's values and scales
    has_sinks = sinks is not None
    scratch = [
        swizzled_smem((_ROWS, head_dim), dtype),  # the query tile, then the output tile
        plgpu.Barrier(num_arrivals=2 if has_sinks else 1),  # query (and its rows' sinks) copied
        plgpu.Barrier(num_arrivals=copies_per_slot, num_barriers=num_stages),  # a slot's K pages copied
        plgpu.Barrier(num_arrivals=copies_per_slot, num_barriers=num_stages),  # a slot's V pages copied
    ] + ([plgpu.SMEM((_ROWS,), jnp.float32)] if has_sinks else [])  # the rows' sink logits
    # Shared memory of the K/V loop's scope, then of the epilogue's (the same bytes, one after the other):
    # two programs of 80 KB (bf16, 2 stages of 64 positions) fit on an SM with an item's partial output too.
    slot_types = [swizzled_smem(kv_tile, slot_dtype), swizzled_smem(kv_tile, slot_dtype)]  # K, V slots
    if convert:
        slot_types += [swizzled_smem(kv_tile[1:], dtype), swizzled_smem(kv_tile[1:], dtype)]  # K, V tiles in the products' dtype
    if scaled:
        slot_types += [plgpu.SMEM(kv_tile[:2], jnp.float32), plgpu.SMEM(kv_tile[:2], jnp.float32)]  # K, V scale slots
    partial_types = [swizzled_smem((_ROWS, head_dim), jnp.float32),  # an item's partial output
                     plgpu.SMEM((2, _ROWS), jnp.float32)]  # its l and m
    item_base = 3 * num_blocks + num_tokens + 1
    kernel = functools.partial(
        _kernel, num_blocks=num_blocks, num_items=num_items, item_base=item_base,
        table_base=item_base + 3 * num_items, table_width=table_width,
        group=group, page_size=page_size, pages_per_step=pages_per_step,
        num_stages=num_stages, scale=scale, sliding_window=sliding_window, soft_cap=soft_cap, has_sinks=has_sinks,
        convert=convert, scaled=scaled, interpreting=interpreting, slot_types=tuple(slot_types), partial_types=tuple(partial_types))
    result = plgpu.kernel(
        kernel,
        out_type=out_type,
        scratch_types=scratch,
        grid=grid,
        grid_names=grid_names,
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret_params() if interpreting else None,
        kernel_name=kernel_name("jlight_paged_attention", out=repr(out_type), pools=repr([(p.shape, p.dtype) for p in pools]),
                                q=repr((q_rows.shape, q_rows.dtype)), meta=meta.shape[0], **{
                                    k: v for k, v in kernel.keywords.items() if not k.endswith("_types")}),
    )(meta, layer_offset, q_rows, *pools, *([sink_rows(sinks, num_kv_heads, _ROWS)] if has_sinks else []))

    out = split_kv.combine(items, *result, out_dtype=q.dtype, interpret=interpret) if num_items else result.astype(q.dtype)
    # out: [blocks, KVH, rows, D]
    if block_q == 1:  # decode: block t is token t, its first `group` rows its heads (padding tokens got zeros)
        return out[:, :, :group].reshape(num_tokens, num_heads, head_dim)
    # prefill: token t is rows (t - start) * group + [0, group) of its block
    token_block, token_offset = token_blocks(md, num_tokens, num_blocks, block_q)
    out = out[:, :, :block_q * group].reshape(num_blocks, num_kv_heads, block_q, group, head_dim)
    out = out[token_block, :, token_offset].reshape(num_tokens, num_heads, head_dim)  # [T, KVH, group, D] -> [T, H, D]
    is_real_token = jnp.arange(num_tokens) < md.query_start[-1]
    return jnp.where(is_real_token[:, None, None], out, jnp.zeros((), q.dtype))


def work_item_count(num_items: int | None, num_blocks: int, num_kv_heads: int, span: int, one_token_blocks: bool) -> int:
    """A decode kernel's work items (split_kv): num_items None picks by the cost rule (items only for one-token
    blocks over a table wider than split_kv.SHORT_SPAN whose programs fit one wave), 0 none, n >= the step's
    blocks forces n."""
    if num_items is None:
        few = one_token_blocks and split_kv.use_work_items(num_blocks, num_kv_heads, span)
        return split_kv.num_work_items(num_blocks, num_kv_heads) if few else 0
    if num_items and num_items < num_blocks:
        raise ValueError(f"num_items={num_items} must be 0 or at least the step's {num_blocks} query blocks")
    return num_items


def kernel_meta(md: BatchMetadata, num_blocks: int, block_q: int, page_size: int, pages_per_step: int,
                sliding_window: int | None, num_items: int, min_steps_per_item: int):
    """The decode kernels' integer inputs as one int32 array: row, start, end of every block, the positions
    (one extra entry keeps an unused block's read in range when T = 0), the work items' block, first and last
    step (with items), the page table padded to whole steps (the padding points at scratch page 0).
    Returns (meta, (start, end), the work items or None, the padded table's width).

    One array that XLA must compute: a custom call's operands must be 256-byte aligned, and a slice of the
    engine's packed step inputs (an unpadded page table) reached it as an unaligned view (H200, jax 0.11.2).
    It does not depend on the layer, so the layers of a step share one."""
    num_rows, max_pages = md.page_table.shape
    num_steps = -(-max_pages // pages_per_step)
    table = jnp.pad(md.page_table, ((0, 0), (0, num_steps * pages_per_step - max_pages)))
    row, start, end = query_blocks(md.query_start, num_blocks, block_q)
    positions = jnp.pad(md.positions, (0, 1))
    parts, items = [row, start, end, positions], None
    if num_items:
        items = split_kv.work_items(*block_steps(positions, start, end, page_size, pages_per_step, sliding_window),
                                    num_items, min_steps=min_steps_per_item)
        parts += [items.block, items.first_step, items.last_step]
    return jnp.concatenate(parts + [table.reshape(-1)]), (start, end), items, table.shape[1]


def block_steps(positions, start, end, page_size: int, pages_per_step: int, sliding_window: int | None):
    """Each query block's K/V steps [begin, end): up to the page of its last position, and from the
    first step its sliding window still sees."""
    kv_per_step = page_size * pages_per_step
    num_tokens = end - start
    first_pos = positions[start]
    num_pages = jnp.where(num_tokens > 0, (first_pos + num_tokens - 1 + page_size) // page_size, 0)
    step_end = (num_pages + pages_per_step - 1) // pages_per_step
    step_begin = jnp.zeros_like(step_end)
    if sliding_window is not None:
        step_begin = jnp.minimum(jnp.maximum(first_pos - sliding_window + 1, 0) // kv_per_step, step_end)
    return step_begin.astype(jnp.int32), step_end.astype(jnp.int32)


def short_table_span(num_tokens: int, num_rows: int, num_kv_heads: int) -> int:
    """The page-table width (positions) at or under which a step of num_tokens tokens over num_rows rows
    runs without flash-decoding's items and their combine (split_kv.short_span), 0 where the width
    changes nothing (Kernels.short_table_span)."""
    return 0 if uses_prefill_blocks(num_tokens, num_rows) else split_kv.short_span(num_tokens, num_kv_heads)


def uses_prefill_blocks(num_tokens: int, num_rows: int) -> bool:
    """Whether a step of num_tokens tokens over num_rows rows runs prefill blocks (several tokens of a
    row a block) rather than one token a block: decode buckets and small steps, such as a batch-1
    decode padded to 8 tokens, where a row's extra tokens re-read few pages, run one token a block
    (no query gather, no output gather)."""
    return num_tokens > max(num_rows, _ONE_TOKEN_BLOCKS_UP_TO)


def query_rows(q, num_kv_heads: int, block_q: int, start, end, rows: int = _ROWS):
    """Every block's query rows per KV head: [blocks, KVH, rows, head_dim].

    TMA into the tiled shared-memory tile takes whole 8-row tiles. A decode block (one token)
    holds that token's `group` query heads padded to a multiple of 8 rows: for group 8 this is
    q itself, reshaped. A prefill block holds block_q tokens x group heads, gathered into a
    tile of `rows` rows (token-major)."""
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    q4 = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    if block_q == 1:
        return jnp.pad(q4, ((0, 0), (0, 0), (0, -group % 8), (0, 0)))
    r = jnp.arange(rows)
    token = start[:, None] + r[None, :] // group  # [blocks, rows]
    token = jnp.where(token < end[:, None], token, 0)  # rows past the block: any in-range row (masked)
    return q4[token[:, None, :], jnp.arange(num_kv_heads)[None, :, None], (r % group)[None, None, :]]
