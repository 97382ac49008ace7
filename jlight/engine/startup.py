"""An engine's set-up apart from its step loop: the persistent compilation cache and the compiled-step
store, the options a hybrid model refuses, the KV pool's size and the host tier's, how many step
buckets compile at once, and the lines that say what it is doing and what memory it planned.

Invariants:
- The compilation cache directory is the EngineConfig's (`compilation_cache_dir`, by default
  $JLIGHT_CACHE/xla; $JLIGHT_COMPILATION_CACHE_DIR overrides it, "" switches it off). JAX reads it at
  its first compile that looks for the cache, so it is set before the engine compiles anything; a
  process keeps the first directory it used.
- The KV pool holds, on a device whose allocator reports its memory, the share of it the config gives
  (`pages_for_memory`: P0 pages); on the CPU, what max_num_seqs full-length sequences need, within 2 GiB. A
  hybrid model's recurrent-state pools come out of the same budget first.
- gpu_memory_utilization is a share of the whole card (vLLM's meaning), whereas JAX's allocator manages
  XLA_PYTHON_CLIENT_MEM_FRACTION of it (75% unless set) from the moment its backend starts. So an engine
  created before JAX's backend, given gpu_memory_utilization with that variable unset, sets the variable to
  it (`claim_device_memory`); the budget is that share of the card (`device_memory_stats`' card_bytes: the
  allocator's limit over the share it was started with), never more than the allocator's limit (logged).
- On such a device the pool also leaves room for the largest step (`pages_beside_step`): the engine compiles its
  step buckets (all of them when it warms up with kv_cache_memory_fraction, else the largest: a pool of
  gpu_memory_utilization is the whole budget and always shrinks) against a pool of P0 pages before allocating it,
  and XLA's memory analysis says what the largest step needs beyond its inputs (`step_memory_bytes`: temporaries,
  generated code, outputs not aliased to the donated pools). Then in use (the weights) + recurrent state + pool +
  step + margin (`step_margin`: 5% of the step, at least 256 MiB; it also covers the runner's small buffers, the
  token history and masks) stays within the budget: bytes_limit, or gpu_memory_utilization of it; and recurrent
  state + pool + step + margin fit the allocator's largest free block where it reports one (`largest_free_block`:
  free memory split between the weights holds neither). The pool keeps P0 pages when they fit (the compiled buckets
  are kept: no second compile), else it shrinks to what fits and they compile again at that size; a pool shrunk
  below one max_model_len sequence is an error naming the knobs. Where the memory analysis is unavailable, the pool
  keeps P0 pages (logged). A pool of num_pages given by the user is never measured.
- A start keeps a size the last start of the same engine chose when near its own (the sizes kept in the
  compiled-step store's manifest): the pool's shape is in every stored step's key, and what is in use moves from
  start to start. P0 lands on one within POOL_SETTLE_BYTES and POOL_SETTLE_FRACTION of it (`settled_pages`; the
  share's headroom covers the difference). A pool shrunk for the step's room sits room_reserve below that room, or
  on a last size within that reserve of it and never above the room (`settled_below_room`): the step's room is
  not headroom.
- The memory plan names the bytes of one device (the first of the engine's): its share of the
  weights, its share of the K/V pools, and what its allocator has left (the host's available memory
  on the CPU, whose allocator keeps no statistics).
"""
from __future__ import annotations

import dataclasses
import logging
import os

import jax
from jax._src import config as jax_config  # persistent_cache_min_compile_time_secs as a thread-local context; private in jax 0.10/0.11
from jax._src import xla_bridge  # backends_are_initialized: private in jax 0.10/0.11

from jlight.core.gguf_weights import GGUF_WEIGHTS
from jlight.engine import kv_groups
from jlight.engine.executable_store import ExecutableStore, Prefetch
from jlight.engine.host_tier import HostTier

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


def small_programs_cached():
    """A context (this thread's) in which JAX's persistent cache keeps every program compiled, whatever its
    compile time. A start compiles a dozen or more small programs (zeroed pools and buffers, casts, fused
    projections' concatenations), each far under the cache's 1 s floor, so none was stored and every start
    compiled them all again; in this context a start after the first reads them. The executable store's steps
    keep their own context (not written to this cache)."""
    return jax_config.persistent_cache_min_compile_time_secs(0.0)


