"""Prefill attention over paged K/V on Mosaic GPU, warp-specialized (FlashAttention-3's schedule).

Same contract as attention_reference.paged_attention, for steps that the Mosaic GPU attention cuts
into prefill blocks (more tokens than rows and than 16; `takes`). A program takes one query block
of up to 128 // group consecutive tokens of one row and one KV head with its `group` query heads:
128 query rows (token-major: row = token * group + head) in three warpgroups:
- two compute warpgroups, 64 rows each: S = Q K^T (wgmma), online softmax in registers,
  O += P V (wgmma, P from registers), the output normalised and written by TMA;
- a memory warpgroup that streams the block's K and V steps (`kv_per_step` positions, one TMA
  copy per page and KV head) into `num_stages` shared-memory slots, refilling a slot once both
  compute warpgroups have released it (the consumed barriers).
A schedule barrier between the compute warpgroups makes one's softmax run while the other's
matmuls use the tensor cores (ping-pong).

Which positions a warpgroup computes: its K/V steps run from the first step its first row's window
reaches (step 0 without a sliding window) through its last row's position; those wholly at or below
its first row's position and wholly inside its last row's window (`kv_pos > row_pos - window`) run
without a mask, the others masked (causal, window, rows past its real rows), where a row that sees
nothing of a step takes no mass from it. The block's steps run from its first row's first step
through its last row's; a step of the block that a warpgroup does not compute (before its rows'
windows, or past its last row) it still waits for and releases, passing the schedule barrier twice
as a computing step does, so both warpgroups pass every barrier equally often. A warpgroup without
rows (a short block's second half, a decode row in a mixed step) computes nothing; an unused block
does nothing. Rows past a block's tokens are computed on real positions and never read.

The attention kinds, as the reference: scores scaled, then soft-capped (soft_cap * tanh(s / soft_cap),
the GPU's approximate tanh under approx_math, as FlashAttention's soft-capping); sink logits (one per
query head, log2 units, copied with the query) open each row's softmax (m = the sink, l = 1, no value).

fp8 (e4m3) pools: the memory warpgroup TMAs a step's pages into one fp8 landing tile per K and V,
converts them to float16 (exact) into the slots, 64 positions at a time, fences them for the wgmmas
and arrives on the slot's barrier itself; then it fetches the next step's pages into the landing
tile. Both products run in float16 (q converted once, P in float16), as paged_attention_mosaic's.

fp8_qk (fp8 pools only; EngineConfig.fp8_prefill_qk): the wrapper quantizes the queries to e4m3 with one
scale per query head (fp8_queries: amax over the step's real tokens / 448, values multiplied by the
scale's reciprocal), and S = Q K^T runs on the fp8 tensor cores (wgmma e4m3 x e4m3, float32
accumulator; both operands K-major, as fp8 wgmma requires: Q's rows and K's slots hold head_dim
contiguous). K's pages go by TMA straight into fp8 slots (no landing tile, no conversion); V is still
converted to float16 for O += P V (fp8 wgmma cannot take V's N-major layout). The pools carry no scale
(K's is 1), so each query row's head scale, times the softmax scale (and 1 / soft_cap, in log2 units
without a cap), is one float32 multiplier per row, copied with the query like the sinks, that multiplies
the raw scores in place of the constant softmax scale. The accuracy trade: each query value keeps
e4m3's 3 mantissa bits (a relative error of at most 2**-4, against bfloat16's 2**-9), so every score
moves by up to 2**-4 of sum_i |q_i k_i| x scale; peaked softmaxes amplify that where two scores nearly
tie. Per-head scales suffice because e4m3's relative precision does not depend on the scale (only
values under 2**-6 of the head's amax fall into subnormals), so a per-token scale would buy little.

Invariants the wrapper establishes: a static window (or none), so the kernel cuts steps while
tracing; the page table is padded to whole steps (padding points at scratch page 0, as do a
sliding-window group's pages that no window sees: only masked positions read them); the kernel's
integer inputs do not depend on the layer; and the output holds every real token's rows
([blocks, KVH, 128, D], gathered to [T, H, D]).

Shared memory (D = 128, two stages of 128 positions): Q/O tiles 2 x 64 x D, K and V slots
num_stages x kv_per_step x D each in the products' dtype: 160 KB over bf16 pools; fp8 pools add the
two landing tiles (kv_per_step x D bytes each): 192 KB; under fp8_qk the K slots are fp8 and only V
lands, and the e4m3 query tiles add 2 x 64 x D bytes: 160 KB. One program per SM in every case.

CPU tests run it in Mosaic GPU's interpret mode, which runs the three warpgroups, the TMA copies
and every barrier, but not wgmma on a transposed or a register operand: there the products are
plain dots on the same tiles (`interpreting`), and the CUDA lowering of the wgmma path is checked
separately (tests/test_mosaic_prefill.py).
"""
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jlight.core.batch_metadata import BatchMetadata, query_blocks, token_blocks
from jlight.core.quantization import FP8_MAX, QuantizedKV, to_fp8
from jlight.pallas_kernels import pallas_mode
from jlight.pallas_kernels.mosaic_common import interpret_params, kernel_name, swizzled_smem, upcast_tile
from jlight.pallas_kernels.paged_attention_mosaic import (FP8_DTYPE, PAGE_SIZES, logits_log2, query_rows, row_values,
                                                          sink_rows, uses_prefill_blocks, wgmma_layouts)

