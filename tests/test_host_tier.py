"""The host-memory KV tier (jlight/engine/host_tier.py) on a tiny float32 Llama with a device pool too
small for the workload: evicted pages go to host memory and come back on a later prefix hit, giving
the tokens an engine that recomputes them gives, with the evictions, per-tier hits and LRU drops
counted, and no step compiled after warm-up."""
import textwrap

import jax
import numpy as np
import pytest

import jlight
from jlight import SamplingParams
from simulated_devices import run_script

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PAGE_BYTES = 2 * 2 * 8 * 2 * 16 * 4  # K and V, 2 layers, 8-token pages, 2 KV heads of 16, float32


def small_engine(model_dir, host_pages=None, copies="in_program"):
    """40 device pages (39 usable, 312 tokens): less than the workload's prefixes need."""
    size = None if host_pages is None else host_pages * PAGE_BYTES / 2**30
    return jlight.LLM(model_dir, dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, min_token_bucket=64, page_size=8, num_pages=40,
                      kv_offloading_size=size, kv_offloading_copies=copies).engine


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("LlamaForCausalLM", max_position_embeddings=1024)


def conversations(seed=0):
    """Three 120-token histories (15 pages each), then each history again with a new turn."""
    rng = np.random.default_rng(seed)
    histories = [rng.integers(3, 500, size=120).tolist() for _ in range(3)]
    first = [h + rng.integers(3, 500, size=5).tolist() for h in histories]
    second = [h + rng.integers(3, 500, size=7).tolist() for h in histories]
    return first, second


def run_one_by_one(engine, prompts):
    out = []
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}-{len(out)}-{id(p)}", None, GREEDY, prompt_token_ids=p)
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    out.append((o.outputs[0].token_ids, o.num_cached_tokens))
    return out


def test_evicted_prefixes_come_back_from_host_with_the_recomputed_tokens(model_dir):
    first, second = conversations()
    reference = small_engine(model_dir)  # device prefix cache only: evicted pages are recomputed
    tiered = small_engine(model_dir, host_pages=200)
    runner = tiered.runner
    copies = (runner._step, runner._read_pages, runner._write_pages, runner._read_page_list, runner._write_page_list)
    compiled = [f._cache_size() for f in copies]
    want = run_one_by_one(reference, first + second)
    got = run_one_by_one(tiered, first + second)
    assert [t for t, _ in got] == [t for t, _ in want]
    # Each second turn finds its whole history (15 pages): on the host tier, the device pool having
    # evicted it; the reference recomputed it (the device holds only the most recent history or two).
    assert [c for _, c in got[3:]] == [120, 120, 120]
    assert [c for _, c in want[3:]][0] < 120
    s = tiered.stats()
    assert s.host_cache_offloaded_pages > 0 and s.host_cache_dropped_pages == 0
    assert s.host_cache_hit_tokens >= 120 and s.host_cache_hit_tokens % 8 == 0
    assert s.device_cache_hit_tokens + s.host_cache_hit_tokens >= 3 * 120
    assert s.host_cache_pages_used == s.host_cache_offloaded_pages <= s.host_cache_pages_total == 200
    assert reference.stats().host_cache_hit_tokens == 0 and reference.stats().host_cache_pages_total == 0
    assert s.num_pages_used == 0
    # The steps and the copies (every power-of-two page count up to 8) compiled at warm-up: none since.
    assert [f._cache_size() for f in copies] == compiled
    # The tier's scatters (one a power-of-two page count) write into the donated pools, not a copy of them.
    writes = [c for (kind, _), c in runner._page_copies.items() if kind == "write_list_host"]  # in_program's
    assert len(writes) == 4 and all("input_output_alias={ {0}: (0, {}, may-alias)" in c.as_text() for c in writes)


