"""Recurrent-state slots for hybrid models: one fixed-size slot per running sequence.

A hybrid model's recurrent layers (Mamba-2, gated DeltaNet) keep, per sequence, a state whose size
does not grow with its length: a conv window and an SSM / delta-rule state per layer, held on the
device in pools [layers, slots, ...] (jlight/core/recurrent_state.py). This module owns which slot
belongs to which sequence; the step reads and writes a row's slot (BatchMetadata.state_slots).

Invariants:
- Slot 0 is never handed out: it is the scratch slot that padding rows read and write.
- A sequence holds exactly one slot from admission (`allocate`) until it finishes or is preempted
  (`release`); no two running sequences share a slot. The scheduler admits a sequence only with a
  free slot.
- A slot's content is never cleared: a sequence that starts at position 0 (a new one, or one
  preempted and recomputed from its first token, as KV pages are) starts from a zero state in the
  kernels themselves (pallas_kernels/ragged_scan.py), whatever its slot holds.
- There are max_num_seqs + 1 slots, so the slots never limit the batch below max_num_seqs; their
  bytes come out of the same memory budget as the KV pages (`bytes_for`).
- A freed slot may be handed out while the step that last wrote it still runs: the device runs
  steps in order, and its next owner starts at position 0, so it never reads what was left there.
"""
from __future__ import annotations

import collections

from jlight.core.recurrent_state import state_bytes_per_slot


class StatePool:
    def __init__(self, num_slots: int):
        if num_slots < 2:
            raise ValueError(f"num_slots={num_slots} is too small: need at least 2 (slot 0 is reserved)")
        self.num_slots = num_slots
        self.free_slots = collections.deque(range(1, num_slots))
        self.owner: dict[int, int] = {}  # slot -> seq_id

    @property
    def num_free_slots(self) -> int:
        return len(self.free_slots)

    def allocate(self, seq_id: int) -> int:
        if not self.free_slots:
            raise RuntimeError(f"out of state slots: all {self.num_slots - 1} are held")
        slot = self.free_slots.popleft()
        self.owner[slot] = seq_id
        return slot

    def release(self, slot: int) -> None:
        """Give back a sequence's slot (0, a sequence without one, is ignored)."""
        if slot == 0:
            return
        assert slot in self.owner, f"state slot {slot} released twice"
        del self.owner[slot]
        self.free_slots.append(slot)


def num_state_slots(max_num_seqs: int) -> int:
    """Slots for max_num_seqs running sequences plus the scratch slot."""
    return max_num_seqs + 1


def bytes_for(state_shapes_fn, config, max_num_seqs: int) -> int:
    """Bytes of all the state pools of an engine running up to max_num_seqs sequences."""
    return num_state_slots(max_num_seqs) * state_bytes_per_slot(state_shapes_fn(config, 1))