_MASKED = -1e30
_LOG2E = math.log2(math.e)
_WG_ROWS = 64  # query rows of one compute warpgroup: one wgmma tile
_ROWS = 2 * _WG_ROWS  # query rows of a program
# Registers per thread (memory warpgroup, each compute warpgroup), the SM's 64K over 3 x 128 threads:
# over 16-bit pools, then over fp8 pools, where the memory warpgroup also converts (64 positions at a time).
_REGISTERS = ((40, 232), (56, 224))


def takes(q, k_cache, md: BatchMetadata, sliding_window) -> bool:
    """Whether this kernel runs the step: a prefill-shaped step (paged_attention_mosaic's prefill
    blocks) over pools of q's dtype (16-bit) or fp8 (e4m3), head_dim 64 or 128, no sliding window
    or a static one (a Python int)."""
    if q.dtype not in (jnp.bfloat16, jnp.float16) or isinstance(k_cache, QuantizedKV):
        return False
    if not hasattr(k_cache, "dtype") or k_cache.dtype not in (q.dtype, FP8_DTYPE):
        return False
    if sliding_window is not None and not isinstance(sliding_window, int):
        return False
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, page_size = k_cache.shape[3], k_cache.shape[2]
    return (uses_prefill_blocks(num_tokens, md.page_table.shape[0]) and head_dim in (64, 128)
            and page_size in PAGE_SIZES and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= _ROWS)