def test_copies_by_device_put_give_the_recomputed_tokens(model_dir):
    """kv_offloading_copies="device_put" (the default copies inside the programs): the gather and the scatter
    stay on the device, and the pages travel by jax.device_put to and from pinned host memory; the tokens are
    an engine's that recomputes, every held page is a pinned_host array, and the scatters (compiled at warm-up)
    write into the donated pools."""
    first, second = conversations(seed=2)
    want = run_one_by_one(small_engine(model_dir), first + second)
    tiered = small_engine(model_dir, host_pages=200, copies="device_put")
    runner = tiered.runner
    compiled = dict(runner._page_copies)
    got = run_one_by_one(tiered, first + second)
    assert [t for t, _ in got] == [t for t, _ in want] and [c for _, c in got[3:]] == [120, 120, 120]
    tier = tiered.block_manager.host_tier
    assert tier.offloaded_pages > 0 and tier.restored_pages >= 15
    assert {a.sharding.memory_kind for a in jax.tree.leaves(list(tier.pages.values()))} == {"pinned_host"}
    assert runner._page_copies == compiled  # nothing compiled after warm-up
    kinds = {kind for kind, _ in compiled}
    assert {"read_list", "write_list"} <= kinds and not kinds & {"read_list_host", "write_list_host"}
    writes = [c for (kind, _), c in compiled.items() if kind == "write_list"]
    assert len(writes) == 4 and all("input_output_alias={ {0}: (0, {}, may-alias)" in c.as_text() for c in writes)


def test_pinned_pages_are_not_copied_again_on_the_host(model_dir, monkeypatch):
    """A sync's host work is a few calls a batch of pages: pages the gather wrote to pinned host memory
    ("in_program") are held as they are, never copied once more into host buffers (copy_to_host_async on each
    page's arrays: a host call and a host copy a page and leaf, on the path of the step that admits the hit)."""
    first, second = conversations(seed=3)
    tiered = small_engine(model_dir, host_pages=200, copies="in_program")
    copies_to_host = []
    original = jax._src.array.ArrayImpl.copy_to_host_async
    monkeypatch.setattr(jax._src.array.ArrayImpl, "copy_to_host_async",
                        lambda self: (copies_to_host.append(self), original(self))[1])
    run_one_by_one(tiered, first + second)
    tier = tiered.block_manager.host_tier
    assert tier.offloaded_pages > 0 and tier.restored_pages >= 15
    assert copies_to_host == []


@pytest.mark.parametrize("copies", ["device_put", "in_program"])
def test_a_page_travels_as_one_array(model_dir, monkeypatch, copies):
    """A Llama's K and V pools (one shape, dtype and placement) give a page as one array, K over V: the tier's
    sync moves one array a page each way (each array is a host call), and the restored pages give the
    recomputed tokens."""
    first, second = conversations(seed=4)
    plain, tiered = small_engine(model_dir), small_engine(model_dir, host_pages=200, copies=copies)
    assert tiered.runner._stacked_pages()
    page = tiered.runner.read_page_list(np.array([1, 2], np.int32))
    assert len(page) == 2 and all(isinstance(a, jax.Array) and a.shape[0] == 2 for a in page)
    puts = []
    device_put = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda x, *a, **k: puts.append(len(jax.tree.leaves(x))) or device_put(x, *a, **k))
    got = run_one_by_one(tiered, first + second)
    tier = tiered.block_manager.host_tier
    assert tier.offloaded_pages > 0 and tier.restored_pages >= 15
    # device_put: one array a page each way; in_program: the copies are inside the programs
    assert sum(puts) == (tier.offloaded_pages + tier.restored_pages if copies == "device_put" else 0)
    assert [t for t, _ in got] == [t for t, _ in run_one_by_one(plain, first + second)]


