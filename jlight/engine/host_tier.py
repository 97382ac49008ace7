"""The host-memory KV tier: pages the device's prefix cache evicts are kept in host memory and
copied back when a later prefix needs them (vLLM's CPU offloading; `kv_offloading_size` GiB).

The block manager tells the tier what happens to cached pages between two steps: `offload(page, key)`
when it evicts a page that holds a prefix key, `restore(key, page)` when a prefix match takes a
fresh device page for a key the tier holds. `sync(runner)`, called after scheduling and before the
step's launch, turns those into copies:
  1. restores' data are read out of the host pool (into a staging array) first, so the slots they
     read cannot be taken by this sync's offloads;
  2. offloads are dispatched: one gather of the evicted pages on the device (dispatched before any
     write into those pages, so it reads their old contents, the device running in dispatch order)
     and an asynchronous copy to host memory (`pinned_host` memory where the platform has it, else
     `copy_to_host_async`);
  3. restores are written into their device pages (a scatter dispatched before the step that reads them).
The host never waits for the device here: a copy to host lands in the pool when it is ready (polled
each sync, first issued first landed), or when a restore needs its data.

Invariants:
- The pool holds `capacity` pages. `slot_of` maps each key whose copy was dispatched to its slot, in
  LRU order (a hit or a repeated offload makes a key most recent); a new offload with no free slot
  takes the least recently used key's slot.
- The tier is inclusive: a restored key stays in the pool, so evicting that page again copies nothing.
- A slot's data are those of the last copy into it: copies land in the order they were issued, and a
  restore first lands every copy up to the last one into its slot.
- Pages are batched in power-of-two counts up to `max_batch` (padding reads and writes scratch page
  0), so the copies compile once per count, ahead of time at warm-up.
"""
from __future__ import annotations

import collections
import dataclasses

import jax
import numpy as np

from jlight.engine.model_runner import padded_pages


@dataclasses.dataclass
class _Copy:
    """One dispatched device->host copy: its arrays (read_pages' form) and the slot of each real page."""
    data: object
    slots: list[int]
    number: int


