"""matmul_impl="mosaic": int8 weights stored transposed for JAX's bundled Mosaic GPU kernel.

The kernel itself runs only on a Hopper GPU (it has no interpret mode; checked against the XLA
reference on the H200 by benchmarks/kernels.py). Here, on the CPU: the transposed weights' XLA path
computes what the untransposed int8 weights do, the conversion touches only weight-only int8
leaves, and an engine with matmul_impl="mosaic" decodes the same greedy tokens as the reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jlight
from jlight import SamplingParams
from jlight.models.layers import FusedWeight
from jlight.pallas_kernels import matmul_mosaic, matmul_reference
from jlight.pallas_kernels.matmul_mosaic import TransposedInt8Weight, transpose_int8_weights
from jlight.pallas_kernels.quantization import W8A8Weight, quantize_int8


@pytest.mark.parametrize("lead", [(3,), (2, 5)])
def test_transposed_weight_matches_the_untransposed_int8_matmul(lead):
    rng = np.random.default_rng(0)
    w = quantize_int8(jnp.asarray(rng.normal(0, 0.05, (256, 384)), jnp.float32))
    x = jnp.asarray(rng.normal(0, 1, lead + (256,)), jnp.float32)
    wt = transpose_int8_weights(w)
    assert isinstance(wt, TransposedInt8Weight) and wt.values_t.shape == (384, 256)
    np.testing.assert_array_equal(np.asarray(wt.values_t), np.asarray(w.values).T)
    got = matmul_mosaic.matmul(x, wt)
    want = matmul_reference.matmul(x, w)
    assert got.shape == lead + (384,)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    # plain weights pass through to the reference unchanged
    plain = jnp.asarray(rng.normal(0, 0.05, (256, 384)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(matmul_mosaic.matmul(x, plain)), np.asarray(matmul_reference.matmul(x, plain)))


def test_only_weight_only_int8_leaves_are_transposed_and_originals_can_be_freed():
    rng = np.random.default_rng(1)
    q = quantize_int8(jnp.asarray(rng.normal(0, 0.05, (64, 32)), jnp.float32))
    fused = FusedWeight(quantize_int8(jnp.asarray(rng.normal(0, 0.05, (64, 48)), jnp.float32)), (16, 32))
    w8a8 = W8A8Weight(*quantize_int8(jnp.asarray(rng.normal(0, 0.05, (64, 32)), jnp.float32)))
    plain = jnp.ones((4, 4))
    out = transpose_int8_weights({"q": q, "fused": fused, "w8a8": w8a8, "plain": plain}, delete_originals=True)
    assert isinstance(out["q"], TransposedInt8Weight) and out["q"].values_t.shape == (32, 64)
    assert isinstance(out["fused"], FusedWeight) and out["fused"].widths == (16, 32)
    assert isinstance(out["fused"].weight, TransposedInt8Weight)
    assert type(out["w8a8"]) is W8A8Weight and out["w8a8"].values is w8a8.values and out["plain"] is plain
    assert q.values.is_deleted() and fused.weight.values.is_deleted() and not w8a8.values.is_deleted()


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("LlamaForCausalLM", max_position_embeddings=512)


def test_engine_with_mosaic_matmuls_decodes_like_the_reference(model_dir):
    prompts = [[5, 17, 99, 3, 42, 8, 200], [7, 64, 31]]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = {}
    for impl, loop in (("reference", "scan"), ("mosaic", "scan"), ("mosaic", "unroll")):
        llm = jlight.LLM(model_dir, dtype="float32", quantization="int8", matmul_impl=impl, layer_loop=loop,
                         max_num_seqs=2, max_num_batched_tokens=16, num_pages=32, compilation_cache_dir=None)
        layers = llm.engine.runner.params["layers"]
        first = layers[0] if isinstance(layers, list) else layers
        assert isinstance(first["wqkv"].weight, TransposedInt8Weight) == (impl == "mosaic")
        assert isinstance(llm.engine.runner.params["lm_head"], TransposedInt8Weight) == (impl == "mosaic")
        outs[impl, loop] = [r.outputs[0].token_ids for r in llm.generate(prompts, greedy, use_tqdm=False)]
    assert outs["mosaic", "scan"] == outs["mosaic", "unroll"] == outs["reference", "scan"]


def test_mosaic_under_a_mesh_is_refused_with_the_fix(model_dir):
    with pytest.raises(ValueError, match="matmul_impl='mosaic' runs on one device"):
        jlight.LLM(model_dir, dtype="float32", quantization="int8", matmul_impl="mosaic", mesh="tp=1",
                   max_num_seqs=2, max_num_batched_tokens=16, num_pages=32, compilation_cache_dir=None)