def test_a_full_host_tier_drops_its_least_recent_pages(model_dir):
    first, second = conversations(seed=1)
    tiered = small_engine(model_dir, host_pages=8)  # about half of one history
    want = run_one_by_one(small_engine(model_dir), first + second)
    got = run_one_by_one(tiered, first + second)
    assert [t for t, _ in got] == [t for t, _ in want]
    s = tiered.stats()
    assert s.host_cache_dropped_pages > 0 and s.host_cache_pages_used == s.host_cache_pages_total == 8
    # The device evicts a history's last pages first; the host keeps the 8 it got last (the earliest of
    # those pages), so the first history's second turn finds its head on the device, then part on host.
    assert 0 < s.host_cache_hit_tokens and 0 < got[3][1] < 120


@pytest.mark.parametrize("kv_cache_dtype,page_size,num_pages", [("int8", 32, 12), ("fp8", 8, 40)])
def test_quantized_pools_come_back_from_host_with_the_recomputed_tokens(model_dir, kv_cache_dtype, page_size, num_pages):
    """int8 pools (values and their scales, QuantizedKV leaves) and fp8 pools through the tier's default copies:
    each history's second turn finds it whole in the caches, partly from host memory, and the tokens are those
    of the same pool computing it again."""
    first, second = conversations(seed=3)
    engines = [jlight.LLM(model_dir, dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, min_token_bucket=64,
                          page_size=page_size, num_pages=num_pages, kv_cache_dtype=kv_cache_dtype,
                          kv_offloading_size=size, compilation_cache_dir=None).engine
               for size in (None, 300 * PAGE_BYTES / 2**30)]
    want, got = (run_one_by_one(e, first + second) for e in engines)
    assert [t for t, _ in got] == [t for t, _ in want]
    whole = 120 // page_size * page_size  # a history's full pages
    assert [c for _, c in got[3:]] == [whole] * 3 and [c for _, c in want[3:]] != [whole] * 3
    assert engines[1].stats().host_cache_hit_tokens > 0 and engines[1].block_manager.host_tier.copies == "in_program"


def test_preempted_sequences_recover_their_pages_from_host(model_dir):
    """Eight sequences at once in the small pool: preemptions release full pages, the pool evicts them,
    and re-admissions take them back from host memory; every token as in the engine without the tier."""
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 500, size=int(n)).tolist() for n in rng.integers(60, 110, size=8)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    results = {}
    for name, engine in (("reference", small_engine(model_dir)), ("tiered", small_engine(model_dir, host_pages=300))):
        for i, p in enumerate(prompts):
            engine.add_request(f"p{i}", None, params, prompt_token_ids=p)
        outs = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    outs[o.request_id] = o.outputs[0].token_ids
        results[name] = (outs, engine.stats())
    (want, ref_stats), (got, s) = results["reference"], results["tiered"]
    assert got == want
    assert ref_stats.num_preemptions > 0 and s.num_preemptions > 0
    assert s.host_cache_hit_tokens > 0 and s.num_pages_used == 0


