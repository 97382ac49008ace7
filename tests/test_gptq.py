"""GPTQ into the int8 per-output-channel format (jlight/quantization/gptq.py), on small random problems."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jlight.quantization.gptq import gptq_quantize, gptq_quantize_params, rtn_values
from jlight.core.quantization import QuantizedWeight, quantize_int8
from jlight.quantization.rtn import quantize_params


def _problem(seed=0, n=512, d_in=48, d_out=24):
    rng = np.random.default_rng(seed)
    # Correlated inputs with unequal scales, like a linear layer's activations.
    mix = rng.normal(size=(d_in, d_in)) * (rng.random(d_in) ** 2)[None, :] + np.eye(d_in)
    X = rng.normal(size=(n, d_in)) @ mix * rng.uniform(0.2, 3.0, d_in)[None, :]
    W = rng.normal(size=(d_in, d_out)).astype(np.float32)
    W[:, 0] *= 5.0  # one wide column: larger steps
    return X, W


def _err(X, W, values, scales):
    return np.linalg.norm(X @ W - X @ (values.astype(np.float64) * scales.astype(np.float64)[None, :]))


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_rtn_with_the_same_scales(act_order):
    X, W = _problem()
    values, scales = gptq_quantize(W, 2 * X.T @ X, block_size=16, act_order=act_order)
    rtn = quantize_int8(jnp.asarray(W))
    np.testing.assert_array_equal(scales, np.asarray(rtn.scales))  # the format's scales are RTN's, bit for bit
    assert values.dtype == np.int8 and values.shape == W.shape
    assert values.min() >= -127 and values.max() <= 127
    np.testing.assert_array_equal(rtn_values(W, scales), np.asarray(rtn.values))
    e_gptq, e_rtn = _err(X, W, values, scales), _err(X, W, np.asarray(rtn.values), scales)
    assert e_gptq < 0.8 * e_rtn, (e_gptq, e_rtn)
    assert np.abs(values.astype(np.int32) - np.asarray(rtn.values, np.int32)).max() <= 127  # still a nearby grid point
    assert (values != np.asarray(rtn.values)).any()


def test_block_size_does_not_change_the_result():
    X, W = _problem(1)
    a, _ = gptq_quantize(W, 2 * X.T @ X, block_size=7)
    b, _ = gptq_quantize(W, 2 * X.T @ X, block_size=128)
    assert (a != b).mean() < 0.01  # equal up to float rounding at exact ties


def test_dead_inputs_round_to_nearest():
    X, W = _problem(2)
    X[:, [3, 10]] = 0.0  # inputs that never fire: H diagonal 0
    values, scales = gptq_quantize(W, 2 * X.T @ X)
    np.testing.assert_array_equal(values[[3, 10]], rtn_values(W, scales)[[3, 10]])
    assert _err(X, W, values, scales) < _err(X, W, rtn_values(W, scales), scales)


def test_gptq_quantize_params_keeps_the_int8_layout():
    from jlight.core.config import ModelConfig
    from jlight.models.llama import init_params

    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64)
    params = init_params(config, jax.random.PRNGKey(0), jnp.float32)
    segments = [list(range(1, 40)), list(range(20, 60))]
    rtn = quantize_params(params, "int8")
    for sequential in (True, False):
        q = gptq_quantize_params(params, config, segments, sequential=sequential)
        for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
            w = q["layers"][name]
            assert type(w) is QuantizedWeight and w.values.dtype == jnp.int8
            assert w.values.shape == rtn["layers"][name].values.shape
            np.testing.assert_array_equal(np.asarray(w.scales), np.asarray(rtn["layers"][name].scales))
        assert type(q["lm_head"]) is QuantizedWeight
    kept = gptq_quantize_params(params, config, segments, keep=("lm_head",))
    assert kept["lm_head"] is params["lm_head"] and type(kept["layers"]["wq"]) is QuantizedWeight


def test_calibration_forward_matches_the_model():
    """GPTQ's host-side calibration forward computes the model's own function: its logits equal
    the engine reference path's (models/llama.py over a paged cache) on the same tokens."""
    from jlight.core.config import ModelConfig
    from jlight.models.llama import init_params
    from jlight.models.layers import rms_norm
    from jlight.quantization import gptq
    from test_convert import prefill_logits

    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64)
    params = init_params(config, jax.random.PRNGKey(3), jnp.float32)
    tokens = list(range(3, 30))
    h = params["embed"][jnp.asarray(tokens)]
    for i in range(config.num_layers):
        lp = gptq._layer(params, i)
        x = gptq._attn_inputs(config, h, lp)
        attn = gptq._attention(config, x, lp["wq"], lp["wk"], lp["wv"])
        h, x = gptq._mlp_inputs(config, h, attn, lp["wo"], lp)
        h = gptq._residual(h, gptq._down_inputs(config, x, lp["w_gate"], lp["w_up"]), lp["w_down"])
    logits = rms_norm(h, params["final_norm"], config.rms_norm_eps) @ params["lm_head"]
    np.testing.assert_allclose(np.asarray(logits), prefill_logits(params, config, tokens), atol=1e-4, rtol=1e-4)
