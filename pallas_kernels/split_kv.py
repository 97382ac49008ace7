"""Flash-decoding: a step's attention work cut into items that fill the GPU, and the combine.

A decode step of few sequences has too few (query block, KV head) pairs to occupy the GPU's
SMs: batch 1 of a model with 8 KV heads is 8 programs. So each query block's K/V steps (runs of
`kv_per_step` positions) are cut into chunks, one *work item* each, and each item runs as its
own program per KV head. Items write unnormalised softmax states (acc, l, m); `combine` merges
a block's items into its output.

Invariants of the work list (`work_items`), all computed on the device from the batch:
- There are exactly `num_items` items (static); items of one block are consecutive and in step
  order; item i covers steps [first_step[i], last_step[i]) of block block[i].
- Every step a block needs is covered by exactly one item; a block with no steps (an unused
  block, padding) has no item; items past the last used one are empty (first == last == 0,
  block 0) and nothing reads their output.
- The chunk (steps per item) is one number for the whole step: the smallest of the candidates
  ceil(total steps / k), k = num_items down to num_items - blocks, that keeps the item count
  within `num_items` and each block's within `max_items_per_block`, and at least `min_steps`.
  So a long context spreads over as many programs as the grid offers, a short one is not cut
  into items cheaper than their fixed cost, and the items are of nearly equal size whatever
  the contexts: 16 rows of 256 steps on 33 items get two items of 128 steps each, not one of
  241 and one of 15 (a grid whose long items run one program per SM).

The cost rule sizes the grid from static shapes only (`num_work_items`): one wave of programs,
PROGRAMS_PER_SM on every SM, even when one block holds all the work (batch 1); more items than
one wave would leave a second, partial wave (measured on the H200: batch-1 decode at 32k context
took 73 us with 41 items of 8 KV heads, 1.2 waves). Steps whose blocks alone make more than a wave
run without items, and so do steps whose page table spans at most SHORT_SPAN positions: there a
block's few programs are done before the combine, one more launch a layer, pays for itself
(`use_work_items`). A caller that knows its rows' contexts can hand such steps a table that narrow
(`short_span`; the engine's runner compiles those buckets twice).
"""
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from jlight.pallas_kernels import pallas_mode
from jlight.pallas_kernels.tiling import NUM_SMS, next_pow2

PROGRAMS_PER_SM = 2  # the attention kernels keep two programs resident per SM


class WorkItems(NamedTuple):
    block: jax.Array  # [num_items] int32, the query block each item belongs to (0 for an empty item)
    first_step: jax.Array  # [num_items] int32, the item's first K/V step
    last_step: jax.Array  # [num_items] int32, one past its last step (== first_step: empty)
    block_first_item: jax.Array  # [num_blocks] int32, index of each block's first item
    block_num_items: jax.Array  # [num_blocks] int32, items of each block (0: no work)


