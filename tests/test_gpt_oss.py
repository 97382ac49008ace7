"""gpt-oss against transformers on a tiny random-weight model (float32): attention sinks, q/k/v/o
biases, alternating 8-token windows, YaRN RoPE, 8 experts top-2 with the clamped swiglu and
their biases (noise added to every bias and sink so they count). Logits within 1e-4 and 32
greedy tokens identical, scanned and unrolled, and through the engine."""
import numpy as np
import pytest

from families_common import check_direct, check_engine, hf_model
from jlight.core.config import ModelConfig
from jlight.core.errors import UnsupportedModelError
from jlight.loading import load_model
from jlight.loading.hf_names_families import split_fused_tensors
from jlight.models import get_model_family

ARCH = "GptOssForCausalLM"


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model(ARCH), hf_model(tiny_model(ARCH), ARCH)


def test_scanned_and_unrolled_match_transformers(model):
    path, hf = model
    loaded = load_model(path, dtype="float32")
    check_direct(loaded.params, loaded.config, hf)
    check_direct(get_model_family(loaded.config).unstack_layers(loaded.params), loaded.config, hf)


def test_engine_matches_transformers(model):
    check_engine(*model)


def _config(**fields):
    return dict(architectures=[ARCH], model_type="gpt_oss", vocab_size=32, hidden_size=16, intermediate_size=8,
                num_hidden_layers=2, num_attention_heads=2, num_local_experts=4, num_experts_per_tok=2, **fields)


def test_expert_weights_take_their_bias_row():
    cfg = ModelConfig.from_hf_dict(_config())
    gate_up = np.arange(4 * 16 * 16, dtype=np.float32).reshape(4, 16, 16)  # [X, E, 2F], gate/up interleaved
    bias = -np.arange(4 * 16, dtype=np.float32).reshape(4, 16)
    out = dict(split_fused_tensors(cfg, [("model.layers.1.mlp.experts.gate_up_proj_bias", bias),
                                         ("model.layers.1.mlp.experts.gate_up_proj", gate_up)]))
    gate, up = out["model.layers.1.mlp.experts.gate_proj_with_bias"], out["model.layers.1.mlp.experts.up_proj_with_bias"]
    assert gate.shape == up.shape == (4, 17, 8)
    np.testing.assert_array_equal(gate[:, :16], gate_up[..., 0::2])
    np.testing.assert_array_equal(up[:, 16], bias[:, 1::2])
    with pytest.raises(ValueError, match="gate_up_proj without its bias"):
        list(split_fused_tensors(cfg, [("model.layers.0.mlp.experts.gate_up_proj", gate_up)]))


def test_mxfp4_checkpoint_is_refused_with_the_way_out():
    with pytest.raises(UnsupportedModelError, match="MXFP4 .*Mxfp4Config\\(dequantize=True\\)"):
        ModelConfig.from_hf_dict(_config(quantization_config={"quant_method": "mxfp4"}))
