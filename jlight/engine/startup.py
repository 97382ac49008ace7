"""An engine's start-up as its user sees it: the persistent compilation cache, how many step buckets
compile at once, and the lines that say what it is doing and what memory it planned.

Invariants:
- The compilation cache directory is the EngineConfig's (`compilation_cache_dir`, by default
  $JLIGHT_CACHE/xla; $JLIGHT_COMPILATION_CACHE_DIR overrides it, "" switches it off). JAX reads it at
  its first compile that looks for the cache, so it is set before the engine compiles anything; a
  process keeps the first directory it used.
- The memory plan names the bytes of one device (the first of the engine's): its share of the
  weights, its share of the K/V pools, and what its allocator has left (the host's available memory
  on the CPU, whose allocator keeps no statistics).
"""
from __future__ import annotations

import logging
import os

import jax

logger = logging.getLogger(__name__)


def enable_compilation_cache(path: str | None) -> None:
    """Point JAX's persistent compilation cache at `path` (None or "": leave it as it is)."""
    if not path:
        return
    try:
        if jax.config.jax_compilation_cache_dir is None:
            jax.config.update("jax_compilation_cache_dir", path)
        elif jax.config.jax_compilation_cache_dir != path:
            logger.info("compilation cache: this process already uses %s (not %s)", jax.config.jax_compilation_cache_dir, path)
    except Exception as e:  # an old or new JAX without these flags: run without the cache
        logger.warning("persistent compilation cache disabled: %s", e)


def compile_threads(requested: int | None, num_buckets: int) -> int:
    """Buckets compiled at once: `requested`, else one per CPU core, never more than there are buckets."""
    threads = requested if requested is not None else (os.cpu_count() or 1)
    return max(1, min(threads, num_buckets))


def describe_buckets(buckets) -> str:
    buckets = sorted(buckets)
    if len(buckets) == 1:
        return f"1 step bucket ({buckets[0]} tokens)"
    return f"{len(buckets)} step buckets ({', '.join(map(str, buckets))} tokens)"


def _bytes_on(device, tree) -> int:
    """Bytes of tree's arrays that live on `device` (its shards of sharded arrays)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        for shard in getattr(leaf, "addressable_shards", ()):
            if shard.device == device:
                total += shard.data.nbytes
    return total


def _host_memory_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def memory_plan(params, k_cache, v_cache, num_pages: int, page_size: int) -> str:
    """One line: the weights, the K/V pages and their bytes, and what is left, on the engine's first device."""
    leaves = jax.tree.leaves(params)
    device = next(iter(leaves[0].devices())) if leaves else jax.local_devices()[0]
    weights = _bytes_on(device, params)
    kv = _bytes_on(device, (k_cache, v_cache))
    line = (f"memory on {device.platform}:{device.id}: weights {fmt_bytes(weights)}, KV cache {num_pages - 1:,} pages of "
            f"{page_size} tokens ({(num_pages - 1) * page_size:,} tokens) = {fmt_bytes(kv)}")
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        left = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        return f"{line}, {fmt_bytes(left)} left of the {fmt_bytes(stats['bytes_limit'])} JAX manages"
    host = _host_memory_available()
    return f"{line}, {fmt_bytes(host)} of host memory left" if host is not None else line
