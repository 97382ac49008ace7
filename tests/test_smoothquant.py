"""SmoothQuant (jlight/quantization/smoothquant.py): the smoothed model computes the same function, and
it moves activation outliers into the weights so that per-token int8 activations lose less."""
import jax
import jax.numpy as jnp
import numpy as np

from jlight.core.config import ModelConfig
from jlight.models.llama import init_params
from jlight.quantization import smoothquant
from jlight.quantization.rtn import quantize_params

CONFIG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64)
SEGMENTS = [list(range(1, 40)), list(range(20, 60))]


def _params_with_outliers(seed=0):
    """Random weights whose attention and MLP norms blow up a few channels, as trained models' do."""
    params = init_params(CONFIG, jax.random.PRNGKey(seed), jnp.float32)
    layers = dict(params["layers"])
    for norm in ("attn_norm", "mlp_norm"):
        layers[norm] = layers[norm].at[:, jnp.array([3, 17])].multiply(30.0)
    return dict(params, layers=layers)


def test_smoothed_model_computes_the_same_function():
    from test_convert import prefill_logits

    params = _params_with_outliers()
    smoothed = smoothquant.smooth_params(params, CONFIG, SEGMENTS, alpha=0.5)
    assert not np.allclose(np.asarray(smoothed["layers"]["wq"]), np.asarray(params["layers"]["wq"]))  # it did move
    tokens = list(range(5, 50))
    want = prefill_logits(params, CONFIG, tokens)
    np.testing.assert_allclose(prefill_logits(smoothed, CONFIG, tokens), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_smoothing_helps_w8a8():
    """Per-token int8 activations: the smoothed model's W8A8 logits are closer to the float model's."""
    from test_convert import prefill_logits

    params = _params_with_outliers(1)
    tokens = list(range(3, 50))
    want = prefill_logits(params, CONFIG, tokens)
    err = lambda p: np.linalg.norm(prefill_logits(quantize_params(p, "w8a8"), CONFIG, tokens) - want)
    smoothed = smoothquant.smooth_params(params, CONFIG, SEGMENTS, alpha=0.5)
    assert err(smoothed) < 0.7 * err(params), (err(smoothed), err(params))


def test_smoothing_scales():
    s = smoothquant.smoothing_scales(np.array([4.0, 0.0, 9.0]), np.array([1.0, 2.0, 0.0]), alpha=0.5)
    np.testing.assert_allclose(s, [2.0, 1.0, 1.0])  # sqrt(4) / 1; channels that never fire or have no weight: 1
    stats = smoothquant.activation_amax(_params_with_outliers(), CONFIG, SEGMENTS)
    assert stats["qkv"].shape == (2, 32) and stats["wo"].shape == (2, 32) and stats["w_down"].shape == (2, 48)
    assert stats["lm_head"].shape == (32,) and (stats["qkv"][:, 3] > 5 * np.median(stats["qkv"], axis=1)).all()
