"""Builds the params tree from a stream of (name, numpy tensor) pairs.

Each tensor is cast and put on device as it arrives, so the host never holds more than one
tensor at a time beyond the source file's own (memory-mapped) copy. Per-layer tensors are
stacked on device at the end.
"""
from __future__ import annotations

from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from jlight.config import ModelConfig
from jlight.errors import ModelLoadError
from jlight.loading.hf_names import map_hf_name


def assemble_params(
    config: ModelConfig,
    tensors: Iterable[tuple[str, np.ndarray]],
    dtype,
    *,
    place: Callable[[str, np.ndarray], jax.Array] | None = None,
    name_mapper=map_hf_name,
) -> dict:
    """Consume (hf_name, array) pairs and return the params tree of models/llama.py.

    `place(path, host_array)` puts one tensor on device (default: jax.device_put); the
    sharding code passes one that places it straight into its mesh sharding.
    """
    from jlight.models import get_model_family

    family = get_model_family(config)
    shapes = family.param_shapes(config)
    place = place or (lambda path, a: jax.device_put(a))
    np_dtype = jnp.dtype(dtype)
    layer_parts: dict[str, list] = {k: [None] * config.num_layers for k in shapes["layers"]}
    top: dict[str, jax.Array] = {}
    for name, tensor in tensors:
        mapped = name_mapper(name)
        if mapped is None:
            continue
        key, layer, transpose = mapped
        arr = np.asarray(tensor)
        if transpose:
            arr = arr.T
        arr = arr.astype(np_dtype)
        if layer is None:
            if key not in shapes:
                continue
            _check_shape(name, arr.shape, shapes[key])
            top[key] = place(key, arr)
        else:
            if key not in layer_parts or layer >= config.num_layers:
                continue
            _check_shape(name, arr.shape, shapes["layers"][key][1:])
            layer_parts[key][layer] = place(f"layers.{key}", arr)
    if "lm_head" not in top:
        if "embed" not in top:
            raise ModelLoadError("checkpoint has no token embedding (model.embed_tokens.weight); the file is incomplete")
        # Tied embeddings: keep an [embed, vocab] copy so the LM head is a plain matmul.
        top["lm_head"] = jnp.transpose(top["embed"])
    for key in ("embed", "final_norm"):
        if key not in top:
            raise ModelLoadError(f"checkpoint is missing the {key} tensor; the file is incomplete or not a {config.architecture}")
    layers = {}
    for key, parts in layer_parts.items():
        missing = [i for i, p in enumerate(parts) if p is None]
        if missing:
            raise ModelLoadError(
                f"checkpoint is missing layers.{key} for layers {missing[:5]}{'...' if len(missing) > 5 else ''}; "
                "the file is incomplete or its config.json does not match it"
            )
        layers[key] = jnp.stack(parts)
        parts.clear()  # free the per-layer arrays as soon as they are stacked
    return {"embed": top["embed"], "layers": layers, "final_norm": top["final_norm"], "lm_head": top["lm_head"]}


def _check_shape(name, got, want):
    if tuple(got) != tuple(want):
        raise ModelLoadError(f"tensor {name} has shape {tuple(got)} but the config implies {tuple(want)}; config.json does not match the weights")
