"""Phi-3 and SmolLM3 against transformers on tiny random-weight models (float32).

Phi-3: the checkpoint's fused qkv_proj and gate_up_proj, LongRoPE (short factors while a sequence
holds at most original_max_position_embeddings = 64 positions, long ones past that: prompts of
both kinds and a greedy continuation that crosses 64) and partial rotary. SmolLM3: every 4th layer
without RoPE, scanned (traced kinds) and unrolled (static kinds). Logits within 1e-4 and 32 greedy
tokens identical, and Phi-3 through the engine.
"""
import numpy as np
import pytest

from families_common import PROMPTS, check_direct, check_engine, hf_model
from jlight.core.config import ModelConfig
from jlight.loading import load_model
from jlight.loading.hf_names_families import split_fused_tensors
from jlight.models import attention_kinds, get_model_family

ARCHS = ["Phi3ForCausalLM", "SmolLM3ForCausalLM"]
# Phi-3: a 50-token prompt whose continuation crosses position 64 (short -> long factors), a 70-token one (long).
PHI3_PROMPTS = [[int(t) for t in np.random.default_rng(n).integers(3, 500, n)] for n in (50, 70)] + PROMPTS


@pytest.fixture(scope="module")
def models(tiny_model):
    return {arch: (tiny_model(arch), hf_model(tiny_model(arch), arch)) for arch in ARCHS}


def test_phi3_matches_transformers(models):
    path, hf = models["Phi3ForCausalLM"]
    loaded = load_model(path, dtype="float32")
    check_direct(loaded.params, loaded.config, hf, prompts=PHI3_PROMPTS)


def test_smollm3_scanned_and_unrolled_match_transformers(models):
    path, hf = models["SmolLM3ForCausalLM"]
    loaded = load_model(path, dtype="float32")
    check_direct(loaded.params, loaded.config, hf)
    check_direct(get_model_family(loaded.config).unstack_layers(loaded.params), loaded.config, hf)


def test_phi3_engine_matches_transformers(models):
    check_engine(*models["Phi3ForCausalLM"])


def test_fused_tensor_of_the_wrong_size_names_itself():
    cfg = ModelConfig.from_hf_dict(dict(architectures=["Phi3ForCausalLM"], model_type="phi3", vocab_size=32, hidden_size=16,
                                        intermediate_size=24, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    good = list(split_fused_tensors(cfg, [("model.layers.0.mlp.gate_up_proj.weight", np.zeros((48, 16)))]))
    assert [(n, a.shape) for n, a in good] == [("model.layers.0.mlp.gate_proj.weight", (24, 16)),
                                              ("model.layers.0.mlp.up_proj.weight", (24, 16))]
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.qkv_proj.weight has 40 rows but the config implies 32 \(16 \+ 8 \+ 8\)"):
        list(split_fused_tensors(cfg, [("model.layers.0.self_attn.qkv_proj.weight", np.zeros((40, 16)))]))


def test_phi3_older_rope_names_are_longrope():
    for old in ("su", "yarn"):
        cfg = ModelConfig.from_hf_dict(dict(
            architectures=["Phi3ForCausalLM"], model_type="phi3", vocab_size=32, hidden_size=16, intermediate_size=24,
            num_hidden_layers=1, num_attention_heads=2, original_max_position_embeddings=16, max_position_embeddings=64,
            rope_scaling={"type": old, "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}))
        table = attention_kinds.rope_tables(cfg)[0]
        assert table.original_max == 16 and table.long_inv_freq is not None, old


def test_longrope_factors_of_the_wrong_length_are_refused():
    cfg = ModelConfig.from_hf_dict(dict(
        architectures=["Phi3ForCausalLM"], model_type="phi3", vocab_size=32, hidden_size=16, intermediate_size=24,
        num_hidden_layers=1, num_attention_heads=2, original_max_position_embeddings=16,
        rope_scaling={"type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 4}))
    with pytest.raises(ValueError, match="short_factor must have 4 entries"):
        attention_kinds.rope_tables(cfg)
