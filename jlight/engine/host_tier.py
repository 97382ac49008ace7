"""The host-memory KV tier: pages the device's prefix cache evicts are kept in host memory and
copied back when a later prefix needs them (vLLM's CPU offloading; `kv_offloading_size` GiB).

The block manager tells the tier what happens to cached pages between two steps: `offload(page, key)`
when it evicts a page that holds a prefix key, `restore(key, page)` when a prefix match takes a
fresh device page for a key the tier holds. A key evicted since the last sync counts as held: its
page keeps its K/V until the step after the sync, so a prefix match in the same scheduling pass (one
whose own restores evicted the rest of its prefix, say) restores it instead of computing it again.
`sync(runner)`, called after scheduling and before the step's launch, turns those into copies:
  1. restores of keys copied before take their host arrays first, so this sync's offloads cannot drop them;
  2. offloads are dispatched: one gather of the evicted pages on the device, as read_page_list's arrays
     (one a page, K over V, where the pools allow; dispatched before any write into those pages, so it
     reads their old contents, the device running in dispatch order), then one asynchronous copy of all
     of them to `pinned_host` memory;
     restores of keys evicted since the last sync take those copies;
  3. restores are dispatched: one copy of all their host arrays to the device, then one scatter into
     their device pages with the pools donated (before the step that reads them).
  With `copies="in_program"` (the default) each of those copies is inside its program: the gather writes
  `pinned_host` arrays and the scatter reads them, one call each way a batch (with "device_put", one
  `jax.device_put` array a page each way besides).
A sync is a fixed number of calls a batch of pages, whatever the number of pages or layers, and touches
no page's bytes on the host: the copies run on the device's copy engines, DMA between device memory
and pinned host memory, and the host never waits for them (an array that is still being copied is
read, by a later restore, once its copy is done: the runtime orders the two).

Where the devices have no `pinned_host` memory (or `pinned=False`), a page stays a device array until
its `copy_to_host_async` is done and becomes a numpy array then (polled each sync, never waited for); a
restore before that copies it device to device.

Invariants:
- `pages` maps each key whose copy was dispatched to its page's arrays (read_page_list's form: one array
  [2, layers, 1, ...] or a (k, v) pair of leaves [layers, 1, ...]), at most `capacity` of them, in LRU
  order (a hit or a repeated offload makes a key most recent); a new offload with the tier full drops the
  least recently used key.
- Host arrays are immutable: a key's data are those of the copy that made it, whatever the tier drops
  or copies later.
- The tier is inclusive: a restored key stays, so evicting that page again copies nothing.
- Pages are batched in power-of-two counts up to `max_batch` (padding reads and writes scratch page
  0), so the copies compile once per count, ahead of time at warm-up.
- On GPUs the tier's pinned memory is taken at warm-up (`reserve`): XLA:GPU allocates `pinned_host`
  arrays from a growing pool of page-locked memory, and each time that pool grows it pins a region as
  large as all before it, a call that takes seconds at gigabytes (the host stops for it, and so does the
  step it was dispatching). Warm-up allocates the tier's whole capacity a device, chunk by chunk, and
  frees it; the pool keeps its regions, so the offloads that follow are carved out of them. A tier larger
  than that pool's limit (`XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`, 64 GiB a device by default) is refused there.
"""
from __future__ import annotations

import collections
import logging
import os
import time

import jax
import numpy as np

from jlight.engine.model_runner import padded_pages

logger = logging.getLogger(__name__)

# How pinned pages travel (HostTier's `copies`).
COPIES = ("in_program", "device_put")
# XLA:GPU's limit on each device's pool of pinned host memory, in GiB (64 unless this variable says otherwise).
HOST_POOL_LIMIT_VAR = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"