def compile_threads(requested: int | None, num_steps: int) -> int:
    """Steps compiled at once: `requested`, else one per CPU core, never more than the num_steps to compile (a
    bucket's step variants each count: ModelRunner.num_step_variants)."""
    threads = requested if requested is not None else (os.cpu_count() or 1)
    return max(1, min(threads, num_steps))


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
    kept = sum(isinstance(w, GGUF_WEIGHTS) for w in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, GGUF_WEIGHTS)))
    weights_text = fmt_bytes(weights) + (f" ({kept} linear weights in the GGUF's own blocks)" if kept else "")
    line = (f"memory on {device.platform}:{device.id}: weights {weights_text}, KV cache {num_pages - 1:,} pages of "
            f"{page_size} tokens ({(num_pages - 1) * page_size:,} tokens) = {fmt_bytes(kv)}")
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        left = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        return f"{line}, {fmt_bytes(left)} left of the {fmt_bytes(stats['bytes_limit'])} JAX manages"
    host = _host_memory_available()
    return f"{line}, {fmt_bytes(host)} of host memory left" if host is not None else line


def check_hybrid(cfg, architecture: str) -> None:
    """Refuse what a hybrid model's engine does not do yet, naming the option."""
    if cfg.mesh and cfg.collective_matmul:
        raise ValueError(f"collective_matmul: {architecture}'s recurrent layers read every token of "
                         "the step, which sequence parallelism splits over tp; drop collective_matmul")
    if cfg.speculative_config:
        raise ValueError(f"speculative_config: {architecture}'s recurrent state cannot take back "
                         "rejected drafts; drop speculative_config")
    if cfg.kv_offloading_size:
        raise ValueError(f"kv_offloading_size: the host tier holds K/V pages, not {architecture}'s "
                         "recurrent state; leave it unset")


# EngineConfig fields that decide only how and when a start compiles, never what: the store's key holds them at
# these values, so `jlight generate` (which compiles its request's buckets) and `jlight chat` (every bucket at start)
# share their steps.
START_ONLY_FIELDS = dict(warmup=True, compile_threads=None, store_executables=True, compilation_cache_dir=None)


def executable_store(cfg, model_config, prefetch: Prefetch | None = None) -> ExecutableStore | None:
    """The compiled-step store under the compilation cache, keyed by the engine's whole configuration but for
    START_ONLY_FIELDS; prefetch: prefetch_executables(cfg)'s."""
    if not (cfg.store_executables and cfg.compilation_cache_dir):
        return None
    program = dataclasses.replace(cfg, **START_ONLY_FIELDS)
    return ExecutableStore(os.path.join(cfg.compilation_cache_dir, "executables"), repr((program, model_config)),
                           prefetch=prefetch)


def prefetch_executables(cfg, model_config=None) -> Prefetch | None:
    """For an engine that warms up every bucket with the store on: the steps its last start used, loading
    from now on while the weights load (executable_store.Prefetch), on compile_threads' threads. model_config:
    a LoadedModel's, where the engine is given one (cfg.model then names none, and engines of different models
    must not share a manifest)."""
    if not (cfg.store_executables and cfg.compilation_cache_dir and cfg.warmup):
        return None
    engine = repr(dataclasses.replace(cfg, **START_ONLY_FIELDS)) + ("" if model_config is None else f"\n{model_config!r}")
    prefetch = Prefetch(os.path.join(cfg.compilation_cache_dir, "executables"), engine,
                        compile_threads(cfg.compile_threads, os.cpu_count() or 1))
    if len(prefetch):
        logger.info("loading %d compiled steps from the store while the weights load", len(prefetch))
    return prefetch


