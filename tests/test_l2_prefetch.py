"""The L2 prefetch hint (pallas_kernels/l2_prefetch.py): what it plans to bring in, that it never
changes a value, and that its CUDA kernel (Mosaic GPU's interpreter has no prefetch) lowers with
the TMA prefetch instruction, one per decoder layer of the model, behind the tensor it waits for."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_batches import random_batch

from jlight.config import ModelConfig
from jlight.models import llama
from jlight.pallas_kernels import attention_reference, dispatch, l2_prefetch, matmul_reference
from jlight.pallas_kernels.quantization import QuantizedWeightT

S = jax.ShapeDtypeStruct
TMA_PREFETCH = "cp.async.bulk.prefetch.tensor.2d.L2"


def _lowered_text(fn, *avals):
    return jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",)).as_text()


def test_plan_takes_whole_matrices_then_the_first_rows_of_the_next():
    wo, gate_up = jnp.zeros((4096, 4096), jnp.int8), jnp.zeros((28672, 4096), jnp.int8)
    # 16 MiB of wo, then 24 MiB of gate/up: 6144 of its rows (a multiple of the 256-row box)
    assert l2_prefetch.plan([wo, gate_up], 40 << 20) == [(4096, 256, 256), (6144, 256, 256)]
    assert l2_prefetch.plan([wo, gate_up], (16 << 20) + 1000) == [(4096, 256, 256), (0, 256, 256)]
    assert l2_prefetch.plan([wo], 1 << 20) == [(256, 256, 256)]  # 1 MiB = 256 rows of 4 KiB
    bf16 = jnp.zeros((512, 128), jnp.bfloat16)  # narrow: one box spans the 128 columns
    assert l2_prefetch.plan([bf16], 1 << 30) == [(512, 256, 128)]
    assert l2_prefetch.plan([jnp.zeros((300, 512), jnp.int8)], 1 << 30) == [(0, 256, 256)]  # no whole boxes: skipped


def test_it_returns_its_input_and_launches_nothing_off_the_gpu(monkeypatch):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 256)), jnp.bfloat16)
    w = jnp.ones((256, 256), jnp.int8)
    monkeypatch.setattr(l2_prefetch, "ENABLED", True)
    assert jax.default_backend() != "gpu"
    assert l2_prefetch.prefetch(x, [w]) is x  # enabled, but not on a GPU
    assert dispatch.get_kernels().prefetch is dispatch.no_prefetch  # nor does the engine ask for it here
    text = _lowered_text(lambda x, w: l2_prefetch.prefetch(x, [w]) * 2, S(x.shape, x.dtype), S(w.shape, w.dtype))
    assert "mosaic_gpu" not in text


def test_cuda_kernel_prefetches_and_x_waits_for_it():
    fn = lambda x, wo, gu: l2_prefetch.prefetch(x, [QuantizedWeightT(wo, jnp.ones(4096)), gu], force=True)
    text = _lowered_text(fn, S((8, 4096), jnp.bfloat16), S((4096, 4096), jnp.int8), S((4096, 28672), jnp.bfloat16))
    assert text.count("mosaic_gpu") >= 1 and TMA_PREFETCH in text
    assert "optimization_barrier" in text  # x's consumers run after the kernel
    big = lambda x, w: l2_prefetch.prefetch(x, [w], force=True)  # a prefill-sized step: no kernel
    assert "mosaic_gpu" not in _lowered_text(big, S((l2_prefetch.MAX_ROWS + 8, 256), jnp.bfloat16), S((256, 256), jnp.int8))


@pytest.mark.parametrize("fused", [False, True])
def test_each_llama_layer_prefetches_after_its_qkv(fused):
    c = ModelConfig(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=256, intermediate_size=512,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, max_position_embeddings=64, rms_norm_eps=1e-5)
    params = llama.unstack_layers(llama.init_params(c, jax.random.PRNGKey(0), jnp.bfloat16))
    if fused:
        from jlight.models.layers import fuse_projections

        params = dict(params, layers=fuse_projections(params["layers"]))
    kernels = dispatch.Kernels(attention_reference.write_kv, attention_reference.paged_attention, matmul_reference.matmul,
                               prefetch=functools.partial(l2_prefetch.prefetch, force=True))
    k_shape, v_shape = llama.kv_cache_shapes(c, 4, 16)
    tokens = jnp.arange(8, dtype=jnp.int32)
    md = random_batch(np.random.default_rng(0), [8], [8], page_size=16, num_pages=4, num_tokens=8)  # one 8-token prefill
    fn = lambda p, kc, vc: llama.forward(p, c, tokens, kc, vc, md, kernels)[0]
    text = _lowered_text(fn, params, S(k_shape, jnp.bfloat16), S(v_shape, jnp.bfloat16))
    assert text.count(TMA_PREFETCH) >= c.num_layers  # one kernel (at least one prefetch instruction) a layer
    assert text.count("optimization_barrier") == c.num_layers