class HostTier:
    def __init__(self, capacity: int, max_batch: int, pinned: bool | None = None, reserve: bool | None = None,
                 copies: str = "in_program"):
        """`pinned`: keep pages in `pinned_host` memory (True), in numpy arrays (False), or the first where
        every device of the pools has that memory (None). `reserve`: take the tier's pinned memory at warm-up
        (True), not (False), or on GPUs (None; see the module docstring). `copies` (pinned pages): "in_program"
        has the gather write them to pinned memory, and the scatter read them from there, inside the programs
        (ModelRunner.read_page_list / write_page_list with host=True); "device_put" gathers the pages on the device
        and copies them with jax.device_put (and back the same way before the scatter)."""
        if copies not in COPIES:
            raise ValueError(f"copies={copies!r} is not one of {', '.join(COPIES)}")
        self.copies = copies
        if capacity < 1:
            raise ValueError(f"the host KV tier holds {capacity} pages; raise kv_offloading_size to hold at least one page")
        self.capacity = capacity
        self.max_batch = 1 << max(0, (max_batch - 1).bit_length())
        self.pinned = pinned
        self.reserve = reserve
        self.reserved_bytes = 0  # pinned memory taken and freed at warm-up, all devices together
        self.reserve_seconds = 0.0  # and how long that took
        self.pages: collections.OrderedDict[bytes, object] = collections.OrderedDict()
        self._offloads: list[tuple[int, bytes]] = []  # (device page, key), queued since the last sync
        self._pending: set[bytes] = set()  # their keys
        self._restores: list[tuple[int, bytes]] = []
        self._landing: collections.deque[tuple[bytes, object]] = collections.deque()  # numpy pages not landed
        self._device_shardings = None  # one page's leaves' placements on the device (read_page_list's)
        self._host_shardings = None  # and in pinned_host memory
        self.offloaded_pages = 0  # pages copied to host
        self.dropped_pages = 0  # keys the LRU dropped to make room
        self.restored_pages = 0  # pages copied back to the device

    # ---- what the block manager calls ------------------------------------------------------
    def __contains__(self, key: bytes) -> bool:
        return key in self.pages or key in self._pending

    @property
    def num_used(self) -> int:
        return len(self.pages)

    def offload(self, page: int, key: bytes) -> None:
        """`page`, holding `key`'s K/V, leaves the device cache: keep a copy (before the page is rewritten)."""
        if key in self.pages:
            self.pages.move_to_end(key)
        elif key not in self._pending:  # evicted twice before a sync: one copy
            self._offloads.append((page, key))
            self._pending.add(key)

    def restore(self, key: bytes, page: int) -> None:
        """`page` (fresh) is to hold `key`'s K/V again, before the next step reads it."""
        if key in self.pages:
            self.pages.move_to_end(key)
        self._restores.append((page, key))

    def clear(self) -> None:
        """Forget every key (the prefix cache was reset); copies in flight finish unread."""
        self.pages.clear()
        self._offloads.clear()
        self._pending.clear()
        self._restores.clear()
        self._landing.clear()

    # ---- copies ------------------------------------------------------------------------------
    def sync(self, runner) -> None:
        """Dispatch the copies queued since the last sync (see the module docstring for their order)."""
        if self._restores or self._offloads:
            self._decide_pinned(runner)
            held = {key: self.pages[key] for _, key in self._restores if key in self.pages}
            wanted = {key for _, key in self._restores if key not in held}  # evicted since the last sync
            offloads = list(self._offloads)
            self._offloads.clear()
            self._pending.clear()
            for batch in _batches(offloads, self.max_batch):
                self._dispatch_offload(runner, batch, wanted, held)
            restores = [(page, held[key]) for page, key in self._restores]
            self._restores.clear()
            for batch in _batches(restores, self.max_batch):
                self._write_restore(runner, batch)
        while self._landing and _ready(self._landing[0][1]):
            key, data = self._landing.popleft()
            if self.pages.get(key) is data:  # still held: its numpy copy (done) replaces the device arrays
                self.pages[key] = jax.tree.map(np.asarray, data)

    def _dispatch_offload(self, runner, batch: list[tuple[int, bytes]], wanted: set[bytes], held: dict) -> None:
        """Copy `batch`'s pages to the host; the copies of `wanted` keys go into `held` too (for this sync's
        restores, whatever the LRU drops meanwhile)."""
        in_program = self.pinned and self.copies == "in_program"
        per_page = runner.read_page_list(padded_pages([page for page, _ in batch]), host=in_program)[: len(batch)]
        leaves, treedef = jax.tree.flatten(per_page)
        if self._device_shardings is None:
            self._device_shardings = [a.sharding for a in jax.tree.leaves(per_page[0])]
        if self.pinned and not in_program:
            if self._host_shardings is None:
                self._host_shardings = [s.with_memory_kind("pinned_host") for s in self._device_shardings]
            leaves = jax.device_put(leaves, self._host_shardings * len(batch))
        elif not self.pinned:  # numpy pages: each lands by its own copy (in_program's are pinned_host already)
            for a in leaves:
                a.copy_to_host_async()
        for (_, key), data in zip(batch, jax.tree.unflatten(treedef, leaves)):
            if len(self.pages) >= self.capacity:
                self.pages.popitem(last=False)
                self.dropped_pages += 1
            self.pages[key] = data
            if key in wanted:
                held[key] = data
            if not self.pinned:
                self._landing.append((key, data))
            self.offloaded_pages += 1

    def _write_restore(self, runner, batch: list[tuple[int, object]]) -> None:
        pages = padded_pages([page for page, _ in batch])
        if self.pinned and self.copies == "in_program":
            data = [data for _, data in batch]
            runner.write_page_list(pages, data + data[:1] * (len(pages) - len(batch)), host=True)
            self.restored_pages += len(batch)
            return
        leaves, treedef = jax.tree.flatten([data for _, data in batch])
        on_device = jax.tree.unflatten(treedef, jax.device_put(leaves, self._device_shardings * len(batch)))
        runner.write_page_list(pages, on_device + on_device[:1] * (len(pages) - len(batch)))  # padding: scratch page 0
        self.restored_pages += len(batch)

    def _decide_pinned(self, runner) -> None:
        if self.pinned is None:
            self.pinned = all(_has_pinned_host(a) for a in jax.tree.leaves((runner.k_cache, runner.v_cache)))

    def warmup(self, runner, chunk_bytes: int = 256 << 20) -> None:
        """Compile the gather and the scatter for every batch size; take and free the tier's pinned memory
        (`reserve`), in arrays of at most chunk_bytes."""
        self._decide_pinned(runner)
        runner.warmup_page_copies(self.max_batch, kinds=("read_list_host", "write_list_host")
                                  if self.pinned and self.copies == "in_program" else ("read_list", "write_list"))
        leaves = jax.tree.leaves((runner.k_cache, runner.v_cache))
        reserve = self.reserve if self.reserve is not None else all(
            d.platform == "gpu" for a in leaves for d in a.sharding.device_set)
        if not (reserve and self.pinned):
            return
        per_device: dict = collections.Counter()  # one page's bytes on each device
        for a in jax.tree.leaves(runner.read_page_list(padded_pages([0]))[0]):
            for shard in a.addressable_shards:
                per_device[shard.device] += shard.data.nbytes
        limit_gib = int(os.environ.get(HOST_POOL_LIMIT_VAR, "64"))  # XLA:GPU's pinned pool, a device (its default)
        if max(per_device.values()) * self.capacity > limit_gib * 2**30:
            raise ValueError(f"the host KV tier needs {max(per_device.values()) * self.capacity / 2**30:.1f} GiB of "
                             f"pinned host memory a device, over XLA's pinned pool of {limit_gib} GiB; lower "
                             f"kv_offloading_size, or raise {HOST_POOL_LIMIT_VAR} in the environment before JAX starts")
        start, held, chunk = time.perf_counter(), [], np.zeros(chunk_bytes, np.uint8)
        for device, page_bytes in per_device.items():
            left = page_bytes * self.capacity
            while left > 0:
                n = min(left, chunk_bytes)
                sharding = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
                held.append(jax.device_put(chunk[:n], sharding))
                left -= n
                self.reserved_bytes += n
        jax.block_until_ready(held)
        for a in held:
            a.delete()
        self.reserve_seconds = time.perf_counter() - start
        logger.info("host KV tier: %.1f GiB of pinned memory taken in %.1f s", self.reserved_bytes / 2**30,
                    self.reserve_seconds)


def _batches(items: list, size: int):
    for i in range(0, len(items), size):
        yield items[i:i + size]


def _has_pinned_host(a) -> bool:
    return all("pinned_host" in (m.kind for m in d.addressable_memories()) for d in a.sharding.device_set)


def _ready(data) -> bool:
    return all(a.is_ready() for a in jax.tree.leaves(data))