def test_bad_offloading_sizes_are_refused_by_name(model_dir):
    with pytest.raises(ValueError, match="kv_offloading_size"):
        jlight.LLM(model_dir, dtype="float32", kv_offloading_size=-1.0)
    with pytest.raises(ValueError, match="kv_offloading_size.*prefix caching"):
        jlight.LLM(model_dir, dtype="float32", kv_offloading_size=1.0, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_offloading_size.*holds no page"):
        jlight.LLM(model_dir, dtype="float32", num_pages=8, kv_offloading_size=1e-9)


SHARDED = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    import jlight
    from test_host_tier import conversations, run_one_by_one

    first, second = conversations(seed=3)
    runs = {{}}
    for name, size in (("reference", None), ("tiered", 200 * {page_bytes} / 2**30)):
        engine = jlight.LLM({model!r}, dtype="float32", mesh="tp=2", max_num_seqs=4, max_num_batched_tokens=64,
                            min_token_bucket=64, page_size=8, num_pages=40, kv_offloading_size=size).engine
        runs[name] = dict(out=run_one_by_one(engine, first + second), hits=engine.stats().host_cache_hit_tokens)
    print("RESULT" + json.dumps(runs))
""")


def test_the_tier_under_a_tensor_parallel_mesh(model_dir):
    """tp=2 on two simulated devices: pages gathered from sharded pools, and scattered back into them."""
    import os

    out = run_script(SHARDED.format(tests=os.path.dirname(__file__), model=model_dir, page_bytes=PAGE_BYTES), 2)
    assert [t for t, _ in out["tiered"]["out"]] == [t for t, _ in out["reference"]["out"]]
    assert out["tiered"]["hits"] > 0 and [c for _, c in out["tiered"]["out"][3:]] == [120, 120, 120]


class _PoolRunner:
    """A runner's page interface over a small K pool ([1, 8 pages, 2] float32, page p holding p + 1) and a V
    pool without pages (as MLA's): read_pages gives None for it, as ModelRunner does."""

    def __init__(self):
        import jax.numpy as jnp

        self.k_cache = jnp.repeat(jnp.arange(1.0, 9.0)[None, :, None], 2, axis=2)
        self.v_cache = jnp.zeros((1, 1, 1))

    def read_pages(self, pages):
        return self.k_cache[:, pages], None

    def write_pages(self, pages, data):
        self.k_cache = self.k_cache.at[:, pages].set(data[0])

    def read_page_list(self, pages, host=False):
        assert not host  # the tiers here copy by device_put
        return [(self.k_cache[:, p:p + 1], None) for p in pages]

    def write_page_list(self, pages, data):
        import jax.numpy as jnp

        self.write_pages(pages, (jnp.concatenate([k for k, _ in data], axis=1), None))

    def page(self, p):
        return np.asarray(self.k_cache)[0, p].tolist()


@pytest.mark.parametrize("pinned", [None, False], ids=["pinned_host", "numpy"])
def test_tier_order_of_copies_and_lru_with_pages_reused_after_a_sync(pinned):
    from jlight.engine.host_tier import HostTier

    runner, tier = _PoolRunner(), HostTier(capacity=2, max_batch=2, pinned=pinned, copies="device_put")
    tier.offload(1, b"A")
    tier.offload(2, b"B")
    tier.sync(runner)
    assert b"A" in tier and b"B" in tier and tier.offloaded_pages == 2
    # Steps launched after the sync reuse the pages: the copies, dispatched before, keep the old contents.
    runner.write_pages(np.array([1, 2]), (np.full((1, 2, 2), -1.0, np.float32), None))
    tier.offload(1, b"A2")
    tier.sync(runner)
    assert tier.dropped_pages == 1 and b"A" not in tier  # the least recently used key made room
    # Restoring B makes it most recent, so the offload queued with it drops A2, not B; and the restore reads
    # B's slot before that offload's copy is given the slot.
    tier.offload(3, b"C")
    tier.restore(b"B", 5)
    tier.sync(runner)
    assert runner.page(5) == [3.0, 3.0] and b"B" in tier and b"C" in tier and b"A2" not in tier
    tier.restore(b"C", 6)
    tier.sync(runner)
    assert runner.page(6) == [4.0, 4.0] and tier.restored_pages == 2 and tier.num_used == 2
    assert runner.page(1) == runner.page(2) == [-1.0, -1.0] and runner.page(3) == [4.0, 4.0]


@pytest.mark.parametrize("pinned", [None, False], ids=["pinned_host", "numpy"])
def test_a_prefix_match_restores_pages_its_own_restores_evicted(pinned):
    """Restoring a prefix's head can evict the rest of the prefix from the device (no free page left): those
    keys, evicted in the same scheduling pass, are restored too (their pages keep their K/V until the step
    after the sync), not computed again."""
    from jlight.engine.block_manager import BlockManager
    from jlight.engine.host_tier import HostTier

    runner, tier = _PoolRunner(), HostTier(capacity=8, max_batch=4, pinned=pinned, copies="device_put")
    bm = BlockManager(num_pages=5, page_size=2, host_tier=tier)
    tokens = list(range(7))  # three full pages to match
    prefix = bm.allocate(3)  # pages 1, 2, 3 (K: 2.0, 3.0, 4.0)
    keys = bm.publish_full_pages(prefix, [], lambda a, b: tokens[a:b], 3)
    bm.release(prefix)
    for page in (2, 3):  # the head's page least recent
        bm.evictable.move_to_end(page)
    held = bm.allocate(2)  # the free page 4, then page 1: the head goes to the host
    tier.sync(runner)
    assert held == [4, 1] and keys[0] in tier and keys[1] in bm.cached and keys[2] in bm.cached
    pages, matched = bm.match_prefix(tokens)
    # The head comes back into page 2, evicting keys[1] there; keys[1] comes back into page 3, evicting keys[2];
    # keys[2] would need a page the match itself holds.
    assert (pages, matched) == ([2, 3], keys[:2])
    tier.sync(runner)
    assert runner.page(2) == [2.0, 2.0] and runner.page(3) == [3.0, 3.0]
    assert tier.restored_pages == 2 and tier.offloaded_pages == 3 and keys[2] in tier


class _BigPoolRunner:
    """A runner's page interface (ModelRunner's four page copies, donated writes) over a K pool of 1 MiB pages
    ([2 layers, pages, 2**17] float32, page p holding p) and a V pool without pages; counts its calls."""

    def __init__(self, num_pages: int):
        import jax
        import jax.numpy as jnp

        self.page_bytes = 2 * 2**17 * 4
        self.k_cache = jnp.broadcast_to(jnp.arange(num_pages, dtype=jnp.float32)[None, :, None], (2, num_pages, 2**17)) + 0
        self.v_cache = jnp.zeros((1, 1, 1))
        self.calls = {}
        self._write = jax.jit(lambda k, pages, d: k.at[:, pages].set(d), donate_argnums=(0,))
        self._write_list = jax.jit(lambda k, pages, d: k.at[:, pages].set(jnp.concatenate(d, axis=1)), donate_argnums=(0,))

    def _count(self, name):
        self.calls[name] = self.calls.get(name, 0) + 1

    def read_pages(self, pages):
        self._count("read_pages")
        return self.k_cache[:, pages], None

    def write_pages(self, pages, data):
        self._count("write_pages")
        self.k_cache = self._write(self.k_cache, pages, data[0])

    def read_page_list(self, pages, host=False):
        assert not host  # the tiers here copy by device_put
        self._count("read_page_list")
        return [(self.k_cache[:, p:p + 1], None) for p in pages]

    def write_page_list(self, pages, data):
        self._count("write_page_list")
        self.k_cache = self._write_list(self.k_cache, pages, [k for k, _ in data])


@pytest.mark.parametrize("n", [2, 8])
def test_a_sync_moves_pages_in_a_fixed_number_of_calls_and_never_through_numpy(n, monkeypatch):
    """Offloading n pages is one gather and one device_put to pinned_host memory; restoring them is one
    device_put back and one scatter with the pool donated; whatever n, and no page byte is copied into or
    out of a numpy array on the way (the host tier's pool is pinned_host memory, not numpy's)."""
    import tracemalloc

    import jax

    from jlight.engine import host_tier

    runner, tier = _BigPoolRunner(2 * n + 1), host_tier.HostTier(capacity=n, max_batch=n, copies="device_put")
    puts = []
    device_put = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda x, *a, **k: puts.append(len(jax.tree.leaves(x))) or device_put(x, *a, **k))
    jax.block_until_ready(runner.k_cache)
    tracemalloc.start()
    try:
        for i in range(n):
            tier.offload(1 + i, b"key%d" % i)
        tier.sync(runner)
        pool = runner.k_cache.unsafe_buffer_pointer()
        for i in range(n):
            tier.restore(b"key%d" % i, n + 1 + i)
        tier.sync(runner)
        jax.block_until_ready(runner.k_cache)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < runner.page_bytes / 2, f"{peak} bytes through numpy/Python for {n} pages of {runner.page_bytes}"
    assert {a.sharding.memory_kind for a in jax.tree.leaves(list(tier.pages.values()))} == {"pinned_host"}
    assert runner.calls == {"read_page_list": 1, "write_page_list": 1} and puts == [n, n]
    assert runner.k_cache.unsafe_buffer_pointer() == pool  # the scatter wrote into the donated pool
    k = np.asarray(runner.k_cache)
    assert (k[:, n + 1: 2 * n + 1] == k[:, 1: n + 1]).all() and k[0, n + 1:2 * n + 1, 0].tolist() == list(range(1, n + 1))


def test_warmup_takes_the_tiers_pinned_memory_where_asked(model_dir):
    """By default the engine's warm-up takes the tier's whole capacity on a GPU and nothing on the CPU; asked,
    warm-up takes it in chunks, frees it, and the tier then offloads and restores as before."""
    first, second = conversations(seed=2)
    tiered = small_engine(model_dir, host_pages=8)
    tier = tiered.block_manager.host_tier
    by_default = 8 * PAGE_BYTES if jax.default_backend() == "gpu" else 0
    assert tier.pinned and tier.reserved_bytes == by_default
    tier.reserve = True
    tier.warmup(tiered.runner, chunk_bytes=3 * PAGE_BYTES)
    assert tier.reserved_bytes == by_default + 8 * PAGE_BYTES and tier.reserve_seconds > 0
    got = run_one_by_one(tiered, first + second)
    assert len(got) == 6 and tiered.stats().host_cache_hit_tokens > 0


def test_a_tier_over_xlas_pinned_pool_is_refused_at_warmup(model_dir, monkeypatch):
    """A tier larger than XLA:GPU's pinned pool (XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB) fails at warm-up, naming the
    flag and the variable, not at some later offload."""
    engine = small_engine(model_dir, host_pages=8)
    tier = engine.block_manager.host_tier
    tier.reserve = True
    taken = tier.reserved_bytes  # by the engine's own warm-up on a GPU
    monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "0")
    with pytest.raises(ValueError, match="over XLA's pinned pool of 0 GiB; lower kv_offloading_size, or raise "
                                         "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"):
        tier.warmup(engine.runner)
    assert tier.reserved_bytes == taken


