"""Mesh specs and sharding plans reject bad input with a ValueError naming the input and the fix.
Single process, one CPU device: nothing here compiles."""
import jax
import numpy as np
import pytest

from jlight.core.config import ModelConfig
from jlight.models import llama
from jlight.sharding.mesh import make_mesh, parse_mesh_spec, spec_from_tensor_parallel_size
from jlight.sharding.plan import ShardingPlan
from jlight.sharding.rules import logical_to_spec, param_specs


def _config(**kw):
    base = dict(architecture="LlamaForCausalLM", vocab_size=250, hidden_size=64, intermediate_size=128,
                num_layers=2, num_heads=8, num_kv_heads=2, head_dim=8, max_position_embeddings=256)
    return ModelConfig(**{**base, **kw})


def test_parse_fills_missing_axes_with_one():
    assert parse_mesh_spec("tp=4, dp=2") == {"dp": 2, "ep": 1, "tp": 4}
    assert spec_from_tensor_parallel_size(1) is None
    assert spec_from_tensor_parallel_size(4) == "tp=4"
    assert make_mesh(None) is None and make_mesh("") is None


@pytest.mark.parametrize("spec, words", [
    ("pp=2", "unknown axis 'pp'"),
    ("tp", "has no '='"),
    ("tp=two", "not an integer"),
    ("tp=0", "sizes must be >= 1"),
    ("tp=2,tp=2", "given twice"),
])
def test_bad_specs_name_the_spec_and_the_fix(spec, words):
    with pytest.raises(ValueError, match=words) as e:
        parse_mesh_spec(spec)
    assert repr(spec) in str(e.value)


def test_axis_sizes_must_multiply_to_device_count():
    with pytest.raises(ValueError, match=r"needs 2 devices but 1 are available"):
        make_mesh("tp=2")
    assert make_mesh("tp=1").shape == {"dp": 1, "ep": 1, "tp": 1}


def _fake_mesh(**sizes):
    """A Mesh object of the given sizes over repeated CPU devices: enough for plan validation
    (which reads only axis sizes), never used to run anything."""
    from jax.sharding import AbstractMesh

    shape = tuple(sizes.get(a, 1) for a in ("dp", "ep", "tp"))
    return AbstractMesh(shape, ("dp", "ep", "tp"))


def test_plan_rejects_heads_not_divisible_by_tp():
    with pytest.raises(ValueError, match="num_heads=6 is not divisible by 4"):
        ShardingPlan(_fake_mesh(tp=4), _config(num_heads=6, num_kv_heads=6), llama.param_axes(_config()))


def test_plan_rejects_kv_heads_that_do_not_divide_tp():
    with pytest.raises(ValueError, match="num_kv_heads=3 and tp=2 must divide one another"):
        ShardingPlan(_fake_mesh(tp=2), _config(num_heads=6, num_kv_heads=3), llama.param_axes(_config()))


def test_plan_rejects_ep_without_experts():
    with pytest.raises(ValueError, match="ep=2 but LlamaForCausalLM has no experts"):
        ShardingPlan(_fake_mesh(ep=2), _config(), llama.param_axes(_config()))


def test_plan_replicates_kv_heads_and_pads_vocab():
    plan = ShardingPlan(_fake_mesh(tp=8), _config(), llama.param_axes(_config()))
    assert plan.config.num_kv_heads == 8 and plan.kv_repeat == 4 and plan.padded_vocab == 256
    wk = np.arange(2 * 2 * 8).reshape(2, 16).astype(np.float32)  # [embed=2, 2 kv heads * head_dim 8]
    out = plan._transform(("embed", "kv_heads"), wk)
    assert out.shape == (2, 64)
    # Query head i (of 8) must meet original KV head i // 4: copies are consecutive.
    np.testing.assert_array_equal(out[:, 8 * 3 : 8 * 4], wk[:, :8])
    np.testing.assert_array_equal(out[:, 8 * 4 : 8 * 5], wk[:, 8:])
    np.testing.assert_array_equal(plan._transform(("embed", "kv_heads"), out), out)  # idempotent
    emb = plan._transform(("vocab", "embed"), np.ones((250, 4), np.float32))
    assert emb.shape == (256, 4) and emb[250:].sum() == 0


def test_unknown_logical_axis_names_the_axis_and_the_fix():
    with pytest.raises(ValueError, match=r"\['sideways'\].*jlight/sharding/rules.py"):
        logical_to_spec(("embed", "sideways"))
    specs = param_specs(llama.param_axes(_config()))
    assert specs["layers"]["wq"] == jax.sharding.PartitionSpec(None, None, "tp")  # column-parallel
    assert specs["layers"]["wo"] == jax.sharding.PartitionSpec(None, "tp", None)  # row-parallel
    assert specs["embed"] == jax.sharding.PartitionSpec("tp", None)  # vocab-parallel