class HostTier:
    def __init__(self, capacity: int, max_batch: int):
        if capacity < 1:
            raise ValueError(f"the host KV tier holds {capacity} pages; raise kv_offloading_size to hold at least one page")
        self.capacity = capacity
        self.max_batch = 1 << max(0, (max_batch - 1).bit_length())
        self.slot_of: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self.free_slots = list(range(capacity - 1, -1, -1))
        self.pool = None  # (k, v) pytrees of numpy arrays [layers, capacity, ...], made at the first sync
        self._offloads: list[tuple[int, bytes]] = []  # (device page, key), queued since the last sync
        self._restores: list[tuple[int, bytes]] = []
        self._copies: collections.deque[_Copy] = collections.deque()  # dispatched, not landed, oldest first
        self._last_copy_into: dict[int, int] = {}  # slot -> number of the last copy into it that has not landed
        self._copy_number = 0
        self.offloaded_pages = 0  # pages copied to host
        self.dropped_pages = 0  # keys the LRU dropped to make room
        self.restored_pages = 0  # pages copied back to the device

    # ---- what the block manager calls ------------------------------------------------------
    def __contains__(self, key: bytes) -> bool:
        return key in self.slot_of

    @property
    def num_used(self) -> int:
        return len(self.slot_of)

    def offload(self, page: int, key: bytes) -> None:
        """`page`, holding `key`'s K/V, leaves the device cache: keep a copy (before the page is rewritten)."""
        if key in self.slot_of:
            self.slot_of.move_to_end(key)
        else:
            self._offloads.append((page, key))

    def restore(self, key: bytes, page: int) -> None:
        """`page` (fresh) is to hold `key`'s K/V again, before the next step reads it."""
        self.slot_of.move_to_end(key)
        self._restores.append((page, key))

    def clear(self) -> None:
        """Forget every key (the prefix cache was reset); copies in flight land in free slots."""
        self.slot_of.clear()
        self.free_slots = list(range(self.capacity - 1, -1, -1))
        self._offloads.clear()
        self._restores.clear()

    # ---- copies ------------------------------------------------------------------------------
    def sync(self, runner) -> None:
        """Dispatch the copies queued since the last sync (see the module docstring for their order)."""
        if self._restores or self._offloads:
            if self.pool is None:
                self.pool = jax.tree.map(lambda a: np.zeros((a.shape[0], self.capacity) + a.shape[2:], a.dtype),
                                         runner.read_pages(np.zeros(1, np.int32)))
            restores = [(page, self._read_slot(self.slot_of[key])) for page, key in self._restores]
            self._restores.clear()
            for batch in _batches(self._offloads, self.max_batch):
                self._dispatch_offload(runner, batch)
            self._offloads.clear()
            for batch in _batches(restores, self.max_batch):
                self._write_restore(runner, batch)
        while self._copies and _ready(self._copies[0].data):
            self._land()

    def _dispatch_offload(self, runner, batch: list[tuple[int, bytes]]) -> None:
        pages = padded_pages([page for page, _ in batch])
        data = runner.read_pages(pages)
        slots = []
        for _, key in batch:
            if key in self.slot_of:  # evicted twice before a sync: one copy
                self.slot_of.move_to_end(key)
                slots.append(-1)
                continue
            if not self.free_slots:
                _, slot = self.slot_of.popitem(last=False)
                self.free_slots.append(slot)
                self.dropped_pages += 1
            slot = self.free_slots.pop()
            self.slot_of[key] = slot
            self._last_copy_into[slot] = self._copy_number
            slots.append(slot)
            self.offloaded_pages += 1
        self._copies.append(_Copy(_to_host(data), slots, self._copy_number))
        self._copy_number += 1

    def _land(self) -> None:
        """The oldest copy's data into its slots (waits for it if it is still running)."""
        copy = self._copies.popleft()
        real = [(i, s) for i, s in enumerate(copy.slots) if s >= 0]
        index, slots = np.asarray([i for i, _ in real], np.int64), np.asarray([s for _, s in real], np.int64)

        def put(host, arrived):
            if host is not None:
                host[:, slots] = np.asarray(arrived)[:, index]
        jax.tree.map(put, self.pool, copy.data, is_leaf=lambda x: x is None)
        for s in slots.tolist():
            if self._last_copy_into.get(s) == copy.number:
                del self._last_copy_into[s]

    def _read_slot(self, slot: int):
        while slot in self._last_copy_into:
            self._land()
        return jax.tree.map(lambda host: None if host is None else host[:, slot], self.pool, is_leaf=lambda x: x is None)

    def _write_restore(self, runner, batch: list[tuple[int, object]]) -> None:
        pages = padded_pages([page for page, _ in batch])
        n = len(pages)

        def stack(*per_page):
            if per_page[0] is None:
                return None
            out = np.zeros((per_page[0].shape[0], n) + per_page[0].shape[1:], per_page[0].dtype)
            out[:, : len(per_page)] = np.stack(per_page, axis=1)
            return out
        host = jax.tree.map(stack, *[data for _, data in batch], is_leaf=lambda x: x is None)
        on_device = jax.tree.map(_put_like, host, (runner.k_cache, runner.v_cache), is_leaf=lambda x: x is None)
        runner.write_pages(pages, on_device)
        self.restored_pages += len(batch)

    def warmup(self, runner) -> None:
        """Compile the gather and the scatter for every batch size."""
        runner.warmup_page_copies(self.max_batch)


def _batches(items: list, size: int):
    for i in range(0, len(items), size):
        yield items[i:i + size]


def _put_like(host, pool):
    """A host array onto the pool's placement: its sharding if the pool is committed, else uncommitted on the
    pool's device (a committed output would be another jit cache key for the step: a compile)."""
    if host is None:
        return None
    if pool.committed:
        return jax.device_put(host, pool.sharding)
    with jax.default_device(next(iter(pool.devices()))):
        return jax.device_put(host)


def _to_host(data):
    """Start copying device arrays to host memory without waiting: into pinned host memory where the
    devices have it (the returned arrays live there), else by copy_to_host_async (the same arrays)."""
    def start(a):
        if a is None:
            return None
        if all("pinned_host" in (m.kind for m in d.addressable_memories()) for d in a.sharding.device_set):
            return jax.device_put(a, a.sharding.with_memory_kind("pinned_host"))
        a.copy_to_host_async()
        return a
    return jax.tree.map(start, data, is_leaf=lambda x: x is None)


def _ready(data) -> bool:
    return all(a.is_ready() for a in jax.tree.leaves(data))
