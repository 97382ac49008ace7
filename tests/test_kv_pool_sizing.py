"""How many KV pages an engine takes on a device with memory statistics (a GPU): from
kv_cache_memory_fraction of what the weights left, or from vLLM's gpu_memory_utilization, and then
fewer where the largest step's own memory (XLA's memory analysis) would not fit beside them."""
import argparse
import os
import textwrap

import jax
import pytest

import jlight
from jlight import SamplingParams, engine_args
from jlight.engine import startup
from jlight.engine.engine_config import EngineConfig
from jlight.engine.model_runner import ModelRunner
from jlight.engine.startup import pages_beside_step, pages_for_memory, pool_beside_step, step_margin, step_memory_bytes
from simulated_devices import run_script

GIB = 2 ** 30
STATS = {"bytes_limit": 100 * GIB, "bytes_in_use": 20 * GIB}  # 20 GiB of weights loaded
PAGE = 2 * 2 ** 20  # 2 MiB a page
MIB = 2 ** 20


def test_kv_cache_memory_fraction_takes_a_share_of_what_is_left():
    assert pages_for_memory(STATS, PAGE, 0.8, None) == int(80 * GIB * 0.8) // PAGE


def test_gpu_memory_utilization_is_the_engines_whole_share():
    # vLLM's meaning: 0.9 of the memory for everything, the weights' 20 GiB included -> 70 GiB of pages.
    assert pages_for_memory(STATS, PAGE, 0.8, 0.9) == 70 * GIB // PAGE
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.15 allows 15.00 GiB, but the weights already use 20.00 GiB"):
        pages_for_memory(STATS, PAGE, 0.8, 0.15)


def test_gpu_memory_utilization_is_a_share_of_the_card_within_what_jax_manages(caplog):
    # JAX's allocator started with 90% of a 100 GiB card: 0.5 of the card is 50 GiB, 30 of them pages
    card = dict(STATS, bytes_limit=90 * GIB, card_bytes=100 * GIB)
    assert pages_for_memory(card, PAGE, 0.8, 0.5) == 30 * GIB // PAGE
    assert pages_beside_step(10 ** 9, card, PAGE, 4 * GIB, 0.5) == (26 * GIB - step_margin(4 * GIB)) // PAGE
    assert not caplog.records
    # ... with JAX's default 75%: 0.9 of the card (90 GiB) is more than the allocator's 75 GiB, which it gets, said so
    card = dict(STATS, bytes_limit=75 * GIB, card_bytes=100 * GIB)
    with caplog.at_level("WARNING", logger="jlight.engine.startup"):
        assert pages_for_memory(card, PAGE, 0.8, 0.9) == 55 * GIB // PAGE
    assert "JAX's allocator manages 75.00 GiB" in caplog.text and "XLA_PYTHON_CLIENT_MEM_FRACTION" in caplog.text