def host_tier(cfg, page_bytes: int, max_batched: int) -> HostTier:
    """The host tier of kv_offloading_size GiB for pages of page_bytes (host_tier.py)."""
    capacity = int(cfg.kv_offloading_size * 2**30) // page_bytes
    if capacity < 1:
        raise ValueError(f"kv_offloading_size={cfg.kv_offloading_size} GiB holds no page of {page_bytes} bytes; "
                         "raise it or leave it unset")
    return HostTier(capacity, max_batch=-(-max_batched // cfg.page_size), copies=cfg.kv_offloading_copies)


# JAX's allocator takes this share of a GPU's memory unless XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise.
JAX_MEM_FRACTION_DEFAULT = 0.75


def jax_mem_fraction() -> float:
    """The share of the card JAX's allocator manages (its bytes_limit): XLA_PYTHON_CLIENT_MEM_FRACTION, read as JAX
    reads it when its backend starts."""
    try:
        return float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", JAX_MEM_FRACTION_DEFAULT))
    except ValueError:
        return JAX_MEM_FRACTION_DEFAULT


def claim_device_memory(cfg) -> bool:
    """Before JAX's backend starts, give its allocator the card's gpu_memory_utilization share where the user gave
    one and did not set XLA_PYTHON_CLIENT_MEM_FRACTION (which JAX reads once, at start). True when it set it."""
    if cfg.gpu_memory_utilization is None or "XLA_PYTHON_CLIENT_MEM_FRACTION" in os.environ:
        return False
    if xla_bridge.backends_are_initialized():
        return False  # too late: pages_for_memory says what the allocator's limit leaves
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(cfg.gpu_memory_utilization)
    return True


def device_memory_stats() -> dict | None:
    """The first local device's allocator statistics when they include bytes_limit (a GPU's), else None (the CPU),
    with card_bytes: the card's memory, bytes_limit over the share JAX's allocator was started with."""
    stats = jax.local_devices()[0].memory_stats() if jax.default_backend() != "cpu" else None
    if not stats or "bytes_limit" not in stats:
        return None
    return dict(stats, card_bytes=int(stats["bytes_limit"] / jax_mem_fraction()))


def memory_budget(stats: dict, gpu_memory_utilization: float) -> int:
    """The engine's bytes under gpu_memory_utilization: that share of the card (stats' card_bytes; the allocator's
    limit where not given), never more than the allocator's limit."""
    limit = stats["bytes_limit"]
    return min(limit, int(stats.get("card_bytes", limit) * gpu_memory_utilization))


def kv_pool_pages(cfg, bytes_per_page: int, windows, max_model_len: int, state_bytes: int, stats: dict | None,
                  last_sizes=None) -> int:
    """Pages of bytes_per_page (on one device) the KV pool holds, after state_bytes of recurrent-state pools
    (allocated with the pages, so taken out of their budget first). stats: device_memory_stats(). last_sizes:
    the pools the last start of this engine sized from memory (executable_store.Prefetch.pool_sizes), one kept
    when near (settled_pages)."""
    if stats is not None:
        pages = pages_for_memory(stats, bytes_per_page, cfg.kv_cache_memory_fraction, cfg.gpu_memory_utilization,
                                 state_bytes)
        return settled_pages(pages, last_sizes, bytes_per_page)
    wanted = cfg.max_num_seqs * kv_groups.pages_per_sequence(windows, cfg.page_size, max_model_len,
                                                             cfg.max_num_batched_tokens or 512) + 1
    return max(2, min(wanted, max(0, (2 << 30) - state_bytes) // bytes_per_page))


def pages_for_memory(stats: dict, bytes_per_page: int, kv_cache_memory_fraction: float,
                     gpu_memory_utilization: float | None, state_bytes: int = 0) -> int:
    """KV pages that fit a device whose allocator reports `stats` (bytes_limit, bytes_in_use), the weights
    already loaded. gpu_memory_utilization (vLLM's meaning): the engine's whole share of the card (memory_budget), so
    the pool gets that share less what is in use; else kv_cache_memory_fraction of what is left.
    state_bytes: a hybrid model's recurrent-state pools (state_pool.bytes_for), allocated with the pages
    and counted as in use before them."""
    limit, in_use = stats["bytes_limit"], stats.get("bytes_in_use", 0) + state_bytes
    if gpu_memory_utilization is None:
        return max(2, int((limit - in_use) * kv_cache_memory_fraction) // bytes_per_page)
    share = memory_budget(stats, gpu_memory_utilization)
    if share < int(stats.get("card_bytes", limit) * gpu_memory_utilization):
        logger.warning("gpu_memory_utilization=%s of the card is %s, but JAX's allocator manages %s "
                       "(XLA_PYTHON_CLIENT_MEM_FRACTION=%s when its backend started): the engine takes that. Set the "
                       "variable before JAX starts, or create the engine first", gpu_memory_utilization,
                       fmt_bytes(int(stats["card_bytes"] * gpu_memory_utilization)), fmt_bytes(limit), jax_mem_fraction())
    budget = share - in_use
    if budget < 2 * bytes_per_page:
        raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization} allows {share / 2**30:.2f} "
                         f"GiB, but the weights already use {in_use / 2**30:.2f} GiB: no room for the KV cache; raise it")
    return budget // bytes_per_page


# A start keeps a pool size the last start of the same engine chose from memory when its own figure is within
# this much of it: what is in use when a start measures moves by a few hundred megabytes from start to start (for
# an 8B on the H100, by 190-380 MiB either way), and the pool's shape is part of every stored step's key. The KV
# budget's headroom (kv_cache_memory_fraction, gpu_memory_utilization) and the step margin cover the difference.
POOL_SETTLE_BYTES = 512 << 20
POOL_SETTLE_FRACTION = 0.02  # ... and within this share of the pool


def settled_pages(pages: int, last_sizes, bytes_per_page: int) -> int:
    """The size among last_sizes nearest to pages when within POOL_SETTLE_BYTES and POOL_SETTLE_FRACTION of it,
    else pages."""
    near = [last for last in last_sizes or () if last >= 2 and abs(last - pages) * bytes_per_page <= POOL_SETTLE_BYTES
            and abs(last - pages) <= POOL_SETTLE_FRACTION * pages]
    return min(near, key=lambda last: abs(last - pages)) if near else pages


STEP_MARGIN_FRACTION = 0.05  # of the largest step's measured memory ...
STEP_MARGIN_MIN_BYTES = 256 << 20  # ... and never less than this


def step_margin(step_bytes: int) -> int:
    """Bytes kept free beside the largest step's measured memory: 5% of it, at least 256 MiB."""
    return max(int(step_bytes * STEP_MARGIN_FRACTION), STEP_MARGIN_MIN_BYTES)


def step_memory_bytes(compiled_steps) -> int | None:
    """What the costliest of compiled_steps (jax.stages.Compiled) needs beyond its arguments, by XLA's memory
    analysis: temporaries + generated code + outputs not aliased to donated arguments (the K/V pools, the
    token history). None when the analysis is unavailable for any of them (a backend or JAX without it)."""
    needs = []
    for compiled in compiled_steps:
        try:
            m = compiled.memory_analysis()
            need = (m.temp_size_in_bytes + m.generated_code_size_in_bytes
                    + max(0, m.output_size_in_bytes - m.alias_size_in_bytes))
        except Exception as e:  # noqa: BLE001 - unimplemented on some backends or versions: fall back
            logger.info("no memory analysis of the compiled step (%s: %.200s)", type(e).__name__, e)
            return None
        if need < 0:
            return None
        needs.append(int(need))
    return max(needs) if needs else None


def largest_free_block(stats: dict) -> int | None:
    """The largest single block the device's allocator can still hand out (stats' largest_free_block_bytes, and
    the part of bytes_limit not yet taken into its pool where it grows on demand: pool_bytes), or None where the
    allocator does not say."""
    block = stats.get("largest_free_block_bytes")
    if block is None:
        return None
    pool = stats.get("pool_bytes")
    return max(block, stats["bytes_limit"] - pool) if pool is not None else block


def pages_beside_step(p0: int, stats: dict, bytes_per_page: int, step_bytes: int,
                      gpu_memory_utilization: float | None, state_bytes: int = 0) -> int:
    """At most p0 pages, so that what is in use (stats' bytes_in_use: the weights) + state_bytes + the pool +
    step_bytes + step_margin fit the budget: bytes_limit, or the card's gpu_memory_utilization share (memory_budget);
    and so that the pool, the state and the step's temporaries fit the largest free block (largest_free_block),
    where the allocator reports it: free memory split between the weights (what a load's or a transform's
    temporaries left) counts in the budget but holds neither a pool nor a step's temporaries. Can be 0."""
    budget = stats["bytes_limit"] if gpu_memory_utilization is None else memory_budget(stats, gpu_memory_utilization)
    room = budget - stats.get("bytes_in_use", 0) - state_bytes - step_bytes - step_margin(step_bytes)
    block = largest_free_block(stats)
    if block is not None:
        room = min(room, block - state_bytes - step_bytes - step_margin(step_bytes))
    return min(p0, max(0, room) // bytes_per_page)


def pool_beside_step(cfg, p0: int, stats: dict, bytes_per_page: int, step_bytes: int | None, step_tokens: int,
                     state_bytes: int, pages_per_sequence: int, last_sizes=None) -> int:
    """The KV pool's pages once the largest step (step_tokens tokens, step_bytes measured; None: unknown)
    has its room (pages_beside_step): p0 where it fits, else a size below that room (settled_below_room), with
    one log line. Raises ValueError naming the knobs when the room holds fewer pages than one max_model_len
    sequence (pages_per_sequence, the scratch page included)."""
    if step_bytes is None:
        logger.info("the KV pool keeps %d pages (kv_cache_memory_fraction / gpu_memory_utilization alone): XLA gave no "
                    "memory analysis of the largest step (%d tokens)", p0 - 1, step_tokens)
        return p0
    room = pages_beside_step(p0, stats, bytes_per_page, step_bytes, cfg.gpu_memory_utilization, state_bytes)
    what = (f"the largest step ({step_tokens} tokens) needs {fmt_bytes(step_bytes)} beyond its inputs "
            f"(XLA's memory analysis; + {fmt_bytes(step_margin(step_bytes))} margin)")
    if room == p0:
        logger.info("%s: the KV pool keeps its %d pages", what, p0 - 1)
        return p0
    if room < pages_per_sequence:
        raise ValueError(
            f"{what}, which leaves the KV cache {max(0, room - 1)} pages of {cfg.page_size} tokens: fewer than one "
            f"sequence of max_model_len needs ({pages_per_sequence - 1}). Lower max_num_batched_tokens (now "
            f"{step_tokens}) or max_model_len, or give the engine more memory (gpu_memory_utilization="
            f"{cfg.gpu_memory_utilization}, kv_cache_memory_fraction={cfg.kv_cache_memory_fraction}; "
            "XLA_PYTHON_CLIENT_MEM_FRACTION raises the memory JAX manages)")
    pages = max(settled_below_room(room, last_sizes, bytes_per_page), pages_per_sequence)
    logger.info("%s: the KV pool holds %d pages, %d fewer (%s; room for %d)", what, pages - 1, p0 - pages,
                fmt_bytes((p0 - pages) * bytes_per_page), room - 1)
    return pages


# A pool shrunk for the step's room sits this far below the room (at most POOL_SETTLE_FRACTION / 2 of it), so that a
# later start that finds up to this much more in use (190-380 MiB for an 8B on the H100) or less can keep its size.
POOL_ROOM_RESERVE_BYTES = 384 << 20


def room_reserve(room: int, bytes_per_page: int) -> int:
    """Pages a pool sized below `room` pages leaves free: POOL_ROOM_RESERVE_BYTES, at most POOL_SETTLE_FRACTION / 2
    of the room."""
    return min(POOL_ROOM_RESERVE_BYTES // bytes_per_page, int(room * POOL_SETTLE_FRACTION / 2))


def settled_below_room(room: int, last_sizes, bytes_per_page: int) -> int:
    """A pool that must fit `room` pages: room_reserve below it, or the size among last_sizes nearest to that when
    within room_reserve of it and within the room. A last size is never taken above the room: that would be the
    step's memory."""
    reserve = room_reserve(room, bytes_per_page)
    fresh = room - reserve
    near = [last for last in last_sizes or () if last >= 2 and fresh - reserve <= last <= room]
    return min(near, key=lambda last: abs(last - fresh)) if near else fresh