def num_work_items(num_blocks: int, num_kv_heads: int) -> int:
    """The static grid size: the items whose num_kv_heads programs each make one wave of
    PROGRAMS_PER_SM programs on every SM (and at least one item per block)."""
    return max(num_blocks, PROGRAMS_PER_SM * NUM_SMS // num_kv_heads)


# The widest page table (in positions) whose steps run without work items. On the H200 batch-1 decode at 128
# tokens of context took 4.715 ms a step with work items and 4.599 without (the combine: 3.6 us a layer),
# while at 1k and beyond the items win by far (docs/BENCHMARKS.md).
SHORT_SPAN = 512


def fills_one_wave(num_blocks: int, num_kv_heads: int) -> bool:
    """Whether a step's (block, KV head) programs fit in one wave of the grid."""
    return num_blocks * num_kv_heads <= PROGRAMS_PER_SM * NUM_SMS


def use_work_items(num_blocks: int, num_kv_heads: int, span: int) -> bool:
    """Whether a decode step's blocks get their contexts split: their (block, KV head) programs fit in one
    wave (the smallest bucket's blocks are mostly padding: batch 1 runs 8), and its page table spans more
    than SHORT_SPAN positions."""
    return fills_one_wave(num_blocks, num_kv_heads) and span > SHORT_SPAN


def short_span(num_blocks: int, num_kv_heads: int) -> int:
    """The page-table span (positions) at or under which a decode step of num_blocks one-token blocks runs
    without work items, where that spares it the combine; 0 where it never takes items."""
    return SHORT_SPAN if fills_one_wave(num_blocks, num_kv_heads) else 0


def work_items(step_begin, step_end, num_items: int, *, min_steps: int = 2, max_items_per_block: int | None = None) -> WorkItems:
    """Cut each block's steps [step_begin[b], step_end[b]) into chunks of one common size.

    step_begin, step_end: [num_blocks] int32 (equal for a block with no work).
    """
    num_blocks = step_begin.shape[0]
    if num_items < num_blocks:
        raise ValueError(f"num_items={num_items} must be >= the {num_blocks} query blocks")
    max_per_block = max_items_per_block or num_items
    steps = jnp.maximum(step_end - step_begin, 0)  # [NB]
    used = steps > 0
    total = jnp.sum(steps)
    # Candidate chunks, smallest first: total / k for k = num_items .. num_items - NB items. The last
    # always fits: sum(ceil(s / c)) <= total / c + used <= num_items for k = num_items - used.
    k = jnp.maximum(num_items - jnp.arange(num_blocks + 1, dtype=jnp.int32), 1)  # [NB + 1]
    floor = jnp.maximum(min_steps, -(-jnp.max(steps) // max_per_block))
    candidates = jnp.maximum(-(-total // k), floor)  # [NB + 1]
    counts = jnp.sum(jnp.where(used[None, :], -(-steps[None, :] // candidates[:, None]), 0), axis=1)
    chunk = jnp.min(jnp.where(counts <= num_items, candidates, jnp.maximum(jnp.max(steps), 1)))
    n = jnp.where(used, -(-steps // chunk), 0).astype(jnp.int32)  # [NB]
    cu = jnp.cumsum(n)  # inclusive
    first_item = (cu - n).astype(jnp.int32)
    item = jnp.arange(num_items, dtype=jnp.int32)
    real = item < cu[-1]
    # compare_all: the default method is a while loop, which XLA:GPU drives from the host.
    block = jnp.minimum(jnp.searchsorted(cu, item, side="right", method="compare_all"), num_blocks - 1).astype(jnp.int32)
    k = item - first_item[block]
    first = step_begin[block] + k * chunk
    last = jnp.minimum(first + chunk, step_end[block])
    zero = jnp.zeros_like(item)
    return WorkItems(jnp.where(real, block, zero), jnp.where(real, first, zero).astype(jnp.int32),
                     jnp.where(real, last, zero).astype(jnp.int32), first_item, n)


def combine_reference(items: WorkItems, acc, l, m):
    """Merge each block's items: acc [num_items, ..., D] float32, l and m [num_items, ...] (m in
    log2 units, as the kernels keep it) -> [num_blocks, ..., D] float32 (zeros for a block with
    no items)."""
    num_items = acc.shape[0]
    item = jnp.arange(num_items)
    first, count = items.block_first_item, items.block_num_items
    mine = (item[None, :] >= first[:, None]) & (item[None, :] < (first + count)[:, None])  # [NB, P]
    extra = (1,) * (m.ndim - 1)
    mine_m = mine.reshape(mine.shape + extra)
    m_max = jnp.max(jnp.where(mine_m, m[None], -jnp.inf), axis=1)  # [NB, ...]
    w = jnp.exp2(m[None] - jnp.where(jnp.isfinite(m_max), m_max, 0.0)[:, None])  # [NB, P, ...]
    # items outside the block (unused ones may hold anything, NaN included) contribute nothing
    l_sum = jnp.sum(jnp.where(mine_m, w * l[None], 0.0), axis=1)
    acc_sum = jnp.sum(jnp.where(mine_m[..., None], w[..., None] * acc[None], 0.0), axis=1)
    return acc_sum / jnp.maximum(l_sum, 1e-30)[..., None]


# Items a combine program reads with one load: a batch-1 step's 33 items (8 KV heads) in one round trip.
_COMBINE_CHUNK = 64


def _combine_kernel(first_ref, count_ref, acc_ref, l_ref, m_ref, o_ref, *, chunk):
    """One (block, KV head, query row): its block's items, `chunk` of them per load, merged online."""
    block, head, row = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    first, count = first_ref[block], count_ref[block]
    head_dim = o_ref.shape[-1]

    def body(c, carry):
        m, l, acc = carry
        mine = c * chunk + jnp.arange(chunk) < count  # [chunk]
        items = pl.ds(first + c * chunk, chunk)
        mi = pltr.load(m_ref.at[items, head, row], mask=mine, other=-1e30)
        li = pltr.load(l_ref.at[items, head, row], mask=mine, other=0.0)
        ai = pltr.load(acc_ref.at[items, head, row, :], mask=mine[:, None], other=0.0)  # [chunk, D]
        m_new = jnp.maximum(m, jnp.max(mi))
        w = jnp.where(mine, jnp.exp2(mi - m_new), 0.0)
        a = jnp.exp2(m - m_new)
        return m_new, l * a + jnp.sum(w * li), acc * a + jnp.sum(w[:, None] * ai, axis=0)

    init = (jnp.float32(-1e30), jnp.float32(0.0), jnp.zeros((head_dim,), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, (count + chunk - 1) // chunk, body, init)
    pltr.store(o_ref.at[block, head, row, :], (acc / jnp.maximum(l, 1e-30)).astype(o_ref.dtype))


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret"))
def combine(items: WorkItems, acc, l, m, *, out_dtype, interpret: bool | None = None):
    """combine_reference as one Pallas (Triton) program per (block, KV head, query row), reading only the
    block's items, up to _COMBINE_CHUNK of them per load (loads one after another would make the merge of
    a batch-1 step's 33 items 33 memory round trips long: 18 us a layer on the H200):
    acc [num_items, KVH, rows, D], l and m [num_items, KVH, rows] -> [num_blocks, KVH, rows, D]."""
    num_items, num_kv_heads, rows, head_dim = acc.shape
    if head_dim != next_pow2(head_dim):
        raise ValueError(f"combine needs a power-of-two head_dim, got {head_dim}")
    num_blocks = items.block_first_item.shape[0]
    chunk = min(_COMBINE_CHUNK, next_pow2(num_items))
    full = lambda shape: pl.BlockSpec(shape, lambda b, h, r: (0,) * len(shape))
    return pl.pallas_call(
        functools.partial(_combine_kernel, chunk=chunk),
        grid=(num_blocks, num_kv_heads, rows),
        in_specs=[full((num_blocks,)), full((num_blocks,)), full(acc.shape), full(l.shape), full(m.shape)],
        out_specs=full((num_blocks, num_kv_heads, rows, head_dim)),
        out_shape=jax.ShapeDtypeStruct((num_blocks, num_kv_heads, rows, head_dim), out_dtype),
        interpret=pallas_mode.resolve(interpret),
        compiler_params=pltr.CompilerParams(num_warps=4, num_stages=1),
        name="split_kv_combine",
    )(items.block_first_item, items.block_num_items, acc, l, m)