def test_an_engine_created_before_jax_starts_gives_its_allocator_the_cards_share(monkeypatch):
    """JAX reads XLA_PYTHON_CLIENT_MEM_FRACTION once, as its backend starts: an engine given gpu_memory_utilization
    sets it to that share where it is unset and JAX has not started; otherwise it leaves it, and reads what JAX
    manages from it (device_memory_stats' card_bytes)."""
    started = []
    monkeypatch.setattr(startup.xla_bridge, "backends_are_initialized", lambda: bool(started))
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75")  # recorded, so teardown restores what was there
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")
    assert not startup.claim_device_memory(EngineConfig())  # no gpu_memory_utilization: JAX's default stays
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ and startup.jax_mem_fraction() == 0.75
    assert startup.claim_device_memory(EngineConfig(gpu_memory_utilization=0.9))
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.9" and startup.jax_mem_fraction() == 0.9
    assert not startup.claim_device_memory(EngineConfig(gpu_memory_utilization=0.5))  # the user's (or first) setting
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.9"
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")
    started.append(True)
    assert not startup.claim_device_memory(EngineConfig(gpu_memory_utilization=0.9))  # too late: JAX has started
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ
    device = type("Device", (), {"memory_stats": lambda self: {"bytes_limit": 60 * GIB, "bytes_in_use": 0}})()
    monkeypatch.setattr(startup.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(startup.jax, "local_devices", lambda: [device])
    assert startup.device_memory_stats()["card_bytes"] == 80 * GIB  # 60 GiB is JAX's default 75%


def test_a_start_keeps_the_last_starts_pool_when_near_it():
    """The pool's shape keys every stored step: a warm start that finds a few hundred MB more (or less) in use
    keeps the pool the last start chose; one far from it (another card, other weights) sizes its own."""
    cfg = EngineConfig()
    cold = {"bytes_limit": 100 * GIB, "bytes_in_use": 20 * GIB + 37 * MIB}
    size = lambda stats, last=None: startup.kv_pool_pages(cfg, PAGE, None, 4096, 0, stats, last and [last])  # noqa: E731
    first = size(cold)
    assert first == pages_for_memory(cold, PAGE, 0.8, None)
    for moved in (208 * MIB, 512 * MIB, -300 * MIB):  # 0.8 of it: within 512 MiB of pages
        warm = {**cold, "bytes_in_use": cold["bytes_in_use"] + moved}
        assert pages_for_memory(warm, PAGE, 0.8, None) != first and size(warm, first) == first
    far = {**cold, "bytes_in_use": cold["bytes_in_use"] + GIB}
    assert size(far, first) == pages_for_memory(far, PAGE, 0.8, None) < first
    # within 512 MiB but over 2% of a small pool: its own size
    small = {"bytes_limit": 10 * GIB, "bytes_in_use": 9 * GIB}
    assert size(small, size(small) + 10) == size(small) == int(GIB * 0.8) // PAGE
    assert startup.settled_pages(1000, [], PAGE) == 1000 and startup.settled_pages(1000, [1], PAGE) == 1000
    assert startup.settled_pages(1000, [1015, 990, 5000], PAGE) == 990  # the nearest


def test_the_pool_beside_the_step_sits_below_its_room_and_settles_within_it():
    """A pool shrunk for the step's room leaves room_reserve of it (384 MiB) free, so that the next start, finding up
    to that much more or less in use, keeps the same size (and its stored steps) without taking the step's memory."""
    cfg = EngineConfig(gpu_memory_utilization=0.9)
    p0 = pages_for_memory(STATS, PAGE, 0.8, 0.9)
    step = 4 * GIB
    room = pages_beside_step(p0, STATS, PAGE, step, 0.9)
    reserve = startup.room_reserve(room, PAGE)
    assert reserve == 384 * MIB // PAGE and room < p0
    own = pool_beside_step(cfg, p0, STATS, PAGE, step, 2048, 0, pages_per_sequence=513)
    assert own == room - reserve
    size = lambda stats, last: pool_beside_step(cfg, p0, stats, PAGE, step, 2048, 0, 513, last_sizes=last)  # noqa: E731
    for moved in (-380 * MIB, -100 * MIB, 0, 100 * MIB, 380 * MIB):  # either way, within the reserve: the same size
        assert size({**STATS, "bytes_in_use": STATS["bytes_in_use"] + moved}, [own]) == own
    # more in use than the reserve: the last size would take the step's room, so a size of its own
    tighter = {**STATS, "bytes_in_use": STATS["bytes_in_use"] + 400 * MIB}
    assert size(tighter, [own]) == pages_beside_step(p0, tighter, PAGE, step, 0.9) - reserve < own
    assert size(STATS, [room + 1]) == own  # never above the room
    assert size(STATS, [room, own - 50]) == own - 50  # the nearest to its own size
    assert size(STATS, [own - reserve - 1]) == own  # too far below
    # a small pool: the reserve is at most 1% of its room
    assert startup.room_reserve(1000, PAGE) == 10


@pytest.mark.parametrize("value", [0.0, 1.5, -0.1])
def test_gpu_memory_utilization_outside_0_1_is_refused(value):
    with pytest.raises(ValueError, match="gpu_memory_utilization.*must be in \\(0, 1\\]"):
        EngineConfig(gpu_memory_utilization=value).validate()


def test_the_cli_passes_gpu_memory_utilization():
    parser = argparse.ArgumentParser()
    engine_args.add_engine_arguments(parser)
    assert engine_args.engine_options(parser.parse_args(["--gpu-memory-utilization", "0.9"]))["gpu_memory_utilization"] == 0.9


# ---- room for the largest step (startup.pages_beside_step, pool_beside_step, step_memory_bytes) ----------


def test_the_pool_keeps_its_pages_when_the_step_fits_beside_them():
    p0 = pages_for_memory(STATS, PAGE, 0.8, None)  # 64 GiB of pages; 16 GiB of the 80 left over
    assert pages_beside_step(p0, STATS, PAGE, 10 * GIB, None) == p0  # 10 GiB + 512 MiB margin fit in 16 GiB


def test_the_pool_shrinks_by_exactly_what_the_step_and_its_margin_need():
    p0 = pages_for_memory(STATS, PAGE, 0.8, 0.9)  # vLLM's meaning: the budget less the weights, all of it pages
    step = 4 * GIB
    assert step_margin(step) == 256 * MIB  # 5% (205 MiB) is below the floor
    assert pages_beside_step(p0, STATS, PAGE, step, 0.9) == p0 - (4 * GIB + 256 * MIB) // PAGE
    assert step_margin(20 * GIB) == GIB  # 5% above the floor
    p0 = pages_for_memory(STATS, PAGE, 0.8, None)
    # kv_cache_memory_fraction: the budget is bytes_limit; 80 GiB left - 20 GiB step - 1 GiB margin = 59 GiB of pages
    assert pages_beside_step(p0, STATS, PAGE, 20 * GIB, None) == 59 * GIB // PAGE < p0
    # a hybrid model's recurrent state comes out of the same room
    assert pages_beside_step(p0, STATS, PAGE, 20 * GIB, None, state_bytes=GIB) == 58 * GIB // PAGE


def test_the_pool_and_the_step_fit_the_largest_free_block():
    """Free memory split between the weights counts in bytes_limit - bytes_in_use but holds neither the pool nor a
    step's temporaries (Llama-3-8B at gpu_memory_utilization 0.9 on an H100: out of memory in the first steps).
    Where the allocator reports its largest free block, pool + state + step + margin fit in it; where it grows its
    pool on demand, the part of the limit it has not taken counts as one block."""
    p0 = pages_for_memory(STATS, PAGE, 0.8, 0.9)  # 70 GiB of pages: 90 - 20
    step, margin = 4 * GIB, step_margin(4 * GIB)
    whole = pages_beside_step(p0, STATS, PAGE, step, 0.9)
    assert whole == p0 - (step + margin) // PAGE
    split = dict(STATS, largest_free_block_bytes=69 * GIB)  # 1 GiB of the 70 free lies in holes between the weights
    assert pages_beside_step(p0, split, PAGE, step, 0.9) == (69 * GIB - step - margin) // PAGE == whole - GIB // PAGE
    assert pages_beside_step(p0, split, PAGE, step, 0.9, state_bytes=GIB) == (68 * GIB - step - margin) // PAGE
    assert pages_beside_step(p0, dict(STATS, largest_free_block_bytes=80 * GIB), PAGE, step, 0.9) == whole  # no holes
    growing = dict(split, largest_free_block_bytes=GIB, pool_bytes=30 * GIB)  # 70 GiB of the limit not yet taken
    assert pages_beside_step(p0, growing, PAGE, step, 0.9) == whole


def test_a_step_that_leaves_no_sequence_room_names_the_knobs():
    cfg = EngineConfig(gpu_memory_utilization=0.9).validate()
    p0 = pages_for_memory(STATS, PAGE, 0.8, 0.9)
    with pytest.raises(ValueError) as e:
        pool_beside_step(cfg, p0, STATS, PAGE, 69 * GIB, 16384, 0, pages_per_sequence=513)
    for name in ("max_num_batched_tokens", "gpu_memory_utilization=0.9", "kv_cache_memory_fraction=0.8", "max_model_len"):
        assert name in str(e.value)
    # room for a sequence: no error, the pool shrinks (and leaves its reserve)
    room = (10 * GIB - 3 * GIB) // PAGE
    reserve = startup.room_reserve(room, PAGE)
    assert pool_beside_step(cfg, p0, STATS, PAGE, 60 * GIB, 16384, 0, pages_per_sequence=513) == room - reserve
    # a reserve that would leave less than one sequence does not
    assert pool_beside_step(cfg, p0, STATS, PAGE, 60 * GIB, 16384, 0, pages_per_sequence=room - 1) == room - 1
    # a step XLA could not measure: today's rule
    assert pool_beside_step(cfg, p0, STATS, PAGE, None, 16384, 0, pages_per_sequence=513) == p0


class _Analysis:
    temp_size_in_bytes, generated_code_size_in_bytes, output_size_in_bytes, alias_size_in_bytes = 1000, 24, 300, 200


class _Compiled:
    def __init__(self, analysis):
        self.analysis = analysis

    def memory_analysis(self):
        if isinstance(self.analysis, Exception):
            raise self.analysis
        return self.analysis


def test_step_memory_is_temp_code_and_unaliased_outputs_of_the_costliest_variant():
    assert step_memory_bytes([_Compiled(_Analysis())]) == 1000 + 24 + 100
    bigger = _Analysis()
    bigger.temp_size_in_bytes = 5000
    assert step_memory_bytes([_Compiled(_Analysis()), _Compiled(bigger)]) == 5000 + 24 + 100
    # no analysis on some backend or JAX (a stand-in that raises NotImplementedError): None, and the pool keeps P0 pages
    assert step_memory_bytes([_Compiled(None)]) is None
    assert step_memory_bytes([_Compiled(NotImplementedError("no"))]) is None
    assert step_memory_bytes([]) is None


# ---- an engine on a device with (fake) memory statistics -----------------------------------------------

def _engine_on_fake_device(model, monkeypatch, stats, **options):
    """The tiny model with buckets of 8 and 16 tokens, on a device whose allocator reports `stats`; returns
    (engine, the step compiles it made)."""
    monkeypatch.setattr(startup, "device_memory_stats", lambda: dict(stats))
    compiles = []
    compile_step = ModelRunner._compile

    def counting(self, lowered, *args):
        compiles.append(lowered)
        return compile_step(self, lowered, *args)

    monkeypatch.setattr(ModelRunner, "_compile", counting)
    llm = jlight.LLM(model, dtype="float32", max_num_seqs=2, max_num_batched_tokens=16, min_token_bucket=8, max_model_len=128,
                     compilation_cache_dir=None, **options)
    return llm, compiles


def _room_is_left(engine, stats, budget):
    """The pool, its largest step's measured memory and the margin fit the budget."""
    runner = engine.runner
    step = step_memory_bytes(runner.compiled_steps(runner.buckets[-1]))  # read back from the compiled bucket
    assert step is not None and step > 0
    pool = sum(leaf.nbytes for leaf in jax.tree.leaves((runner.k_cache, runner.v_cache)))
    assert pool == runner.num_pages * engine._pool_bytes_per_page(jax.numpy.float32, None)
    assert stats["bytes_in_use"] + pool + step + step_margin(step) <= budget
    return step


def test_an_engine_keeps_its_pool_and_compiles_the_largest_bucket_once(tiny_model, monkeypatch):
    stats = {"bytes_limit": 300 * MIB, "bytes_in_use": 0}
    llm, compiles = _engine_on_fake_device(tiny_model("LlamaForCausalLM"), monkeypatch, stats, kv_cache_memory_fraction=0.05)
    engine, runner = llm.engine, llm.engine.runner
    assert runner.num_pages == pages_for_memory(stats, engine._pool_bytes_per_page(jax.numpy.float32, None), 0.05, None)
    _room_is_left(engine, stats, stats["bytes_limit"])
    assert len(compiles) == runner.num_step_variants(runner.buckets)  # the measured buckets were kept, not compiled again
    out = llm.generate([list(range(3, 23))], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4 and runner._step._cache_size() == 0  # the kept executable ran


def test_an_engine_without_warmup_compiles_only_the_largest_bucket_to_size_its_pool(tiny_model, monkeypatch):
    stats = {"bytes_limit": 300 * MIB, "bytes_in_use": 0}
    llm, compiles = _engine_on_fake_device(tiny_model("LlamaForCausalLM"), monkeypatch, stats, kv_cache_memory_fraction=0.05,
                                           warmup=False)
    runner = llm.engine.runner
    assert runner.buckets == [8, 16] and len(compiles) == runner.num_step_variants([16])
    assert runner.is_compiled(16) and not runner.is_compiled(8)
    _room_is_left(llm.engine, stats, stats["bytes_limit"])


def test_an_engine_shrinks_its_pool_by_the_largest_steps_memory(tiny_model, monkeypatch):
    stats = {"bytes_limit": 300 * MIB, "bytes_in_use": 10 * MIB}
    llm, compiles = _engine_on_fake_device(tiny_model("LlamaForCausalLM"), monkeypatch, stats, gpu_memory_utilization=0.95)
    engine, runner = llm.engine, llm.engine.runner
    per_page = engine._pool_bytes_per_page(jax.numpy.float32, None)
    p0 = pages_for_memory(stats, per_page, 0.8, 0.95)
    step = _room_is_left(engine, stats, int(300 * MIB * 0.95))
    room = pages_beside_step(p0, stats, per_page, step, 0.95)
    assert runner.num_pages == room - startup.room_reserve(room, per_page) < p0
    # gpu_memory_utilization: the pool always shrinks beside the step, so the largest bucket alone measured it
    # against the first pool, and every bucket compiled once against the smaller one
    assert len(compiles) == runner.num_step_variants(runner.buckets[-1:]) + runner.num_step_variants(runner.buckets)
    assert engine.block_manager.num_pages == runner.num_pages


def test_every_bucket_compiles_before_the_pool_takes_its_memory(tiny_model, monkeypatch):
    """XLA:GPU autotunes a step's GEMMs on buffers of their own while compiling: the pool is allocated after
    every bucket has compiled against its final size, not before (an 8B-class model at gpu_memory_utilization
    0.9 ran out of memory in the autotuner otherwise)."""
    allocated_after = []
    allocate = ModelRunner.allocate_pools

    def recording(self, num_pages):
        allocated_after.append((num_pages, all(self.is_compiled(T) for T in self.buckets)))
        return allocate(self, num_pages)

    monkeypatch.setattr(ModelRunner, "allocate_pools", recording)
    stats = {"bytes_limit": 300 * MIB, "bytes_in_use": 10 * MIB}
    llm, compiles = _engine_on_fake_device(tiny_model("LlamaForCausalLM"), monkeypatch, stats, gpu_memory_utilization=0.95)
    runner = llm.engine.runner
    assert allocated_after == [(runner.num_pages, True)]
    # the largest bucket measured the step against the first pool, then every bucket compiled once against
    # the sized one, and none after the allocation
    assert len(compiles) == runner.num_step_variants(runner.buckets[-1:]) + runner.num_step_variants(runner.buckets)
    out = llm.generate([list(range(3, 23))], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4 and runner._step._cache_size() == 0  # the compiled steps ran


def test_an_engine_whose_step_leaves_no_room_refuses_to_start(tiny_model, monkeypatch):
    stats = {"bytes_limit": 300 * MIB, "bytes_in_use": 44 * MIB}  # 256 MiB left: the margin alone
    with pytest.raises(ValueError, match="max_num_batched_tokens.*gpu_memory_utilization=1.0"):
        _engine_on_fake_device(tiny_model("LlamaForCausalLM"), monkeypatch, stats, gpu_memory_utilization=1.0)


MESH_SCRIPT = textwrap.dedent("""
    import json
    import jax
    import jlight
    from jlight import SamplingParams
    from jlight.engine import startup

    MIB = 2 ** 20
    stats = {{"bytes_limit": 300 * MIB, "bytes_in_use": 10 * MIB}}
    startup.device_memory_stats = lambda: dict(stats)  # every device's allocator reports these
    options = dict(dtype="float32", max_num_seqs=2, max_num_batched_tokens=16, min_token_bucket=8, max_model_len=128,
                   compilation_cache_dir=None)
    llm = jlight.LLM({path!r}, mesh="tp=2", gpu_memory_utilization=0.95, **options)
    runner = llm.engine.runner
    pools = jax.tree.leaves((runner.k_cache, runner.v_cache))
    pool = sum(leaf.addressable_shards[0].data.nbytes for leaf in pools)  # on one device
    step = startup.step_memory_bytes(runner.compiled_steps(runner.buckets[-1]))
    p0 = startup.pages_for_memory(stats, pool // runner.num_pages, 0.8, 0.95)
    prompt = list(range(3, 40))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    alone = jlight.LLM({path!r}, num_pages=64, **options).generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    print("RESULT" + json.dumps(dict(pool=pool, step=step, margin=startup.step_margin(step), p0=p0, pages=runner.num_pages,
                                     manager_pages=llm.engine.block_manager.num_pages, devices=len(pools[0].sharding.device_set),
                                     tokens=tokens, alone=alone)))
""")


def test_a_tp2_engine_sizes_each_devices_pool_beside_the_step(tiny_model):
    """Under a mesh the pool starts abstract with its shardings, the largest step compiles against it, and one
    device's share of the pool, the step's own memory and the margin fit that device's budget."""
    r = run_script(MESH_SCRIPT.format(path=tiny_model("LlamaForCausalLM")), 2)
    assert r["devices"] == 2 and r["step"] > 0
    assert r["pages"] == r["manager_pages"] < r["p0"]  # shrunk beside the step
    assert 10 * MIB + r["pool"] + r["step"] + r["margin"] <= int(300 * MIB * 0.95)
    assert r["tokens"] == r["alone"]
