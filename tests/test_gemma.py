"""Gemma 2 and Gemma 3 (text) against transformers on tiny random-weight models (float32).

Gemma 2: alternating local (8-token window) / global layers, attention and final logit
soft-capping, query_pre_attn_scalar, (1 + w) norms four per layer, scaled tied embeddings.
Gemma 3: 5 local : 1 global, local layers on their own RoPE base, linear-scaled global RoPE,
qk-norm. Logits within 1e-4 and 32 greedy tokens identical, through a lax.scan over the mixed
layers (traced kinds) and unrolled (each layer's kind static), and through the engine.
"""
import pytest

from families_common import check_direct, check_engine, hf_model
from jlight.core.config import ModelConfig
from jlight.core.errors import UnsupportedModelError
from jlight.loading import load_model
from jlight.models import get_model_family

ARCHS = ["Gemma2ForCausalLM", "Gemma3ForCausalLM"]


@pytest.fixture(scope="module")
def models(tiny_model):
    return {arch: (tiny_model(arch), hf_model(tiny_model(arch), arch)) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_matches_transformers(models, arch):
    path, hf = models[arch]
    loaded = load_model(path, dtype="float32")
    check_direct(loaded.params, loaded.config, hf)
    if arch == "Gemma3ForCausalLM":  # unrolled: each layer's kind static, as on the GPU (one family suffices)
        check_direct(get_model_family(loaded.config).unstack_layers(loaded.params), loaded.config, hf)


def test_engine_matches_transformers(models):
    check_engine(*models["Gemma3ForCausalLM"])


def _gemma3_config(**fields) -> dict:
    return dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=32, hidden_size=16,
                intermediate_size=16, num_hidden_layers=6, num_attention_heads=2, head_dim=8, **fields)


def test_older_gemma3_config_form():
    """transformers 4.x configs: rope_theta + rope_local_base_freq + sliding_window_pattern, no layer_types."""
    from jlight.models import attention_kinds

    cfg = ModelConfig.from_hf_dict(_gemma3_config(rope_theta=1e6, rope_local_base_freq=1e4, sliding_window=4,
                                                  sliding_window_pattern=6, rope_scaling={"rope_type": "linear", "factor": 8.0}))
    kinds = attention_kinds.layer_kinds(cfg)
    assert [k.sliding_window for k in kinds] == [4] * 5 + [None]
    assert [k.rope for k in kinds] == [1] * 5 + [0]
    tables = attention_kinds.rope_tables(cfg)
    assert tables[0].inv_freq[0] == pytest.approx(1 / 8) and tables[1].inv_freq[1] == pytest.approx(1e4 ** -0.25)


@pytest.mark.parametrize("arch", ARCHS)
def test_config_survives_convert_round_trip(models, arch):
    """jlight convert writes the family's fields back under their HF names."""
    from jlight.convert import model_config_to_hf_dict

    config = load_model(models[arch][0], dtype="float32").config
    assert ModelConfig.from_hf_dict(model_config_to_hf_dict(config)) == config


@pytest.mark.parametrize("arch, missing", [
    ("Gemma3ForConditionalGeneration", "vision tower"),
    ("Gemma3nForConditionalGeneration", "AltUp"),
    ("Gemma3nForCausalLM", "per-layer embeddings"),
])
def test_unsupported_variants_name_what_is_missing(arch, missing):
    with pytest.raises(UnsupportedModelError, match=missing):
        ModelConfig.from_hf_dict(dict(_gemma3_config(), architectures=[arch]))


def test_bidirectional_gemma3_is_refused():
    with pytest.raises(UnsupportedModelError, match="use_bidirectional_attention"):
        ModelConfig.from_hf_dict(_gemma3_config(use_bidirectional_attention=True))
