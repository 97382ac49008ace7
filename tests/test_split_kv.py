"""Flash-decoding's work list and combine (pallas_kernels/split_kv.py).

The work list is checked against its invariants on random ragged step ranges; the combine (the
Pallas program, interpreted here) against the XLA reference, and both against a softmax over the
whole row computed in numpy from the same scores.
"""
import numpy as np
import jax.numpy as jnp
import pytest

from jlight.pallas_kernels import split_kv


def _check_items(begin, end, num_items, min_steps, max_per_block=None):
    items = split_kv.work_items(jnp.asarray(begin, jnp.int32), jnp.asarray(end, jnp.int32), num_items,
                                min_steps=min_steps, max_items_per_block=max_per_block)
    block, first, last = (np.asarray(a) for a in items[:3])
    block_first, block_n = np.asarray(items.block_first_item), np.asarray(items.block_num_items)
    assert block.shape == (num_items,)
    sizes = last - first
    for b, (lo, hi) in enumerate(zip(begin, end)):
        mine = np.arange(block_first[b], block_first[b] + block_n[b])
        assert np.all(block[mine] == b)
        if hi <= lo:
            assert block_n[b] == 0
            continue
        # consecutive items in step order cover [lo, hi) exactly once
        assert first[mine[0]] == lo and last[mine[-1]] == hi
        assert np.all(first[mine[1:]] == last[mine[:-1]])
        assert np.all(sizes[mine] > 0)
        if max_per_block:
            assert block_n[b] <= max_per_block
    used = block_n.sum()
    assert np.all(sizes[used:] == 0) and np.all(first[used:] == 0)
    real = sizes[:used]
    # one chunk size for the whole step: every item but a block's last has it, and none is longer
    not_last = np.flatnonzero(block[:used - 1] == block[1:used]) if used > 1 else np.array([], int)
    if len(not_last):
        chunk = real[not_last[0]]
        assert np.all(real[not_last] == chunk) and np.all(real <= chunk)
    assert np.all(real >= min(min_steps, real.min(initial=min_steps)))
    return items, real


# Three random cases by default (with and without max_per_block), three more with -m extended.
@pytest.mark.parametrize("seed", [0, 1, 2] + [pytest.param(s, marks=pytest.mark.extended) for s in (3, 4, 5)])
def test_work_items_cover_every_step_once(seed):
    rng = np.random.default_rng(seed)
    num_blocks = int(rng.integers(1, 20))
    end = rng.integers(0, 300, num_blocks) * (rng.random(num_blocks) < 0.8)  # some blocks without work
    begin = np.minimum(rng.integers(0, 50, num_blocks) * (rng.random(num_blocks) < 0.3), end)  # sliding windows
    num_items = num_blocks + int(rng.integers(0, 60))
    _check_items(begin, end, num_items, min_steps=int(rng.integers(1, 4)),
                 max_per_block=int(rng.integers(1, 40)) if seed % 2 else None)


def test_batch1_long_context_spreads_over_the_grid():
    num_items = split_kv.num_work_items(8, 8)  # batch-1 decode padded to 8 tokens, 8 KV heads
    assert num_items * 8 >= 2 * 132  # the grid fills every SM twice with one row's items
    _, sizes = _check_items([0] * 8, [512] + [0] * 7, num_items, min_steps=2)  # 32k positions of one row
    assert len(sizes) >= num_items - 8  # the row takes (nearly) every item of the grid
    _, sizes = _check_items([0] * 8, [3] + [0] * 7, num_items, min_steps=2)  # a short row: few, whole chunks
    assert list(sizes) == [2, 1]


