"""The cache a hybrid model's step carries: its attention layers' K pages and its recurrent layers'
state pools, in the place of the K pool of the model contract (`forward(..., k_cache, v_cache, ...)`).

A hybrid family (one with `state_shapes`, models/granite_hybrid.py, models/qwen3_next.py) takes and
returns `PagesAndState(pages, state)` as its k_cache; the V pages stay the v_cache. `state` maps a
name to a pool [recurrent layers, slots, ...]: slot s is one running sequence's fixed-size state
(jlight/engine/state_pool.py hands the slots out; BatchMetadata.state_slots names each row's), slot 0
the scratch slot of padding rows.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax.numpy as jnp


class PagesAndState(NamedTuple):
    pages: Any  # [attention layers, pages, page_size, kv_heads, head_dim] (or a QuantizedKV)
    state: dict  # name -> [recurrent layers, slots, ...] arrays


def zeros_like_shapes(shapes: dict) -> dict:
    """{name: ShapeDtypeStruct} -> {name: zeroed array}."""
    return {name: jnp.zeros(s.shape, s.dtype) for name, s in shapes.items()}


def state_bytes_per_slot(shapes: dict) -> int:
    """Bytes one slot holds over every pool of `state_shapes(config, num_slots)` ([layers, slots, ...])."""
    return sum(jnp.dtype(s.dtype).itemsize * s.shape[0] * math.prod(s.shape[2:]) for s in shapes.values())
