"""The step's host inputs packed into two buffers (jlight/engine/step_packing.py): every leaf comes
back exactly, and warm-up compiles the layouts that serving uses."""
import numpy as np
import pytest

import jax
from jlight import SamplingParams
from jlight.engine import sampler, step_packing
from jlight.engine.model_runner import StepInputs, _pad_to_bucket
from jlight.engine.scheduler import SchedulePlan
from jlight.core.batch_metadata import BatchMetadata


def awkward_step_inputs(T, B, max_pages=5, seed=0):
    """A StepInputs of prepare's shapes and dtypes, filled with values a careless packing would break."""
    rng = np.random.default_rng(seed)

    def ints(*shape):
        a = rng.integers(-2**31, 2**31, size=shape, dtype=np.int64).astype(np.int32)
        a.flat[::3] = -1
        a.flat[1::5] = np.iinfo(np.int32).min
        return a

    def floats(*shape):
        a = rng.standard_normal(shape).astype(np.float32)
        a.flat[::2] = np.resize(np.float32([0.5, 1e-8, -0.0, 1e30, -np.inf]), a.flat[::2].shape)
        return a

    seed_col = rng.integers(0, 2**32, size=B, dtype=np.uint64).astype(np.uint32)
    seed_col[0], seed_col[-1] = 2**32 - 1, 2**31
    md = BatchMetadata(ints(T), ints(T), ints(T), ints(B, max_pages), ints(B), ints(B + 1), ints(B))
    s = sampler.SamplingInputs(floats(B), ints(B), floats(B), floats(B), floats(B), floats(B), floats(B), seed_col, ints(B),
                               ints(B, sampler.NUM_BANNED), ints(B, sampler.NUM_BIAS), floats(B, sampler.NUM_BIAS),
                               np.bool_(True), np.bool_(False), np.bool_(True), np.bool_(False), ints(B))
    return StepInputs(ints(T), ints(T), md, s, ints(B), ints(B), ints(B), ints(B), ints(T), np.bool_(False))


@pytest.mark.parametrize("tree", [
    awkward_step_inputs(1, 1),
    awkward_step_inputs(64, 64, seed=1),
    (np.array([[True, False], [False, True]]), np.float32([0.5, 1e-8]), np.uint32([0, 2**31, 2**32 - 1])),
], ids=["step-1", "step-64", "bool-matrix"])
def test_unpack_on_device_restores_every_leaf_exactly(tree):
    ints, floats, layout = step_packing.pack(tree)
    assert ints.dtype == np.int32 and floats.dtype == np.float32
    assert ints.size + floats.size == sum(np.size(a) for a in jax.tree.leaves(tree))
    back = jax.jit(step_packing.unpack, static_argnums=0)(layout, ints, floats)
    assert jax.tree.structure(back) == jax.tree.structure(tree)
    for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(tree)):
        got = np.asarray(got)
        assert got.dtype == want.dtype and got.shape == np.shape(want)
        assert got.tobytes() == np.asarray(want).tobytes()  # bit for bit (-0.0, -inf, uint32 >= 2**31)


def test_layout_is_cached_per_shape_and_rejects_other_dtypes():
    a, b = awkward_step_inputs(8, 4, seed=2), awkward_step_inputs(8, 4, seed=3)
    assert step_packing.pack(a)[2] is step_packing.pack(b)[2]  # same shapes: the same static argument
    assert step_packing.pack(awkward_step_inputs(16, 4))[2] != step_packing.pack(a)[2]
    with pytest.raises(TypeError, match="int64"):
        step_packing.pack((np.zeros(3, np.int64),))


def test_warmup_packs_to_the_layouts_serving_uses(tiny_model):
    """Each bucket's warm-up input has the layout of real steps in that bucket (so serving never compiles)."""
    from jlight.engine.engine_config import EngineConfig
    from jlight.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=tiny_model("LlamaForCausalLM"), dtype="float32", max_num_seqs=12,
                                    max_num_batched_tokens=32, num_pages=64, min_token_bucket=8, compilation_cache_dir=None, warmup=False))
    runner = engine.runner
    assert runner.buckets == [8, 16, 32]
    served = {}
    real_prepare = runner.prepare

    def record(plan, slots, fill_masks=None):
        inp, guide_mask = real_prepare(plan, slots, fill_masks)
        served.setdefault(len(inp.tokens), set()).add(step_packing.pack(inp)[2])
        return inp, guide_mask

    runner.prepare = record
    params = [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=5, seed=7, logprobs=2, prompt_logprobs=1, repetition_penalty=1.2,
                             logit_bias={3: 1.5}, min_tokens=2, max_tokens=3)]
    for n, length in enumerate([5, 12, 30]):  # prompts that fill each bucket
        for k, p in enumerate(params):
            engine.add_request(f"r{n}-{k}", None, p, prompt_token_ids=list(range(3, 3 + length)))
        engine.run_to_completion()
    assert sorted(served) == runner.buckets
    for T in runner.buckets:
        warm = _pad_to_bucket(real_prepare(SchedulePlan([], []), {})[0], T, min(T, runner.max_num_seqs), runner.num_samples(T), runner.max_pages_per_seq, runner)
        assert served[T] == {step_packing.pack(warm)[2]}, f"bucket {T}"
