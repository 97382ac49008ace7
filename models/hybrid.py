"""What the hybrid families (attention layers interleaved with recurrent ones) share: a layer of
a stacked group taken by index, the gated RMSNorm, and the params-tree contract over groups.

A hybrid family's params tree holds one stacked group per kind of layer (e.g. "mamba_layers",
"attn_layers", each [n, ...] of that kind, in model order), since the kinds have different weights;
the forward runs the layers in the checkpoint's order, layer i taking the next layer of its kind's
group. Unrolled (models/layers.unstack_layers), each group is a list of per-layer trees.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jlight.models.module import Layout


def layer_at(group, i: int):
    """Layer i of a group: the i-th module of an nnx.List, or the i-th slice of a stacked module."""
    if isinstance(group, nnx.List):
        return group[i]
    graphdef, state = nnx.split(group)
    return nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))


def layout_of(params: dict, groups: tuple[str, ...]) -> Layout:
    """Unrolled when the first present group is a list (the hybrid families fuse no projections)."""
    first = next(params[g] for g in groups if g in params)
    return Layout(unrolled=isinstance(first, (list, tuple)))


def gated_rms_norm(x, gate, weight, group_size: int, eps: float):
    """Mamba-2's / DeltaNet's gated norm: (x * silu(gate)) RMS-normalised over groups of group_size
    channels, in float32, times weight. x, gate: [T, C] -> [T, C] in x's dtype."""
    x32 = x.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))
    g = x32.reshape(x.shape[:-1] + (-1, group_size))
    g = g * jax.lax.rsqrt(jnp.mean(g * g, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * g.reshape(x.shape)).astype(x.dtype)