def _kernel(meta_ref, layer_ref, q_ref, k_ref, v_ref, *refs, num_blocks, table_base, table_width, group, page_size,
            pages_per_step, num_stages, scale, sliding_window, soft_cap, has_sinks, convert, fp8_qk, interpreting):
    if has_sinks:  # each query row's sink logit ([kv_heads, 128], log2 units)
        sink_ref, *refs = refs
    if fp8_qk:  # each query row's score multiplier: its head's query scale folded into the softmax scale
        qscale_ref, *refs = refs
    o_ref, qo_smem, k_smem, v_smem, q_bar, k_bar, v_bar, k_free, v_free, schedule, *refs = refs
    # fp8 pools: the pages land in these tiles and the memory warpgroup converts them into the slots;
    # K only where its product runs in float16 (under fp8_qk K's pages go straight into its fp8 slots).
    convert_k, convert_v = convert and not fp8_qk, convert
    if convert_k:
        k_land, k_landed, *refs = refs
    if convert_v:
        v_land, v_landed, *refs = refs
    if has_sinks:
        sink_smem, *refs = refs
    if fp8_qk:  # each compute warpgroup's e4m3 query tile, and its rows' score multipliers
        q8_smem, qscale_smem = refs
    # meta (built in the wrapper): row, start, end of every block, the blocks in launch order, the
    # positions, the page table. Programs launch block by block (the KV heads of one block together), so
    # with the blocks longest first the long programs (a decode row at a long context beside a prefill
    # chunk, a chunk's last blocks) start in the first wave and the last wave holds the short ones.
    block = meta_ref[3 * num_blocks + lax.axis_index("block")]
    head, wg = lax.axis_index("head"), lax.axis_index("wg")
    kv_per_step = pages_per_step * page_size
    page_offset = layer_ref[0]  # the layer's first page in the [layers * pages] view of the pool
    row, start, end = meta_ref[block], meta_ref[num_blocks + block], meta_ref[2 * num_blocks + block]
    num_tokens = end - start  # 0 for an unused block
    first_pos = meta_ref[4 * num_blocks + start]
    block_rows = num_tokens * group

    def window_start(pos):  # the first step that a row at pos still sees
        return 0 if sliding_window is None else lax.div(jnp.maximum(pos - sliding_window + 1, 0), kv_per_step)

    first_step = window_start(first_pos)  # the block's steps: [first_step, num_steps)

    def wg_steps(w):
        """Warpgroup w's rows (first row, real rows) and its K/V steps: it computes [begin, end), and
        [clear_begin, clear_end) without a mask (every position of such a step is at or below its first
        row's position and inside its last row's window). A warpgroup without rows computes none."""
        r0 = w * _WG_ROWS
        rows = jnp.clip(block_rows - r0, 0, _WG_ROWS)
        low_pos, high_pos = first_pos + lax.div(r0, group), first_pos + lax.div(r0 + rows - 1, group)
        end = jnp.where(rows > 0, lax.div(high_pos + kv_per_step, kv_per_step), first_step)
        begin = jnp.where(rows > 0, window_start(low_pos), first_step)
        clear_begin = begin
        if sliding_window is not None:  # the first step wholly inside the last row's window
            clear_begin = lax.div(jnp.maximum(high_pos - sliding_window + 1, 0) + kv_per_step - 1, kv_per_step)
            clear_begin = jnp.clip(clear_begin, begin, end)
        clear_end = jnp.clip(lax.div(low_pos + 1, kv_per_step), clear_begin, end)
        return r0, rows, (begin, clear_begin, clear_end, end)

    num_steps = jnp.maximum(wg_steps(0)[2][3], wg_steps(1)[2][3])  # through the block's last row's position

    def slot_of(step):
        return lax.rem(step - first_step, num_stages)

    def schedule_barrier():
        plgpu.barrier_arrive(schedule)
        plgpu.barrier_wait(schedule)

    @pl.when(num_tokens > 0)
    def _():
        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(_REGISTERS[convert][0], action="decrease")

            def issue(step, pool_ref, dst, bar):  # TMA the step's pages of this KV head into dst
                for i in range(pages_per_step):
                    page = page_offset + meta_ref[table_base + row * table_width + step * pages_per_step + i]
                    plgpu.copy_gmem_to_smem(pool_ref.at[page, :, head], dst.at[pl.ds(i * page_size, page_size)], bar)

            def fill(step, pool_ref, slots, ready, free, land=None, landed=None):
                """The step's K or V into its slot, once both compute warpgroups have released the slot;
                through the landing tile (converted) where one is given."""
                slot = slot_of(step)

                @pl.when(step - first_step >= num_stages)
                def _():
                    plgpu.barrier_wait(free.at[slot])
                if land is None:
                    issue(step, pool_ref, slots.at[slot], ready.at[slot])
                    return
                # fp8: the landed pages converted to float16 (exact), 64 positions at a time (few registers),
                # then the next step's pages fetched into the landing tile.
                plgpu.barrier_wait(landed)
                for c in range(kv_per_step // _WG_ROWS):
                    chunk = pl.ds(c * _WG_ROWS, _WG_ROWS)
                    upcast_tile(land.at[chunk], slots.at[slot, chunk], interpreting)
                plgpu.commit_smem()  # visible to the wgmmas; the landing tile's reads ordered before its refill
                plgpu.barrier_arrive(ready.at[slot])

                @pl.when(step + 1 < num_steps)
                def _():
                    issue(step + 1, pool_ref, land, landed)

            k_landing = (k_land, k_landed) if convert_k else ()
            v_landing = (v_land, v_landed) if convert_v else ()
            for pool_ref, landing in ((k_ref, k_landing), (v_ref, v_landing)):
                if landing:
                    issue(first_step, pool_ref, *landing)

            def body(step, _):
                fill(step, k_ref, k_smem, k_bar, k_free, *k_landing)
                fill(step, v_ref, v_smem, v_bar, v_free, *v_landing)
            lax.fori_loop(first_step, num_steps, body, None)

            def drain(step, _):  # the last releases: every phase of a barrier that a thread waits on is waited
                plgpu.barrier_wait(k_free.at[slot_of(step)])
                plgpu.barrier_wait(v_free.at[slot_of(step)])
            lax.fori_loop(jnp.maximum(num_steps - num_stages, first_step), num_steps, drain, None)

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(_REGISTERS[convert][1], action="increase")
            r0, rows, (begin, clear_begin, clear_end, end) = wg_steps(wg)
            o_smem = qo_smem.at[wg]  # the output tile (and the query tile unless fp8_qk)
            q_smem = q8_smem.at[wg] if fp8_qk else o_smem
            plgpu.copy_gmem_to_smem(q_ref.at[block, head, pl.ds(r0, _WG_ROWS)], q_smem, q_bar.at[wg])
            if has_sinks:
                plgpu.copy_gmem_to_smem(sink_ref.at[head, pl.ds(r0, _WG_ROWS)], sink_smem.at[wg], q_bar.at[wg])
            if fp8_qk:
                plgpu.copy_gmem_to_smem(qscale_ref.at[head, pl.ds(r0, _WG_ROWS)], qscale_smem.at[wg], q_bar.at[wg])
            plgpu.barrier_wait(q_bar.at[wg])
            iota, tile, row_vec = wgmma_layouts(interpreting)
            shape = (_WG_ROWS, kv_per_step)
            if fp8_qk:
                row_mult = row_values(qscale_smem.at[wg], interpreting)

            def logits(s):
                """Raw scores as logits in log2 units (logits_log2); under fp8_qk each row times its
                multiplier, which holds the softmax scale (and 1 / soft_cap)."""
                if not fp8_qk:
                    return logits_log2(s, scale, soft_cap)
                s = s * lax.broadcast_in_dim(row_mult, shape, [0])
                return s if soft_cap is None else jnp.tanh(s) * (soft_cap * _LOG2E)

            def release(slot_free, slot):
                if interpreting:
                    # The interpreter's dots read the slot through the generic proxy and the TMA that
                    # refills it writes through the async proxy: ordered only across a proxy fence. On
                    # the GPU both are async-proxy accesses, ordered by the wgmma waits.
                    plgpu.commit_smem()
                plgpu.barrier_arrive(slot_free.at[slot])

            def step_body(step, carry, masked):
                acc, m, l = carry
                slot = slot_of(step)
                k_tile, v_tile = k_smem.at[slot], v_smem.at[slot]
                if interpreting:
                    q_, k_ = q_smem[...], k_tile[...]
                    if fp8_qk:  # e4m3 products are exact in float32, as the fp8 wgmma's
                        q_, k_ = q_.astype(jnp.float32), k_.astype(jnp.float32)
                    s = jnp.dot(q_, k_.T, preferred_element_type=jnp.float32)
                    schedule_barrier()
                else:
                    def qk(acc_ref):
                        plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_tile, (1, 0)))
                        schedule_barrier()
                        return acc_ref[...]  # reading the accumulator waits for the wgmma
                    s = pl.run_scoped(qk, plgpu.ACC(shape, jnp.float32))
                release(k_free, slot)
                s = logits(s)
                if masked:
                    r, c = iota(shape, 0), iota(shape, 1)
                    row_pos, kv_pos = first_pos + lax.div(r0 + r, group), step * kv_per_step + c
                    ok = (kv_pos <= row_pos) & (r < rows)
                    if sliding_window is not None:
                        ok = ok & (kv_pos > row_pos - sliding_window)
                    s = jnp.where(ok, s, _MASKED)
                m_new = jnp.maximum(m, s.max(axis=1))
                p = jnp.exp2(s - lax.broadcast_in_dim(m_new, shape, [0]))
                if masked:  # a row may see nothing of this step (before its window): no mass from it
                    p = jnp.where(ok, p, 0.0)
                alpha = jnp.exp2(m - m_new)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                l = l * alpha + p.sum(axis=1)
                p16 = p.astype(o_smem.dtype)
                acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
                plgpu.barrier_arrive(schedule)  # softmax done
                plgpu.barrier_wait(v_bar.at[slot])
                plgpu.barrier_wait(schedule)  # the other warpgroup's matmuls are issued: the tensor cores are free

                def wait_next_k():
                    @pl.when(step + 1 < end)
                    def _():
                        plgpu.barrier_wait(k_bar.at[slot_of(step + 1)])
                if interpreting:
                    acc = acc + jnp.dot(p16, v_tile[...], preferred_element_type=jnp.float32)
                    wait_next_k()
                else:
                    def pv(acc_ref):
                        plgpu.wgmma(acc_ref, p16, v_tile)
                        wait_next_k()  # while the wgmma runs
                    acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                release(v_free, slot)
                return acc, m_new, l

            def skipped(step, _):  # a step this warpgroup's rows do not see: its slots waited for and released
                slot = slot_of(step)
                plgpu.barrier_wait(k_bar.at[slot])
                plgpu.barrier_arrive(k_free.at[slot])
                schedule_barrier()
                plgpu.barrier_wait(v_bar.at[slot])
                plgpu.barrier_arrive(v_free.at[slot])
                schedule_barrier()

            head_dim = o_smem.shape[-1]
            m0, l0 = row_vec(jnp.full((_WG_ROWS,), _MASKED, jnp.float32)), row_vec(jnp.zeros((_WG_ROWS,), jnp.float32))
            if has_sinks:  # the sink column opens the softmax: m = the sink, l = exp(0), no value
                m0, l0 = row_values(sink_smem.at[wg], interpreting), row_vec(jnp.ones((_WG_ROWS,), jnp.float32))
            carry = (tile(jnp.zeros((_WG_ROWS, head_dim), jnp.float32)), m0, l0)
            pl.when(wg == 1)(schedule_barrier)  # warpgroup 0 leads
            lax.fori_loop(first_step, begin, skipped, None)

            @pl.when(begin < end)
            def _():
                plgpu.barrier_wait(k_bar.at[slot_of(begin)])
            masked_step, clear_step = (functools.partial(step_body, masked=m) for m in (True, False))
            carry = lax.fori_loop(begin, clear_begin, masked_step, carry)
            carry = lax.fori_loop(clear_begin, clear_end, clear_step, carry)
            carry = lax.fori_loop(clear_end, end, masked_step, carry)
            lax.fori_loop(end, num_steps, skipped, None)
            pl.when(wg == 0)(schedule_barrier)
            acc, _, l = carry

            @pl.when(rows > 0)
            def _():
                o_smem[...] = (acc / lax.broadcast_in_dim(jnp.maximum(l, 1e-30), acc.shape, [0])).astype(o_smem.dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem, o_ref.at[block, head, pl.ds(r0, _WG_ROWS)])
                plgpu.wait_smem_to_gmem(0)


