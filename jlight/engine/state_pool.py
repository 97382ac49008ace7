"""Recurrent-state slots for hybrid models: one fixed-size slot per running sequence, and snapshot
slots that let the prefix cache resume the recurrent layers.

A hybrid model's recurrent layers (Mamba-2, gated DeltaNet) keep, per sequence, a state whose size
does not grow with its length: a conv window and an SSM / delta-rule state per layer, held on the
device in pools [layers, slots, ...] (jlight/core/recurrent_state.py). This module owns which slot
holds what; the step reads and writes a row's slot (BatchMetadata.state_slots).

Prefix caching: a cached KV page says nothing about the recurrent state after it, so a prefix can
be reused only up to a point whose state was saved. One snapshot a prompt is saved, at its last page
boundary before its final token (`snapshot_point`): the scheduler ends a prefill chunk there, and
the engine copies the sequence's slot into a snapshot slot keyed by the prefix key of that page
(block_manager.prefix_key, the key the page itself is cached under). A new sequence whose
cached pages reach a snapshotted key restores it into its own slot and computes only the rest: the
n > 1 samples of a request (the first sample's snapshot), a preempted sequence re-admitted, a prompt
repeated or extended past a saved prompt. The granularity is one snapshot a prompt rather than one a
page because a snapshot costs a whole slot (75 MiB at Qwen3-Next-80B's shape, 3,200 pages' worth of
its K/V); the page boundary is the finest point the KV prefix cache can serve.

Invariants:
- Slot 0 is never handed out: it is the scratch slot that padding rows read and write.
- A running sequence holds exactly one running slot from admission (`allocate`) until it finishes or
  is preempted (`release`); no two running sequences share one. There are max_num_seqs of them, so
  slots never limit the batch below max_num_seqs.
- Snapshot slots are separate; each holds the state after the prefix its key names (keys are
  content hashes, so a snapshot never goes stale); they are reused least recently used first.
- A slot's content is never cleared: a sequence that starts at position 0 starts from a zero state in
  the kernels themselves (pallas_kernels/ragged_scan.py); one that starts later was restored first.
- Device copies into and out of slots are enqueued between steps, in host order, so a snapshot is
  taken after the step that wrote it and a restore lands before the step that reads it.
- All slots' bytes come out of the same memory budget as the KV pages (`bytes_for`).
"""
from __future__ import annotations

import collections

from jlight.core.recurrent_state import state_bytes_per_slot


class StatePool:
    def __init__(self, max_num_seqs: int, num_snapshots: int = 0):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs} must be >= 1")
        self.num_slots = max_num_seqs + 1  # running slots and the scratch slot
        self.num_snapshots = num_snapshots
        self.free_slots = collections.deque(range(1, self.num_slots))
        self.owner: dict[int, int] = {}  # running slot -> seq_id
        self.free_snapshot_slots = collections.deque(range(self.num_slots, self.num_slots + num_snapshots))
        self.snapshots: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # prefix key -> slot, LRU first

    @property
    def total_slots(self) -> int:
        """Slots of the device pools: scratch, running, snapshots."""
        return self.num_slots + self.num_snapshots

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

    # ---- snapshots (prefix caching) ------------------------------------------------------
    def snapshot_point(self, prompt_len: int, page_size: int) -> int:
        """The position after which a prompt's state is saved: its last page boundary before its final
        token (the longest prefix the KV cache can give another sequence); 0 = none."""
        return (prompt_len - 1) // page_size * page_size if self.num_snapshots else 0

    def stop_at_snapshot(self, prompt_len: int, page_size: int, start: int, n: int) -> int:
        """A chunk of n tokens from `start`, cut so that it ends at the snapshot point if it would cross it."""
        point = self.snapshot_point(prompt_len, page_size)
        return point - start if start < point < start + n else n

    def usable_prefix(self, keys: list[bytes]) -> tuple[int, int]:
        """(k, slot): the most leading cached pages whose state is saved (the snapshot in `slot`), or (0, 0)."""
        for k in range(len(keys), 0, -1):
            slot = self.snapshots.get(keys[k - 1])
            if slot is not None:
                self.snapshots.move_to_end(keys[k - 1])
                return k, slot
        return 0, 0

    def snapshot_slot(self, key: bytes) -> int:
        """A slot to save the state after prefix `key` in (the least recently used one if none is free);
        0 when it is already saved or there are no snapshot slots."""
        if key in self.snapshots or not self.num_snapshots:
            return 0
        slot = self.free_snapshot_slots.popleft() if self.free_snapshot_slots else self.snapshots.popitem(last=False)[1]
        self.snapshots[key] = slot
        return slot


def bytes_for(state_shapes_fn, config, num_slots: int) -> int:
    """Bytes of all the state pools of `num_slots` slots (StatePool.total_slots)."""
    return num_slots * state_bytes_per_slot(state_shapes_fn(config, 1))
