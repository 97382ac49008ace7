"""Named model shapes for benchmarks, and models with random weights built from them.

No checkpoint is needed: the weights are random of the right shape and scale, which is
all a speed measurement needs.
"""
from __future__ import annotations

import jax

from jlight.config import ModelConfig

NAMED_CONFIGS = {
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                      num_kv_heads=8, head_dim=128, rope_theta=500000.0),
    "llama3-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                      num_kv_heads=8, head_dim=64, rope_theta=500000.0),
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                         num_kv_heads=3, head_dim=64, rope_theta=100000.0),
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=8,
                 num_kv_heads=2, head_dim=16),
}


def make_config(name: str, max_position_embeddings: int = 8192) -> ModelConfig:
    if name not in NAMED_CONFIGS:
        raise ValueError(f"unknown model config {name!r}; choose one of {', '.join(NAMED_CONFIGS)}")
    return ModelConfig(architecture="LlamaForCausalLM", max_position_embeddings=max_position_embeddings,
                       rms_norm_eps=1e-5, **NAMED_CONFIGS[name])


def random_loaded_model(name: str, dtype, seed: int = 0, max_position_embeddings: int = 8192):
    """A jlight.loading.LoadedModel with random weights and no tokenizer."""
    from jlight.loading import LoadedModel
    from jlight.models import get_model_family

    config = make_config(name, max_position_embeddings)
    params = jax.jit(lambda k: get_model_family(config).init_params(config, k, dtype))(jax.random.PRNGKey(seed))
    return LoadedModel(config=config, params=params, tokenizer=None, generation_config={}, name=f"random-{name}", dtype=dtype)
