"""Model families, looked up by the HF `architectures` name in the checkpoint's config.

Each family module provides: param_axes, param_shapes, init_params, kv_cache_shapes,
forward and compute_logits (see models/llama.py for the contract).
"""
import importlib

from jlight.core.config import SUPPORTED_ARCHITECTURES, ModelConfig


def get_model_family(config: ModelConfig):
    """Return the module that implements the config's architecture."""
    return importlib.import_module(f"jlight.models.{SUPPORTED_ARCHITECTURES[config.architecture]}")
