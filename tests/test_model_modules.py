"""The families as Flax NNX modules (models/module.py): weights declared as nnx.Params carrying their
logical axes, a params tree bound into the abstract module, and what a tree that does not match gets."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jlight.core.batch_metadata import BatchMetadata
from jlight.core.config import ModelConfig
from jlight.core.parallel_ops import ParallelOps
from jlight.models import deepseek, llama, mixtral
from jlight.models.module import Layout, bind
from jlight.pallas_kernels.dispatch import get_kernels
from jlight.sharding.rules import logical_to_spec

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)
CONFIGS = {
    "llama": (llama, llama.Llama, dict(TINY, architectures=["LlamaForCausalLM"], model_type="llama")),
    "qwen2_moe": (mixtral, mixtral.Mixtral, dict(TINY, architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe",
                                                 num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                                 shared_expert_intermediate_size=16)),
    "deepseek_v3": (deepseek, deepseek.DeepSeek, dict(TINY, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
                                                      num_hidden_layers=3, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                                                      qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
                                                      moe_intermediate_size=16, n_shared_experts=1, first_k_dense_replace=1,
                                                      n_group=2, topk_group=1)),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_every_weight_is_a_param_with_its_logical_axes(name):
    """param_axes is read from the Params' Flax partitioning metadata; the unrolled layout's layers
    carry the stacked axes without `layers`; every name has a sharding rule."""
    family, model_class, hf = CONFIGS[name]
    config = ModelConfig.from_hf_dict(hf)
    model = model_class(config)
    params = nnx.state(model, nnx.Param)
    specs = nnx.get_partition_spec(params)
    values = dict(nnx.to_flat_state(params))
    flat = list(nnx.to_flat_state(specs))
    assert len(flat) == len(jax.tree.leaves(family.param_shapes(config), is_leaf=lambda x: isinstance(x, tuple)))
    for path, spec in flat:
        assert isinstance(spec, nnx.Param)
        axes = tuple(spec.get_value())
        assert len(axes) == len(values[path].get_value().shape), path
        if path[0] in ("layers", "dense_layers"):
            assert axes[0] == "layers", path
        logical_to_spec(axes)  # a rule for every name
    stacked = family.param_axes(config)
    unrolled = family.param_axes(config, Layout(unrolled=True))
    assert unrolled["layers"] == [{k: a[1:] for k, a in stacked["layers"].items()}] * len(unrolled["layers"])


def test_bind_puts_the_tree_values_in_the_module_and_refuses_another_tree():
    family, model_class, hf = CONFIGS["llama"]
    config = ModelConfig.from_hf_dict(hf)
    params = family.init_params(config, jax.random.PRNGKey(0), jnp.float32)
    model = bind(model_class(config, Layout.of(params)), params)
    assert model.layers.wq.get_value() is params["layers"]["wq"]
    per_layer = family.unstack_layers(params)
    unrolled = bind(model_class(config, Layout.of(per_layer)), per_layer)
    assert isinstance(unrolled.layers, nnx.List) and unrolled.layers[1].wo.get_value() is per_layer["layers"][1]["wo"]
    broken = dict(params, layers={k: v for k, v in params["layers"].items() if k != "wk"})
    with pytest.raises(ValueError, match=r"missing \['layers.wk'\]"):
        bind(model_class(config, Layout.of(broken)), broken)
    extra = dict(params, bogus=params["final_norm"])
    with pytest.raises(ValueError, match=r"unexpected \['bogus'\]"):
        bind(model_class(config), extra)


def test_fused_layout_runs_the_fused_weights():
    """fuse_projections' tree binds into the fused layout's module and computes the same logits."""
    family, model_class, hf = CONFIGS["qwen2_moe"]
    config = ModelConfig.from_hf_dict(hf)
    params = family.init_params(config, jax.random.PRNGKey(1), jnp.float32)
    fused = dict(params, layers=family.fuse_projections(params["layers"]))
    assert Layout.of(fused).fused == {"wqkv", "shared_gate_up"}  # q/k/v and the shared expert's gate/up
    assert Layout.of(fused).fused <= set(family.param_axes(config, Layout.of(fused))["layers"])
    T, page = 6, 8
    md = BatchMetadata(positions=jnp.arange(T, dtype=jnp.int32), slot_mapping=page + jnp.arange(T, dtype=jnp.int32),
                       token_seq=jnp.zeros(T, jnp.int32), page_table=jnp.array([[1]], jnp.int32),
                       context_lens=jnp.array([T], jnp.int32), query_start=jnp.array([0, T], jnp.int32),
                       logits_indices=jnp.array([T - 1], jnp.int32))
    k_shape, v_shape = family.kv_cache_shapes(config, 2, page)
    kernels, ops = get_kernels("reference", "reference"), ParallelOps()

    @jax.jit
    def logits(p):
        h, _, _ = family.forward(p, config, jnp.arange(T, dtype=jnp.int32), jnp.zeros(k_shape), jnp.zeros(v_shape), md, kernels, ops)
        return family.compute_logits(p, config, h, kernels, ops)

    np.testing.assert_allclose(np.asarray(logits(fused)), np.asarray(logits(params)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("through_host", [False, True])
def test_a_donated_split_gives_each_layer_its_slice_and_frees_the_stack(through_host):
    """unstack_layers(donate=True): every per-layer leaf equals its slice of the stacked leaf, and the stacked
    leaves are deleted, on the device or through host memory (the GPU's way, which keeps free memory in one block)."""
    family, _, hf = CONFIGS["qwen2_moe"]
    config = ModelConfig.from_hf_dict(hf)
    params = family.init_params(config, jax.random.PRNGKey(2), jnp.float32)
    expected = {k: np.asarray(v) for k, v in params["layers"].items()}
    stacked = list(params["layers"].values())
    devices = stacked[0].devices()
    per_layer = family.unstack_layers(params, donate=True, through_host=through_host)
    assert all(leaf.is_deleted() for leaf in stacked)
    assert len(per_layer["layers"]) == config.num_layers
    for i, layer in enumerate(per_layer["layers"]):
        for name, value in layer.items():
            assert value.devices() == devices
            np.testing.assert_array_equal(np.asarray(value), expected[name][i], err_msg=f"layer {i} {name}")
