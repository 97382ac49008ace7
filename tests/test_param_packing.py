"""The step's small parameter vectors grouped into one array a dtype (param_packing.py, EngineConfig.pack_small_params):
the same tokens as transformers, the same logprobs as the unpacked engine, and fewer arrays a step call."""
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from families_common import check_engine, hf_model
from simulated_devices import run_script
from jlight.core.quantization import QuantizedWeight
from jlight.engine import param_packing

ARCH = "GptOssForCausalLM"


def test_small_vectors_are_grouped_and_come_back_exactly():
    """Vectors of at most max_bytes are grouped by dtype; matrices, larger vectors and a weight object's fields
    stay arguments of their own; unpack gives back every array as it was."""
    params = {
        "norm": jnp.arange(8, dtype=jnp.float32),
        "layers": [{"bias": jnp.full((3,), i, jnp.bfloat16), "w": jnp.ones((4, 4), jnp.float32),
                    "q": QuantizedWeight(jnp.ones((4, 4), jnp.int8), jnp.arange(4, dtype=jnp.float32))} for i in range(2)],
        "big": jnp.zeros((1000,), jnp.float32),  # 4000 bytes: over the bound below
        "scalar_like": (jnp.ones((2,), jnp.float32),),
    }
    plan = param_packing.plan(params, max_bytes=1024)
    assert plan.num_packed == 4  # norm, the two biases, the tuple's vector
    assert sorted((str(dtype), size) for dtype, _, size in plan.groups) == [("bfloat16", 6), ("float32", 10)]
    rest, packed = param_packing.pack(params, plan)
    assert len(packed) == 2 and len(jax.tree.leaves((rest, packed))) == len(jax.tree.leaves(params)) - 4 + 2
    back = jax.jit(lambda r, p: param_packing.unpack(r, p, plan))(rest, packed)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    other = dict(params, extra=jnp.ones((2,)))
    with pytest.raises(ValueError, match="structure"):
        param_packing.pack(other, plan)


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model(ARCH), hf_model(tiny_model(ARCH), ARCH)


def test_an_engine_with_packed_params_matches_transformers_and_its_unpacked_self(model):
    """gpt-oss (norms, q/k/v/o biases, sinks, the router's bias among its vectors): transformers' greedy tokens
    through the full engine (preemption, prefix cache, chunks across windows), each step passing fewer arrays,
    and the unpacked engine's logprobs."""
    packed = check_engine(*model, pack_small_params=True)
    plain = check_engine(*model)
    for a, b in zip(packed, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_the_step_takes_fewer_arrays_and_the_same_logprobs(model):
    import jlight
    from jlight import SamplingParams

    path, _ = model
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    outs, arrays = {}, {}
    for pack in (False, True):
        llm = jlight.LLM(path, dtype="float32", max_num_batched_tokens=16, min_token_bucket=16, max_num_seqs=4,
                         page_size=8, num_pages=24, compilation_cache_dir=None, pack_small_params=pack)
        runner = llm.engine.runner
        plan = runner._pack_plan
        packed = (plan.num_packed, len(plan.groups)) if plan is not None else (0, 0)
        arrays[pack] = (len(jax.tree.leaves(runner.step_params)), len(jax.tree.leaves(runner.params)), *packed)
        outs[pack] = llm.generate(prompts, params, use_tqdm=False)
        assert runner._step._cache_size() == 0  # warmed-up executables ran, nothing compiled after
    assert arrays[False][:2] == (37, 37) and arrays[False][2:] == (0, 0)
    # each of the 2 layers' 2 norms, 4 biases (q, k, v, o), sinks and router bias, and the final norm: one array
    assert arrays[True] == (37 - 17 + 1, 37, 17, 1)
    for a, b in zip(outs[True], outs[False]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert len(a.outputs[0].logprobs) == len(b.outputs[0].logprobs) == 8
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert len(la) >= 3
            assert la.keys() == lb.keys()
            np.testing.assert_allclose(list(la.values()), [lb[k] for k in la], atol=1e-6)


SHARDED = textwrap.dedent("""
    import json, jax, jlight
    from jlight import SamplingParams
    out = {{}}
    for pack in (False, True):
        llm = jlight.LLM({path!r}, dtype="float32", mesh="tp=2", max_num_batched_tokens=16, min_token_bucket=16,
                         max_num_seqs=4, page_size=8, num_pages=24, compilation_cache_dir=None, pack_small_params=pack)
        runner = llm.engine.runner
        outs = llm.generate([[5, 6, 7, 8, 9, 10], [11, 12, 13]], SamplingParams(max_tokens=8, temperature=0.0,
                            ignore_eos=True), use_tqdm=False)
        plan = runner._pack_plan
        out[str(pack)] = dict(tokens=[o.outputs[0].token_ids for o in outs],
                              packed=plan.num_packed if plan else 0, groups=len(plan.groups) if plan else 0,
                              sharded=sum(not a.sharding.is_fully_replicated for a in jax.tree.leaves(runner.params)))
    print("RESULT" + json.dumps(out))
""")


def test_under_tp2_only_replicated_vectors_are_grouped(model):
    """tp=2 on two simulated CPU devices: the sharded arrays stay arguments of their own, the replicated vectors
    are grouped, and the tokens are the unpacked engine's."""
    path, _ = model
    out = run_script(SHARDED.format(path=path), 2)
    plain, packed = out["False"], out["True"]
    assert packed["tokens"] == plain["tokens"] and len(plain["tokens"][0]) == 8
    assert packed["sharded"] > 0 and packed["packed"] > 0 and packed["groups"] >= 1
