"""Compiled step executables kept on disk between processes: a warm start loads them instead of
tracing, lowering and compiling every step bucket again.

JAX's persistent compilation cache skips only XLA's compile; tracing and lowering an unrolled 32-layer
step still cost seconds a bucket, one bucket after another under Python's lock. A stored executable
skips all three.

Invariants:
- An entry's key covers everything the compiled program depends on: the jax and jaxlib versions, the
  backend and its devices, JAX's configuration and the XLA/JAX environment variables, the source of
  jlight's program packages (PROGRAM_PACKAGES), the engine's description of the program (its EngineConfig and model
  config), the step's inputs (tree structure, shapes, dtypes, shardings) with its static layout, and the
  devices it runs on (program_devices: an engine on some of the devices, as each data-parallel replica or
  either side of disaggregated prefill/decode, has programs of its own). A loaded step runs on those devices.
  A change to any of these gives a new key, so a stale executable is never loaded.
- An entry is written whole or not at all (a temporary file renamed into place); a load that fails for
  any reason (a corrupt or truncated file, a JAX that cannot deserialize it) is logged and the step is
  compiled instead: the store can only save time, never change what runs.
- Only steps whose tracing, lowering and compiling took at least min_compile_seconds are stored (1 s, as
  JAX's persistent cache for its compiles).
- What the store saves runs when loaded: on the CPU (JAX 0.10.2) an executable that JAX's persistent cache
  served serializes without its code (the copy loads, then fails at its first run: "Function ... not
  found"), so there `compile` has XLA compile the step itself. Its compiles carry an option of their own
  (STORE_COMPILE_MARKER, set to its default value), which puts them under keys of their own in JAX's caches,
  and they write nothing to the persistent cache, so that cache holds no entry under those keys to serve
  (JAX decides once a process whether the cache is used at all; a compile cannot switch it off for itself).
  JAX's in-memory caches may still hand a store compile the executable of an earlier store compile of the
  same program in the process: XLA compiled that one, so it serializes whole.
  The price: on the CPU a start whose key is new (an EngineConfig field changed, but for those that only
  steer how a start compiles: startup.START_ONLY_FIELDS) compiles its steps anew even where JAX's cache
  holds the same programs.
- A loaded executable runs without having been lowered in this process, so what JAX sets up while lowering
  must be set up before it runs: on the CPU the LAPACK function pointers of the linalg custom calls (the gated
  DeltaNet reference's solve_triangular lowers to one; unset, the step segfaults at its first run). `load`
  initializes them, as JAX's own export does before it calls a deserialized module.
- A start that warms up every bucket reads, from its first moment, the entries the last start of the same
  engine (its EngineConfig but for how it compiles) used, listed in a manifest (Prefetch), so they are read
  while the weights load; each is loaded onto its devices only when its own key asks for it on those devices,
  after the KV pool is sized, so that what the start finds in use is what a cold start found.
- Entries are only ever read by the process that asks for their exact key; the directory is the
  user's own cache (the engine's compilation cache directory), never shared input.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import importlib.util
import json
import logging
import os
import pickle
import tempfile
import threading
import time

import jax
from jax.sharding import NamedSharding
from jax._src import config as jax_config  # persistent_cache_min_compile_time_secs as a thread-local context; private in jax 0.10/0.11
from jax._src.lax import linalg as jax_linalg  # initialize_lapack; private in jax 0.10/0.11
from jax.experimental import serialize_executable

logger = logging.getLogger(__name__)

FORMAT = 1  # the entry layout below: pickle of (payload, in_tree, out_tree)

# The packages whose source decides a compiled step (not the server's or the batch runner's).
PROGRAM_PACKAGES = ("jlight", "jlight.core", "jlight.engine", "jlight.engine.proposers", "jlight.loading", "jlight.models",
                    "jlight.pallas_kernels", "jlight.sharding", "jlight.quantization")


def _source_digest() -> str:
    """sha256 over the .py (and kernels' .cc) files of PROGRAM_PACKAGES, read from disk (imported or not)."""
    h = hashlib.sha256()
    for name in PROGRAM_PACKAGES:
        spec = importlib.util.find_spec(name)
        for directory in (spec.submodule_search_locations or []) if spec else []:
            for fname in sorted(os.listdir(directory)):
                if fname.endswith((".py", ".cc")):
                    with open(os.path.join(directory, fname), "rb") as f:
                        h.update(f"{name}/{fname}\0".encode() + f.read())
    return h.hexdigest()


# Compiler options at their default values (no effect on the code), carried only by the store's CPU compiles,
# so JAX's compile caches never answer one of them with an executable compiled otherwise. Not the first option
# alone: users' persistent caches hold entries without code under that key, from versions whose store compiles
# wrote there.
STORE_COMPILE_MARKER = {"xla_cpu_enable_fast_math": False, "xla_cpu_fast_math_honor_nans": True}


def _initialize_lapack() -> None:
    """Point the CPU's LAPACK custom calls (lapack_*_ffi) at their functions. JAX does it while lowering a
    linalg op (jaxlib.lapack.prepare_lapack_call) and before calling an exported module
    (jax._src.export._export._ensure_backends_initialized); an executable loaded here was lowered in another
    process. Idempotent."""
    jax_linalg.initialize_lapack()


def program_devices(args) -> list:
    """The devices a step over `args` runs on, in its device assignment's order (what jit takes from its
    arguments): the mesh of the first NamedSharding among them, flattened, else the device of the first
    single-device argument."""
    return _sharding_devices([getattr(leaf, "sharding", None) for leaf in jax.tree.leaves(args)])


def _sharding_devices(shardings) -> list:
    shardings = [s for s in shardings if s is not None]
    for s in shardings:
        if isinstance(s, NamedSharding):
            return list(s.mesh.devices.flat)
    return sorted(shardings[0].device_set, key=lambda d: d.id) if shardings else list(jax.devices()[:1])


def _leaf_signature(leaf) -> str:
    sharding = getattr(leaf, "sharding", None)
    return f"{getattr(leaf, 'shape', ())}|{getattr(leaf, 'dtype', type(leaf).__name__)}|{sharding}"


def environment() -> str:
    """What every compiled step depends on beyond its engine's description and inputs: the store's format, JAX,
    the backend and its devices, JAX's configuration and the XLA/JAX environment variables, jlight's program
    source."""
    backend = jax.devices()[0].client
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith(("XLA_", "JAX_", "TF_", "CUDA_", "NVIDIA_")))
    config = sorted((k, repr(v)) for k, v in jax.config.values.items() if "cache" not in k)
    return "\n".join(map(str, (
        FORMAT, jax.__version__, getattr(jax.lib, "__version__", None), backend.platform, backend.platform_version,
        [(d.id, d.device_kind) for d in jax.devices()], env, config, _source_digest())))


