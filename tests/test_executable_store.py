"""Compiled steps stored between engines (executable_store.py): a second engine with the same
configuration loads every bucket instead of tracing it and gives the same tokens; another configuration
or a damaged entry compiles instead (the separate damaged-entry test runs with -m extended); a step that
JAX's persistent cache could serve is still stored with its code, so a new process runs it."""
import functools
import glob
import json
import logging
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import jlight
from jlight import SamplingParams
from jlight.engine.executable_store import ExecutableStore

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5], list(range(7, 40))]


def _engine(model_dir, cache, **kw):
    """An engine whose step buckets go through an ExecutableStore under `cache` that stores every compile
    (the tiny model's compile is well under the store's default 1 s). The pool size differs in every
    pytest process, so no two processes run these programs."""
    opts = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, page_size=8,
                num_pages=64 + os.getpid() % 1000, store_executables=False, warmup=False)
    llm = jlight.LLM(model_dir, **{**opts, **kw})
    runner = llm.engine.runner
    runner.executable_store = ExecutableStore(os.path.join(cache, "executables"), repr(llm.engine.config),
                                              min_compile_seconds=0.0)
    runner.warmup()
    return llm


def _tokens(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _entries(cache):
    return sorted(glob.glob(os.path.join(str(cache), "executables", "*", "*.jex")))


def test_a_second_engine_loads_every_bucket_and_gives_the_same_tokens(tiny_model, tmp_path):
    model_dir = tiny_model("LlamaForCausalLM")
    first = _engine(model_dir, str(tmp_path))
    buckets = len(first.engine.runner.buckets)
    assert first.engine.runner.executable_store.loaded == 0
    assert len(_entries(tmp_path)) == buckets == first.engine.runner.executable_store.saved
    want = _tokens(first)

    second = _engine(model_dir, str(tmp_path))
    assert second.engine.runner.executable_store.loaded == buckets  # none traced or compiled
    assert _tokens(second) == want

    # Another configuration is another program: its steps compile and are stored beside the first's.
    firsts = _entries(tmp_path)
    other = _engine(model_dir, str(tmp_path), max_num_seqs=3)
    assert other.engine.runner.executable_store.loaded == 0
    assert len(_entries(tmp_path)) == 2 * buckets
    assert _tokens(other) == want

    # A damaged entry (truncated: as a crash mid-write would leave it without the rename) is compiled instead,
    # the others loaded. Not the first's programs, which `second` loaded: XLA:CPU cannot run one serialized
    # program loaded twice in a process once the first copy is freed ("Function ... not found").
    others = sorted(set(_entries(tmp_path)) - set(firsts))
    with open(others[0], "r+b") as f:
        f.truncate(100)
    again = _engine(model_dir, str(tmp_path), max_num_seqs=3)
    assert again.engine.runner.executable_store.loaded == buckets - 1
    assert _tokens(again) == want


@pytest.mark.extended  # the test above damages an entry of its second configuration the same way
def test_a_damaged_entry_is_compiled_instead(tiny_model, tmp_path):
    # Not the first test's program: XLA:CPU cannot run one serialized program loaded twice in a process
    # once the first copy is freed ("Function ... not found"), another reason the CPU stores nothing by default.
    model_dir, other = tiny_model("LlamaForCausalLM"), dict(max_num_seqs=2)
    want = _tokens(_engine(model_dir, str(tmp_path), **other))
    entries = _entries(tmp_path)
    with open(entries[0], "r+b") as f:  # truncated: as a crash mid-write would leave it without the rename
        f.truncate(100)
    llm = _engine(model_dir, str(tmp_path), **other)
    assert llm.engine.runner.executable_store.loaded == len(entries) - 1
    assert _tokens(llm) == want


def test_the_engine_stores_by_default_and_only_with_a_cache_directory(tiny_model, tmp_path):
    model_dir = tiny_model("LlamaForCausalLM")
    opts = dict(dtype="float32", max_num_seqs=2, max_num_batched_tokens=16, num_pages=32, warmup=False)
    assert jlight.LLM(model_dir, compilation_cache_dir=str(tmp_path), **opts).engine.runner.executable_store is not None
    assert jlight.LLM(model_dir, compilation_cache_dir=str(tmp_path), store_executables=False,
                      **opts).engine.runner.executable_store is None
    assert jlight.LLM(model_dir, compilation_cache_dir="", store_executables=True,
                      **opts).engine.runner.executable_store is None


# One engine's start in a new process, JAX's persistent cache on for every compile (min time 0): a warm-up without
# the store ("jax-cache-only"), through it ("store"), or both, the second through the store after the first has
# put steps JAX's cache served into JAX's in-memory caches ("cache-then-store"); then the greedy tokens of PROMPTS.
START = textwrap.dedent("""
    import json, os, sys
    import jax
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    import jlight
    from jlight.engine.executable_store import ExecutableStore
    model_dir, cache, mode = sys.argv[1:4]
    llm = jlight.LLM(model_dir, dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, page_size=8, num_pages=64,
                     compilation_cache_dir=cache, store_executables=False, warmup=False)
    runner = llm.engine.runner
    if mode == "cache-then-store":
        runner.warmup()
        runner._executables.clear()
    if mode in ("store", "cache-then-store", "renamed"):  # renamed: another key for the same programs
        runner.executable_store = ExecutableStore(os.path.join(cache, "executables"), "start" + "-2" * (mode == "renamed"),
                                                  min_compile_seconds=0.0)
    runner.warmup()
    outs = llm.generate(json.loads(sys.argv[4]), jlight.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)
    store = runner.executable_store
    print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs], "loaded": store.loaded if store else None,
                      "saved": store.saved if store else None}))
""")


def _start(model_dir, cache, mode):
    import json
    proc = subprocess.run([sys.executable, "-c", START, model_dir, str(cache), mode, json.dumps(PROMPTS)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_step_jax_cache_could_serve_is_stored_with_its_code(tiny_model, tmp_path):
    # On the CPU a step JAX's persistent cache served serializes without its code; the store compiles around
    # that cache and around JAX's in-memory caches (which hold such steps once the same runner compiled them
    # without the store), so what it saves runs in a new process.
    model_dir = tiny_model("LlamaForCausalLM")
    plain = _start(model_dir, tmp_path, "jax-cache-only")  # fills JAX's cache with every bucket
    assert plain["loaded"] is None and len(glob.glob(os.path.join(str(tmp_path), "*-*"))) > 0
    stored = _start(model_dir, tmp_path, "cache-then-store")
    assert stored["loaded"] == 0 and stored["saved"] == len(_entries(tmp_path)) > 0
    loaded = _start(model_dir, tmp_path, "store")
    assert loaded["loaded"] == stored["saved"] and loaded["saved"] == 0
    assert plain["tokens"] == stored["tokens"] == loaded["tokens"]
    # A new key for the same programs (a source or configuration change that leaves them as they were): the store
    # compiles them again, and JAX's persistent cache must not serve that compile from what the store's earlier
    # compiles left there (the process after would load steps without code: "Function ... not found").
    renamed = _start(model_dir, tmp_path, "renamed")
    assert renamed["loaded"] == 0 and renamed["saved"] == stored["saved"]
    again = _start(model_dir, tmp_path, "renamed")
    assert again["loaded"] == renamed["saved"] and again["tokens"] == plain["tokens"]


LINALG = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp
    from jlight.engine.executable_store import ExecutableStore
    store = ExecutableStore(sys.argv[1], "linalg", min_compile_seconds=0.0)
    a = jnp.tril(jnp.arange(1.0, 17.0).reshape(4, 4)) + 4 * jnp.eye(4)
    b = jnp.arange(8.0).reshape(4, 2)
    key = store.key((a, b), None)
    if sys.argv[2] == "store":
        f = jax.jit(lambda a, b: jax.scipy.linalg.solve_triangular(a, b, lower=True))
        compiled = store.compile(key, f.lower(a, b))
    else:  # nothing lowered in this process: the loaded executable's LAPACK call must still find its function
        compiled = store.load(key, (a, b))
    print(store.loaded, float(jnp.abs(a @ compiled(a, b) - b).max()))
""")


def test_a_loaded_step_with_a_lapack_call_runs(tmp_path):
    # On the CPU solve_triangular (the gated DeltaNet reference's) lowers to a LAPACK custom call whose function
    # JAX sets up while lowering; a step loaded in a new process was never lowered there (it segfaulted).
    run = lambda mode: subprocess.run([sys.executable, "-c", LINALG, str(tmp_path), mode], capture_output=True,
                                      text=True, timeout=120)
    stored = run("store")
    assert stored.returncode == 0, stored.stderr[-2000:]
    loaded = run("load")
    assert loaded.returncode == 0, (loaded.returncode, loaded.stderr[-2000:])
    count, error = loaded.stdout.split()
    assert int(count) == 1 and float(error) < 1e-4


def test_how_a_start_compiles_is_not_part_of_the_key(tmp_path):
    """Engines that differ only in when and how they compile (`jlight generate` compiles its request's buckets,
    `jlight chat` all of them at start) run the same programs: one key; any other field gives another."""
    from jlight.engine import startup
    from jlight.engine.engine_config import EngineConfig

    mc = "model"  # the key covers the model's config too: the same one here
    base = dict(compilation_cache_dir=str(tmp_path), max_model_len=64)
    key = lambda **kw: startup.executable_store(EngineConfig(**{**base, **kw}), mc)._base  # noqa: E731
    assert key() == key(warmup=False) == key(compile_threads=1)
    assert key() != key(max_num_seqs=3) and key() != key(seed=1)


def test_a_start_prefetches_the_steps_the_last_start_used(tiny_model, tmp_path, caplog):
    """The manifest a warmed-up start writes lists its steps; the next start of the same engine loads them
    while its weights load, and the store's loads take every one from there (same tokens). A damaged manifest
    or another engine's prefetches nothing and the steps load from their files."""
    from jlight.engine.executable_store import Prefetch

    model_dir = tiny_model("LlamaForCausalLM")
    directory = os.path.join(str(tmp_path), "executables")

    def start(engine="this engine", pages=64 + os.getpid() % 1000):
        prefetch = Prefetch(directory, engine, threads=2)
        llm = jlight.LLM(model_dir, dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, page_size=8,
                         num_pages=pages, store_executables=False, warmup=False)
        runner = llm.engine.runner
        runner.executable_store = ExecutableStore(directory, repr(llm.engine.config), min_compile_seconds=0.0,
                                                  prefetch=prefetch)
        runner.warmup(threads=2)
        runner.executable_store.write_manifest()
        prefetch.close()
        return llm, prefetch

    first, prefetched = start()
    buckets = len(first.engine.runner.buckets)
    assert len(prefetched) == 0 and first.engine.runner.executable_store.saved == buckets
    second, prefetched = start()
    assert len(prefetched) == buckets and prefetched.taken == buckets
    assert second.engine.runner.executable_store.loaded == buckets
    assert _tokens(second) == _tokens(first)
    # The same engine, its pool of another size (as one sized from memory can be): nothing matches, and it says so.
    with caplog.at_level(logging.WARNING, logger="jlight.engine.executable_store"):
        moved, prefetched = start(pages=63 + os.getpid() % 1000)
    assert len(prefetched) == buckets and prefetched.taken == 0 and moved.engine.runner.executable_store.loaded == 0
    assert [r.getMessage() for r in caplog.records] == [
        f"none of the {buckets} compiled steps the last start of this engine stored matched this start's, so they were "
        "compiled again: the steps' inputs differ from that start's (a KV pool sized from memory to another size, "
        "for one; num_pages fixes it)"]

    other, prefetched = start("another engine")
    assert len(prefetched) == 0 and other.engine.runner.executable_store.loaded == buckets
    with open(prefetched.path, "w") as f:
        f.write("{not json")
    damaged, prefetched = start("another engine")
    assert len(prefetched) == 0 and damaged.engine.runner.executable_store.loaded == buckets
    assert len(Prefetch(directory, "another engine", threads=1)) == buckets  # rewritten whole by that start


# A start in a new process: JAX's persistent cache at argv[2]; prints the programs compiled below the cache's
# 1 s floor (not written) and those read from it, the engine's start and an on-device load's casts.
_START_SCRIPT = textwrap.dedent("""
    import io, json, logging, os, re, sys
    import jax, jax.numpy as jnp
    log = io.StringIO()
    handler = logging.StreamHandler(log)
    logging.getLogger("jax._src.compiler").addHandler(handler)
    logging.getLogger("jax._src.compiler").setLevel(logging.DEBUG)
    import jlight
    from jlight.core.config import ModelConfig
    from jlight.loading import assemble, safetensors_loader as st
    path, cache = sys.argv[1], sys.argv[2]
    jlight.LLM(path, dtype="float32", max_num_seqs=2, max_num_batched_tokens=16, page_size=8, num_pages=16,
               compilation_cache_dir=cache)
    config = ModelConfig.from_json_file(os.path.join(path, "config.json"))
    tensors = st.stream_safetensors(st.safetensors_files(path))
    jax.block_until_ready(assemble.assemble_params(config, tensors, jnp.bfloat16, transform_on_device=True, unstacked=True))
    text = log.getvalue()
    print("RESULT" + json.dumps(dict(below_floor=re.findall(r"entry for '([^']+)' because it took <", text),
                                     hits=re.findall(r"cache hit for '([^']+)'", text))))
""")


def test_a_second_start_reads_its_small_programs_from_the_cache(tiny_model, tmp_path):
    """The programs a start compiles beside its steps (zeroed pools and buffers, casts, an on-device load's
    transposes) each compile under JAX's persistent cache's 1 s floor, so none was stored and every start compiled
    them again; now the first start stores them and the second compiles none but its steps (which the executable
    store keeps) and reads the rest."""
    script = tmp_path / "start.py"
    script.write_text(_START_SCRIPT)
    model_dir, cache = tiny_model("LlamaForCausalLM"), str(tmp_path / "cache")

    def start():
        out = subprocess.run([sys.executable, str(script), model_dir, cache], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.split("RESULT", 1)[1])

    first = start()
    assert not [p for p in first["below_floor"] if p != "jit__packed_step"], first
    second = start()
    assert not [p for p in second["below_floor"] if p != "jit__packed_step"], second
    assert "jit__cast_transposed" in second["hits"] and "jit_broadcast_in_dim" in second["hits"], second


def test_engines_given_different_models_keep_manifests_of_their_own(tmp_path):
    """An engine given a LoadedModel (EngineConfig.model None) keys its manifest by the model's config too: two
    random-weight models under one EngineConfig read each their own, not the other's (whose steps never match,
    and whose reads and warning were spurious); one loaded from a path keeps its key."""
    import dataclasses

    from jlight.core.config import ModelConfig
    from jlight.engine import startup
    from jlight.engine.engine_config import EngineConfig

    base = ModelConfig.from_hf_dict(dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=16,
                                         intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1))
    cfg = EngineConfig(model=None, compilation_cache_dir=str(tmp_path))
    path = lambda c, mc: startup.prefetch_executables(c, mc).path  # noqa: E731
    assert path(cfg, base) != path(cfg, dataclasses.replace(base, num_layers=2)) != path(cfg, None)
    assert path(cfg, base) == path(cfg, base)
    assert path(dataclasses.replace(cfg, model="/m"), None) != path(cfg, None)


def test_a_prefetched_step_reaches_its_devices_only_when_taken(tmp_path, monkeypatch):
    """Prefetch reads the manifest's entries into host memory on its threads; an entry is loaded onto its devices
    (where it holds device memory, which the KV pool is sized beside) only when its key is taken, and runs then.
    The manifest gives the last start's pool sizes too."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import serialize_executable

    from jlight.engine import executable_store
    from jlight.engine.executable_store import Prefetch

    directory = os.path.join(str(tmp_path), "executables")
    x = jnp.arange(8.0)
    store = ExecutableStore(directory, "a program", min_compile_seconds=0.0, prefetch=Prefetch(directory, "engine", 1))
    key = store.key((x,), "static")
    store.compile(key, jax.jit(lambda a: a * 2 + 1).lower(x))
    store.write_manifest([1234, 1200])  # the KV pools this start sized from memory, for the next to keep

    loads = []
    real = serialize_executable.deserialize_and_load
    monkeypatch.setattr(executable_store.serialize_executable, "deserialize_and_load",
                        lambda *a, **kw: loads.append(a) or real(*a, **kw))
    prefetch = Prefetch(directory, "engine", threads=1)
    prefetch._pool.shutdown(wait=True)  # every read done
    assert len(prefetch) == 1 and loads == [] and prefetch.pool_sizes == [1234, 1200]
    compiled = ExecutableStore(directory, "a program", prefetch=prefetch).load(key, (x,))
    assert len(loads) == 1 and prefetch.taken == 1
    assert compiled(x).tolist() == (x * 2 + 1).tolist()


@pytest.mark.parametrize("share", ["kv_cache_memory_fraction", "gpu_memory_utilization"])
def test_a_warm_start_that_finds_more_in_use_keeps_the_pool_and_loads_every_step(tiny_model, tmp_path, monkeypatch, share):
    """On a device with memory statistics the pool is sized from what is in use, which moves from start to start
    (on the H100, by 190-380 MiB for the 8B): a warm start that finds more in use keeps the pools the cold start
    chose (startup.settled_pages, from the store's manifest): P0, and with gpu_memory_utilization the smaller pool
    beside the largest step too, so every step it needs comes from the store."""
    from jlight.engine import startup

    model_dir = tiny_model("LlamaForCausalLM")
    if share == "kv_cache_memory_fraction":
        limit, options = 1 << 40, {}
        in_use = [limit - (256 << 20)]  # 256 MiB left after the weights: 0.8 of it for pages
        # The room beside the largest step is not the subject here (its margin alone is 256 MiB): the pool keeps P0.
        monkeypatch.setattr(startup, "pool_beside_step", lambda cfg, p0, *args: p0)
    else:
        limit, options = 300 << 20, {"gpu_memory_utilization": 0.95}
        in_use = [10 << 20]  # the pool: what 0.95 of 300 MiB leaves beside the largest step and its 256 MiB margin
    monkeypatch.setattr(startup, "device_memory_stats", lambda: {"bytes_limit": limit, "bytes_in_use": in_use[0]})
    # Every step stored, however quickly the tiny model compiles (the store's default skips those under 1 s).
    monkeypatch.setattr(startup, "ExecutableStore", functools.partial(ExecutableStore, min_compile_seconds=0.0))

    def start():
        return jlight.LLM(model_dir, dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, page_size=8,
                          compilation_cache_dir=str(tmp_path), **options).engine

    cold = start()
    store = cold.runner.executable_store
    pages, variants, bytes_per_page = cold.runner.num_pages, store.saved, cold._pool_bytes_per_page(np.float32, None)
    p0 = startup.pages_for_memory(startup.device_memory_stats(), bytes_per_page, 0.8, options.get("gpu_memory_utilization"))
    assert variants > 0 and store.loaded == 0
    assert pages == p0 if share == "kv_cache_memory_fraction" else pages < p0
    in_use[0] += 5 * bytes_per_page  # 5 pages' worth more in use: alone, smaller pools
    assert startup.pages_for_memory(startup.device_memory_stats(), bytes_per_page, 0.8,
                                    options.get("gpu_memory_utilization")) < p0
    warm = start()
    assert warm.runner.num_pages == pages
    assert warm.runner.executable_store.loaded == variants and warm.runner.executable_store.prefetch.taken == variants
    assert warm.runner.executable_store.saved == 0