def test_equal_rows_get_equal_items():
    """Batch-16 decode at 16k context (16 rows of 256 steps of 64 positions) on the grid of 8 KV heads:
    two items of 128 steps a row, so the 256 programs are equal (one item of 241 steps and one of 15 a
    row had half of them idle: 445 us against 273 on the H200)."""
    num_items = split_kv.num_work_items(16, 8)
    _, sizes = _check_items([0] * 16, [256] * 16, num_items, min_steps=2)
    assert list(sizes) == [128] * 32
    # ragged rows: no item is longer than the total over the grid's items rounded up, plus one block's share
    _, sizes = _check_items([0] * 4, [1000, 10, 300, 0], 33, min_steps=2)
    assert sizes.max() <= -(-1310 // (33 - 3))


def test_the_rule_splits_small_decode_steps_of_any_head_count():
    for kv_heads in (1, 2, 8, 32):  # MQA to MHA: batch-1 decode (8 blocks) always gets a wave of programs
        assert split_kv.use_work_items(8, kv_heads, 32768)
        assert split_kv.num_work_items(8, kv_heads) * kv_heads >= 256
    assert not split_kv.use_work_items(64, 8, 32768) and not split_kv.use_work_items(16, 32, 32768)  # these fill the GPU as they are


def test_no_spare_items_means_one_item_a_block():
    _, sizes = _check_items([0, 0, 0], [5, 90, 7], 3, min_steps=1)
    assert list(sizes) == [5, 90, 7]
    with pytest.raises(ValueError, match="num_items=2"):
        split_kv.work_items(jnp.zeros(3, jnp.int32), jnp.ones(3, jnp.int32), 2)


def _partials(rng, items, num_blocks, kv_heads, rows, head_dim, steps):
    """Random scores and values cut into the items' (acc, l, m) (unused items NaN: never read) and the
    softmax over each whole row computed in numpy from the same scores."""
    block, first, last = (np.asarray(a) for a in items[:3])
    num_items = block.shape[0]
    begin = np.asarray(first)[np.asarray(items.block_first_item)]
    count = np.asarray(items.block_num_items)
    width = int(np.max(last)) * steps
    scores = rng.standard_normal((num_blocks, kv_heads, rows, width)) * 3
    values = rng.standard_normal((num_blocks, kv_heads, width, head_dim))
    acc = np.full((num_items, kv_heads, rows, head_dim), np.nan, np.float32)
    l = np.full((num_items, kv_heads, rows), np.nan, np.float32)
    m = np.full((num_items, kv_heads, rows), np.nan, np.float32)
    for i in range(int(count.sum())):
        b, cols = block[i], slice(first[i] * steps, last[i] * steps)
        s = scores[b, :, :, cols] * np.log2(np.e)  # log2 units, as the kernels keep m
        m[i] = s.max(-1)
        p = np.exp2(s - m[i][..., None])
        l[i], acc[i] = p.sum(-1), np.einsum("hrp,hpd->hrd", p, values[b, :, cols])
    want = np.zeros((num_blocks, kv_heads, rows, head_dim))
    for b in range(num_blocks):
        if count[b]:
            lo, hi = first[items.block_first_item[b]] * steps, last[items.block_first_item[b] + count[b] - 1] * steps
            s = scores[b, :, :, lo:hi]
            p = np.exp(s - s.max(-1, keepdims=True))
            want[b] = np.einsum("hrp,hpd->hrd", p / p.sum(-1, keepdims=True), values[b, :, lo:hi])
    return (items, jnp.asarray(acc), jnp.asarray(l), jnp.asarray(m)), want


@pytest.mark.parametrize("case", [
    # (steps a block begins and ends at, items): block 1 has none; a block of 70 items (two of the
    # kernel's 64-item loads); batch-1 decode's 8 blocks, one used, on 33 items; 5 query rows (group 5).
    ([0, 0, 0, 2], [7, 0, 3, 11], 9, 8),
    ([0, 0, 5], [140, 0, 6], 80, 8),
    ([0] * 8, [512] + [0] * 7, 33, 8),
    ([0, 3], [40, 9], 20, 5),
])
def test_combine_equals_a_softmax_over_the_whole_row(case):
    """Rows of scores cut into items: the kernel's and the reference's merge of per-item (acc, l, m)
    equal softmax(scores) @ values over the whole row."""
    begin, end, num_items, rows = case
    rng = np.random.default_rng(num_items)
    items = split_kv.work_items(jnp.asarray(begin, jnp.int32), jnp.asarray(end, jnp.int32), num_items, min_steps=2)
    assert int(np.max(np.asarray(items.block_num_items))) == {9: 3, 80: 70, 33: 32, 20: 14}[num_items]
    args, want = _partials(rng, items, len(begin), kv_heads=2, rows=rows, head_dim=64, steps=4)
    ref = np.asarray(split_kv.combine_reference(*args))
    got = np.asarray(split_kv.combine(*args, out_dtype=jnp.float32))  # compiled on a GPU, interpreted elsewhere
    np.testing.assert_allclose(ref, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