def entry_path(directory: str, key: str) -> str:
    return os.path.join(directory, key[:2], key + ".jex")


def read_entry(path: str):
    """The entry stored at `path` as (payload, in_tree, out_tree), read into host memory only, or None (not
    there, or unreadable: logged)."""
    if not os.path.exists(path):
        return None
    try:
        with open(path, "rb") as f:
            payload, in_tree, out_tree = pickle.load(f)
    except Exception as e:  # noqa: BLE001 - any failure means: compile instead
        logger.info("stored executable %s unreadable (%s: %.200s); compiling it", path, type(e).__name__, e)
        return None
    return payload, in_tree, out_tree


def load_entry(path: str, entry, devices):
    """The jax.stages.Compiled of `entry` (read_entry's, from `path`) loaded onto `devices`, or None (no entry,
    or unusable: logged)."""
    if entry is None:
        return None
    try:
        compiled = serialize_executable.deserialize_and_load(*entry, execution_devices=devices)
        if jax.default_backend() == "cpu":
            _initialize_lapack()
    except Exception as e:  # noqa: BLE001 - any failure means: compile instead
        logger.info("stored executable %s unusable (%s: %.200s); compiling it", path, type(e).__name__, e)
        return None
    return compiled


def deserialize(path: str, devices):
    """The jax.stages.Compiled stored at `path`, loaded onto `devices`, or None (not there, or unusable: logged)."""
    return load_entry(path, read_entry(path), devices)


