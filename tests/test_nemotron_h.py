"""Nemotron-H and Nemotron-3 (single-mixer layers: Mamba-2, attention without RoPE, relu2 MLPs, MoE;
models/nemotron_h.py) against transformers: float32 logits within 1e-4 and 32 greedy tokens identical
on tiny random models (the pattern M-*-M-, and Nemotron-3's MEME* with grouped routing, a correction
bias and a latent projection), and the first through the engine (hybrid_common.check_engine)."""
from __future__ import annotations

import pytest

from hybrid_common import PROMPT, check_engine, make_tiny_hybrid_model
from test_moe_common import check_against_transformers


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_hybrid_model(str(tmp_path_factory.mktemp("hybrid")), "NemotronHForCausalLM")


def test_logits_and_greedy_match_transformers(model):
    check_against_transformers(*model, PROMPT)


def test_moe_layers_match_transformers(tmp_path):
    check_against_transformers(*make_tiny_hybrid_model(str(tmp_path), "NemotronHMoE"), PROMPT)


def test_engine_chunked_batched_preempted_prefix_cached_matches_transformers(model):
    check_engine(*model)


def test_unknown_layer_types_are_refused_by_name():
    from jlight.core.config import ModelConfig
    from jlight.core.errors import UnsupportedModelError
    from jlight.models import nemotron_h

    config = ModelConfig.from_hf_dict(dict(architectures=["NemotronHForCausalLM"], model_type="nemotron_h", vocab_size=8,
                                           hidden_size=8, intermediate_size=8, num_attention_heads=1,
                                           hybrid_override_pattern="M-E*X"))
    assert config.num_layers == 5
    with pytest.raises(UnsupportedModelError, match=r"\['X'\]"):
        nemotron_h.layer_kinds(config)
