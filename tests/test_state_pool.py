"""engine/state_pool.py: slots handed out and given back, and the scheduler holding one per running
sequence of a hybrid model (admission takes one, finishing and preemption give it back)."""
import pytest

from jlight.engine.block_manager import BlockManager, prefix_key
from jlight.engine.sampling_params import SamplingParams
from jlight.engine.scheduler import Scheduler
from jlight.engine.sequence import Sequence
from jlight.engine.state_pool import StatePool


def test_slots_are_unique_never_zero_and_come_back():
    pool = StatePool(3)
    slots = [pool.allocate(i) for i in range(3)]
    assert sorted(slots) == [1, 2, 3] and pool.num_free_slots == 0
    with pytest.raises(RuntimeError, match="out of state slots"):
        pool.allocate(9)
    pool.release(slots[1])
    assert pool.allocate(7) == slots[1]
    pool.release(0)  # a sequence without a slot: nothing to give back
    pool.release(slots[0])
    with pytest.raises(AssertionError, match="released twice"):
        pool.release(slots[0])
    with pytest.raises(ValueError, match="max_num_seqs"):
        StatePool(0)


def test_snapshots_are_keyed_by_prefix_and_reused_least_recently_used_first():
    pool = StatePool(2, num_snapshots=2)
    assert pool.total_slots == 5 and pool.snapshot_point(35, 16) == 32 and pool.snapshot_point(32, 16) == 16
    assert pool.stop_at_snapshot(35, 16, 0, 40) == 32 and pool.stop_at_snapshot(35, 16, 32, 3) == 3
    assert pool.stop_at_snapshot(35, 16, 16, 8) == 8  # a chunk that does not cross the point keeps its length
    tokens = list(range(100))
    keys = [prefix_key(tokens, i, 16) for i in (1, 2, 3)]
    a, b = pool.snapshot_slot(keys[0]), pool.snapshot_slot(keys[2])
    assert {a, b} == {3, 4} and pool.snapshot_slot(keys[0]) == 0  # already saved
    assert pool.usable_prefix(keys) == (3, b)  # the longest saved prefix
    assert pool.usable_prefix(keys[:2]) == (1, a)  # ... and that touched keys[0]: keys[2] is now the oldest
    c = pool.snapshot_slot(keys[1])
    assert c == b and pool.usable_prefix(keys) == (2, c)
    assert StatePool(2).snapshot_point(35, 16) == 0  # no snapshot slots: no snapshots, chunks uncut


def test_scheduler_gives_each_running_sequence_a_slot_and_takes_it_back():
    pool = StatePool(3)
    sched = Scheduler(BlockManager(8, 4, enable_prefix_caching=False), max_num_seqs=3, max_num_batched_tokens=16,
                      max_model_len=64, state_pool=pool)
    seqs = [Sequence(f"r{i}", 0, list(range(3, 9)), SamplingParams(max_tokens=4), 0, 0.0) for i in range(3)]
    for s in seqs:
        sched.add(s)
    plan = sched.schedule()
    assert len(plan.rows) == 3
    held = [s.state_slot for s in seqs]
    assert 0 not in held and len(set(held)) == 3 and pool.num_free_slots == 0
    sched.preempt(seqs[2])
    assert seqs[2].state_slot == 0 and pool.num_free_slots == 1
    sched.finish(seqs[0])
    assert seqs[0].state_slot == 0 and pool.num_free_slots == 2
    plan = sched.schedule()  # the preempted sequence is re-admitted from its first token with a slot again
    row = next(r for r in plan.rows if r.seq is seqs[2])
    assert row.start == 0 and seqs[2].state_slot != 0 and seqs[2].state_slot != seqs[1].state_slot


def test_hybrid_memory_figure_counts_pages_and_state_slots(monkeypatch):
    """benchmarks/hybrid_memory.py (the BENCHMARKS figure): Qwen3-Next-80B-A3B's 12 attention layers' K/V
    (2 KV heads x 256, bf16) and its 36 DeltaNet layers' float32 state, against attention in all 48 layers."""
    import os
    import sys

    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import hybrid_memory

    hybrid, full = hybrid_memory.main(["--cache-gib", "64"])
    assert hybrid["kv_bytes_per_token"] == 12 * 2 * 2 * 256 * 2 and full["kv_bytes_per_token"] == 4 * hybrid["kv_bytes_per_token"]
    assert hybrid["state_bytes_per_sequence"] == 36 * 4 * (32 * 128 * 128 + 3 * (2 * 16 * 128 + 32 * 128))
    assert full["state_bytes_per_sequence"] == 0
    for row in (hybrid, full):  # the largest count that fits: one more sequence would not
        n, per_seq = row["concurrent_sequences"], row["bytes_per_sequence"]
        assert n * per_seq <= 64 * 2 ** 30 < (n + 1) * per_seq + row["state_bytes_per_sequence"] + 2 * per_seq // 2048
    assert hybrid["concurrent_sequences"] > 3 * full["concurrent_sequences"]
    del sys.modules["hybrid_memory"]