class Prefetch:
    """The stored steps the last start of an engine used, read on threads of their own from the moment a new
    start of the same engine begins, so that they are read while its weights load.

    They are read into host memory only, and loaded onto their devices when taken: a loaded executable holds
    device memory, and the KV pool is sized from the memory in use before the steps are taken, so a warm start
    sizes it as a cold one did (the pool's shape is part of every step's key).

    The manifest (directory/manifests/<digest of environment() and the engine's description>.json) maps each
    entry's key to its devices' ids, and keeps the KV pool sizes the last start chose from memory (pool_sizes);
    ExecutableStore.write_manifest adds the entries a start used to those of the manifest whose files remain.
    A prefetched step only ever answers its own key on the same devices (`take`), so a manifest out of date
    costs loading time, never a wrong program."""

    def __init__(self, directory: str, engine: str, threads: int):
        name = hashlib.sha256(f"{environment()}\n{engine}".encode()).hexdigest()
        self.directory = directory
        self.path = os.path.join(directory, "manifests", name + ".json")
        entries, self.pool_sizes = self._read()  # the KV pools the last start sized from memory
        by_id = {d.id: d for d in jax.devices()}
        self._entries = {k: ids for k, ids in entries.items() if all(i in by_id for i in ids)}
        self._pool = concurrent.futures.ThreadPoolExecutor(max(1, threads), thread_name_prefix="jlight-prefetch")
        self._futures = {k: self._pool.submit(read_entry, entry_path(directory, k)) for k in self._entries}
        self._lock = threading.Lock()
        self.taken = 0  # steps the store took from here
        self._closed = False

    def __len__(self) -> int:
        return len(self._entries)

    def _read(self) -> tuple[dict[str, list[int]], list[int]]:
        """The manifest's entries and pool_sizes; none of either when it is missing or damaged."""
        try:
            with open(self.path) as f:
                manifest = json.load(f)
            return ({str(k): [int(i) for i in ids] for k, ids in manifest["entries"].items()},
                    [int(pages) for pages in manifest["pool_sizes"]])
        except FileNotFoundError:
            return {}, []
        except Exception as e:  # noqa: BLE001 - a damaged manifest only costs the prefetch
            logger.info("executable manifest %s unreadable (%s: %s); not prefetching", self.path, type(e).__name__, e)
            return {}, []

    def take(self, key: str, devices):
        """The step prefetched for `key` on `devices` (waiting for its read), loaded onto them, or None."""
        with self._lock:
            future = self._futures.pop(key, None)
        if future is None or self._entries[key] != [d.id for d in devices]:
            return None
        compiled = load_entry(entry_path(self.directory, key), future.result(), devices)
        if compiled is not None:
            with self._lock:
                self.taken += 1
        return compiled

    def close(self) -> None:
        """Drop the prefetched steps no one took (and those not loaded yet). The first close says so when the
        manifest listed steps and the start took none: then its steps' inputs differ from the last start's, and
        a start the user expected to be warm compiled everything again."""
        with self._lock:
            futures, self._futures = self._futures, {}
            first, self._closed = not self._closed, True
        for future in futures.values():
            future.cancel()
        self._pool.shutdown(wait=False)
        if first and self._entries and not self.taken:
            logger.warning("none of the %d compiled steps the last start of this engine stored matched this start's, so "
                           "they were compiled again: the steps' inputs differ from that start's (a KV pool sized from "
                           "memory to another size, for one; num_pages fixes it)", len(self._entries))

    def write(self, used: dict[str, list[int]], pool_sizes=()) -> None:
        """Add `used` to the manifest's entries whose files remain; pool_sizes: this start's KV pools sized from
        memory (none: num_pages given, or no device statistics)."""
        entries = {k: ids for k, ids in self._read()[0].items() if os.path.exists(entry_path(self.directory, k))}
        entries.update(used)
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.path), suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump({"entries": entries, "pool_sizes": [int(p) for p in pool_sizes]}, f)
            os.replace(tmp, self.path)
        except OSError as e:  # the manifest is an optimization: never fail a start over it
            logger.info("could not write the executable manifest %s (%s)", self.path, e)