def test_restored_pages_hold_the_bytes_first_computed(model_dir):
    """bfloat16: every page cached under a key holds, bit for bit, what an engine whose pool never evicts holds
    under that key; the keys the tier restored among them. (Greedy tokens alone cannot show this where a
    recomputed page rounds differently from the first.)"""
    first, second = conversations(seed=3)

    def engine(num_pages, host_pages=None):
        size = None if host_pages is None else host_pages * PAGE_BYTES / 2 / 2**30  # bf16 pages: half float32's
        return jlight.LLM(model_dir, dtype="bfloat16", max_num_seqs=4, max_num_batched_tokens=64, min_token_bucket=64,
                          page_size=8, num_pages=num_pages, kv_offloading_size=size).engine

    whole, tiered = engine(400), engine(40, host_pages=200)
    restored = []
    restore = tiered.block_manager.host_tier.restore
    tiered.block_manager.host_tier.restore = lambda key, page: (restored.append(key), restore(key, page))[1]
    for e in (whole, tiered):
        run_one_by_one(e, first + second)
    assert whole.stats().host_cache_hit_tokens == 0 and tiered.stats().host_cache_hit_tokens > 0

    def page_bytes(e, key):
        page = e.runner.read_page_list(np.array([e.block_manager.cached[key]], np.int32))[0]
        return [np.asarray(a).tobytes() for a in jax.tree.leaves(page)]

    common = set(whole.block_manager.cached) & set(tiered.block_manager.cached)
    assert len(common & set(restored)) >= 10
    for key in common:
        assert page_bytes(tiered, key) == page_bytes(whole, key)
