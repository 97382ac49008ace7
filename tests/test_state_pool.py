"""engine/state_pool.py: slots handed out and given back, and the scheduler holding one per running
sequence of a hybrid model (admission takes one, finishing and preemption give it back)."""
import pytest

from jlight.engine.block_manager import BlockManager
from jlight.engine.sampling_params import SamplingParams
from jlight.engine.scheduler import Scheduler
from jlight.engine.sequence import Sequence
from jlight.engine.state_pool import StatePool, num_state_slots


def test_slots_are_unique_never_zero_and_come_back():
    pool = StatePool(4)
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
    with pytest.raises(ValueError, match="num_slots"):
        StatePool(1)


def test_scheduler_gives_each_running_sequence_a_slot_and_takes_it_back():
    pool = StatePool(num_state_slots(3))
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