def fp8_queries(q, num_real_tokens=None):
    """q [T, H, D] as e4m3 with one float32 scale per query head: (q8 [T, H, D], scale [H]), q ~ q8 * scale.

    A head's scale is the amax of its real tokens' values (the first num_real_tokens; all tokens if
    None) over 448, e4m3's largest value, and 1 where that amax is 0 (the head's values stay 0). The
    values are multiplied by the scale's reciprocal (computed once per head), never divided by the
    scale, and saturated at +-448: the quotient rounds differently from the product under XLA's
    rewrites, and only the product is what `scale` undoes. Each value keeps e4m3's 3 mantissa bits:
    a relative error of at most 2**-4, or 2**-10 * scale absolute below 2**-6 * scale (subnormals)."""
    num_tokens = q.shape[0]
    q32 = q.astype(jnp.float32)
    if num_real_tokens is not None:  # padding tokens do not widen the scale
        real = jnp.arange(num_tokens) < num_real_tokens
        amax = jnp.max(jnp.where(real[:, None, None], jnp.abs(q32), 0.0), axis=(0, 2), initial=0.0)
    else:
        amax = jnp.max(jnp.abs(q32), axis=(0, 2), initial=0.0)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    inv_scale = 1.0 / scale
    return to_fp8(q32 * inv_scale[None, :, None]), scale


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "soft_cap", "interpret", "kv_per_step",
                                             "num_stages", "longest_first", "fp8_qk"))
