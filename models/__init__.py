"""Model families, looked up by the HF `architectures` name in the checkpoint's config.

Each family module holds its model as Flax NNX modules and provides the contract's functions over
them (models/module.py: FamilyFunctions): param_shapes, param_axes, init_params, forward,
compute_logits, plus kv_cache_shapes and unstack_layers (and fuse_projections where the engine may
fuse q/k/v and gate/up).
"""
import importlib

from jlight.core.config import SUPPORTED_ARCHITECTURES, ModelConfig


def get_model_family(config: ModelConfig):
    """Return the module that implements the config's architecture."""
    return importlib.import_module(f"jlight.models.{SUPPORTED_ARCHITECTURES[config.architecture]}")