class ExecutableStore:
    """Compiled executables under `directory`, one file per key."""

    def __init__(self, directory: str, program: str, min_compile_seconds: float = 1.0,
                 prefetch: "Prefetch | None" = None):
        """program: the caller's description of what it compiles (e.g. repr of its configs).
        min_compile_seconds: compiles quicker than this are not stored (JAX's persistent cache's default).
        prefetch: the steps the last start of this engine used, being loaded already (Prefetch)."""
        self.directory = directory
        self.min_compile_seconds = min_compile_seconds
        self._base = "\n".join((environment(), program))
        self.prefetch = prefetch
        self.loaded = self.saved = 0
        self.used: dict[str, list[int]] = {}  # key -> its devices' ids: the entries this process loaded or saved
        self._count_lock = threading.Lock()  # load and compile run on several threads (ModelRunner.warmup)

    def key(self, args, static) -> str:
        leaves, tree = jax.tree.flatten(args)
        h = hashlib.sha256(self._base.encode())
        h.update(f"\n{tree}\n{static!r}\n{[d.id for d in program_devices(args)]}\n".encode())
        for leaf in leaves:
            h.update(_leaf_signature(leaf).encode() + b"\n")
        return h.hexdigest()

    def _path(self, key: str) -> str:
        return entry_path(self.directory, key)

    def load(self, key: str, args):
        """The stored jax.stages.Compiled for `key`, loaded onto the devices of the step's arguments `args`
        (program_devices), or None (not stored, or unreadable: logged). A step the prefetch holds for the
        same devices comes from there."""
        devices = program_devices(args)
        compiled = self.prefetch.take(key, devices) if self.prefetch is not None else None
        if compiled is None:
            compiled = deserialize(self._path(key), devices)
        if compiled is None:
            return None
        with self._count_lock:
            self.loaded += 1
            self.used[key] = [d.id for d in devices]
        return compiled

    def compile(self, key: str, lowered, lower_seconds: float = 0.0):
        """Compile `lowered` (XLA's own compile on the CPU, not a copy from JAX's persistent cache: see the
        invariants) and store the result under `key`. lower_seconds: what tracing and lowering it took, which
        a load saves as well."""
        start = time.perf_counter() - lower_seconds
        if jax.default_backend() == "cpu":
            with jax_config.persistent_cache_min_compile_time_secs(float("inf")):  # written nowhere (this thread)
                compiled = lowered.compile(compiler_options=STORE_COMPILE_MARKER)
        else:
            compiled = lowered.compile()
        self.save(key, compiled, time.perf_counter() - start)
        return compiled

    def save(self, key: str, compiled, compile_seconds: float) -> None:
        """Store `compiled` under `key` if making it took at least min_compile_seconds; a backend that
        cannot serialize it is logged and skipped."""
        if compile_seconds < self.min_compile_seconds:
            return
        try:
            entry = pickle.dumps(serialize_executable.serialize(compiled))
            path = self._path(key)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(entry)
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
        except Exception as e:  # noqa: BLE001 - storing is an optimization: never fail a start over it
            logger.info("could not store a compiled step (%s: %.200s)", type(e).__name__, e)
            return
        with self._count_lock:
            self.saved += 1
            self.used[key] = [d.id for d in _sharding_devices(jax.tree.leaves(compiled.input_shardings))]

    def write_manifest(self, pool_sizes=()) -> None:
        """Record the entries this process used, and pool_sizes (Prefetch.write), for the next start of the same
        engine to prefetch."""
        if self.prefetch is not None:
            with self._count_lock:
                used = dict(self.used)
            self.prefetch.write(used, pool_sizes)