def paged_attention(q, k_cache, v_cache, layer, md: BatchMetadata, *, scale: float, sliding_window: int | None = None,
                    soft_cap: float | None = None, sinks=None, interpret: bool | None = None, kv_per_step: int = 128,
                    num_stages: int = 2, longest_first: bool = True, fp8_qk: bool = False):
    """Same contract as attention_reference.paged_attention, for the inputs `takes` accepts.

    longest_first: launch the blocks in the order of their K/V steps, most first (`launch_order`);
    False launches them in reverse (a row's later blocks before its earlier ones).
    fp8_qk (fp8 pools only): the queries quantized to e4m3 (fp8_queries: one scale per query head) and
    S = Q K^T on the fp8 tensor cores, the query scale folded into the softmax scale; the module
    docstring says what that costs in accuracy."""
    if fp8_qk and k_cache.dtype != FP8_DTYPE:
        raise ValueError(f"fp8_qk takes fp8 ({FP8_DTYPE.__name__}) pools, not {getattr(k_cache, 'dtype', type(k_cache).__name__)}")
    if not takes(q, k_cache, md, sliding_window):
        raise ValueError(f"the Mosaic GPU prefill kernel does not take q {q.dtype}{q.shape} with pools "
                         f"{getattr(k_cache, 'dtype', type(k_cache).__name__)}{k_cache.shape}, sliding_window="
                         f"{sliding_window} and {md.page_table.shape[0]} rows; use paged_attention_mosaic")
    if kv_per_step % 64 or kv_per_step > 256 or kv_per_step % k_cache.shape[2]:
        raise ValueError(f"kv_per_step={kv_per_step} must be 64, 128, 192 or 256 and a multiple of the page size")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) must be pools of one dtype")
    interpreting = pallas_mode.resolve(interpret)
    num_tokens, num_heads, head_dim = q.shape
    num_layers, num_pages, page_size, num_kv_heads, _ = k_cache.shape
    num_rows, max_pages = md.page_table.shape
    group = num_heads // num_kv_heads
    block_q = _ROWS // group  # tokens of a block
    num_blocks = -(-num_tokens // block_q) + num_rows  # each row may end in a partial block
    pages_per_step = kv_per_step // page_size
    num_steps = -(-max_pages // pages_per_step)
    table = jnp.pad(md.page_table, ((0, 0), (0, num_steps * pages_per_step - max_pages)))
    layer_offset = jnp.reshape(jnp.asarray(layer, jnp.int32) * num_pages, (1,))
    pools = [c.reshape(num_layers * num_pages, page_size, num_kv_heads, head_dim) for c in (k_cache, v_cache)]
    row, start, end = query_blocks(md.query_start, num_blocks, block_q)
    # The products' dtype: q's, but float16 over fp8 pools (as paged_attention_mosaic: e4m3 converts to
    # float16 exactly).
    dtype = jnp.float16 if k_cache.dtype == FP8_DTYPE else q.dtype
    convert = k_cache.dtype != dtype
    if fp8_qk:  # e4m3 queries; each row's multiplier: its head's scale x the softmax scale (/ soft_cap), log2 units
        q8, q_scale = fp8_queries(q, md.query_start[-1])
        q_rows = query_rows(q8, num_kv_heads, block_q, start, end, rows=_ROWS)  # [blocks, KVH, 128, D] e4m3
        fold = scale * _LOG2E if soft_cap is None else scale / soft_cap
        row_mult = (q_scale * fold).reshape(num_kv_heads, group)[:, jnp.arange(_ROWS) % group]  # [KVH, 128]
    else:
        q_rows = query_rows(q, num_kv_heads, block_q, start, end, rows=_ROWS).astype(dtype)  # [blocks, KVH, 128, D]
    positions = jnp.pad(md.positions, (0, 1))  # keeps an unused block's read in range when T = 0
    order = launch_order(positions, start, end, kv_per_step, sliding_window) if longest_first \
        else jnp.arange(num_blocks - 1, -1, -1, dtype=jnp.int32)
    meta = jnp.concatenate([row, start, end, order, positions, table.reshape(-1)])  # one aligned array (see the decode kernel)

    has_sinks = sinks is not None
    kv_tile = (num_stages, kv_per_step, head_dim)
    # K's products run in e4m3 under fp8_qk (its pages TMA'd straight into fp8 slots), else in `dtype`;
    # V's always in `dtype`.
    convert_k, convert_v = convert and not fp8_qk, convert
    # A slot is written by TMA (pages_per_step copies) or by the memory warpgroup (converted: one arrival).
    arrivals = lambda converted: 1 if converted else pages_per_step
    scratch = [
        swizzled_smem((2, _WG_ROWS, head_dim), dtype),  # each compute warpgroup's query tile (unless fp8_qk), then its output
        swizzled_smem(kv_tile, FP8_DTYPE if fp8_qk else dtype),  # K slots
        swizzled_smem(kv_tile, dtype),  # V slots
        # a warpgroup's query (with its sinks, its rows' multipliers) copied
        plgpu.Barrier(num_arrivals=1 + has_sinks + fp8_qk, num_barriers=2),
        plgpu.Barrier(num_arrivals=arrivals(convert_k), num_barriers=num_stages),  # a K slot filled
        plgpu.Barrier(num_arrivals=arrivals(convert_v), num_barriers=num_stages),  # a V slot filled
        plgpu.Barrier(num_arrivals=2, num_barriers=num_stages),  # a K slot released by both warpgroups
        plgpu.Barrier(num_arrivals=2, num_barriers=num_stages),  # a V slot released by both warpgroups
        plgpu.Barrier(num_arrivals=2),  # the schedule barrier
    ]
    for converted in (convert_k, convert_v):
        if converted:  # the pages landed (fp8), and their barrier
            scratch += [swizzled_smem(kv_tile[1:], k_cache.dtype), plgpu.Barrier(num_arrivals=pages_per_step)]
    if has_sinks:
        scratch.append(plgpu.SMEM((2, _WG_ROWS), jnp.float32))  # each compute warpgroup's rows' sink logits
    if fp8_qk:
        scratch += [swizzled_smem((2, _WG_ROWS, head_dim), FP8_DTYPE),  # each compute warpgroup's e4m3 query tile
                    plgpu.SMEM((2, _WG_ROWS), jnp.float32)]  # each compute warpgroup's rows' multipliers
    kernel = functools.partial(
        _kernel, num_blocks=num_blocks, table_base=4 * num_blocks + num_tokens + 1, table_width=table.shape[1],
        group=group, page_size=page_size, pages_per_step=pages_per_step, num_stages=num_stages, scale=scale,
        sliding_window=sliding_window, soft_cap=soft_cap, has_sinks=has_sinks, convert=convert, fp8_qk=fp8_qk,
        interpreting=interpreting)
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((num_blocks, num_kv_heads, _ROWS, head_dim), dtype),
        scratch_types=scratch,
        grid=(num_blocks, num_kv_heads),
        grid_names=("block", "head"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret_params() if interpreting else None,
        kernel_name=kernel_name("jlight_paged_prefill", pools=repr([(p.shape, p.dtype) for p in pools]),
                                q=repr((q_rows.shape, q_rows.dtype)), meta=meta.shape[0], **kernel.keywords),
    )(meta, layer_offset, q_rows, *pools, *([sink_rows(sinks, num_kv_heads, _ROWS)] if has_sinks else []),
      *([row_mult] if fp8_qk else []))

    # token t is rows (t - start) * group + [0, group) of its block
    token_block, token_offset = token_blocks(md, num_tokens, num_blocks, block_q)
    out = out[:, :, :block_q * group].reshape(num_blocks, num_kv_heads, block_q, group, head_dim)
    out = out[token_block, :, token_offset].reshape(num_tokens, num_heads, head_dim)  # [T, KVH, group, D] -> [T, H, D]
    is_real_token = jnp.arange(num_tokens) < md.query_start[-1]
    return jnp.where(is_real_token[:, None, None], out.astype(q.dtype), jnp.zeros((), q.dtype))


def launch_order(positions, start, end, kv_per_step: int, sliding_window: int | None):
    """The blocks, [num_blocks] int32, in the order their programs launch: most K/V steps first (the
    steps from the first its first row's window reaches through its last row's position), ties in block
    order, unused blocks last."""
    used = end > start
    first_pos, last_pos = positions[start], positions[jnp.maximum(end - 1, start)]
    steps = last_pos // kv_per_step + 1
    if sliding_window is not None:
        steps = steps - jnp.maximum(first_pos - sliding_window + 1, 0) // kv_per_step
    return jnp.argsort(jnp.where(used, -steps, 1), stable=True).astype(jnp.int32)
