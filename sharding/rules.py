"""The one table from logical axis names to mesh axes, as Flax logical-axis rules, and the
functions that apply it.

A model's weights are Flax parameters whose partitioning metadata name their logical axes
(models/module.py); `flax.linen.logical_to_mesh_axes` maps those names to mesh axes by the rules
below. Megatron-style tensor parallelism falls out of the table: q/k/v/gate/up are split on
their output (`heads`, `kv_heads`, `mlp` -> tp: column-parallel), o/down on their input
(row-parallel), the embedding and LM head on `vocab`. MoE experts are split on `ep`.
Changing the mesh changes which devices the axes land on, never model code.
"""
from __future__ import annotations

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jlight.core.quantization import QuantizedWeight

# (logical axis, mesh axis or None = replicated). Every name a model's weights may carry.
LOGICAL_AXIS_RULES = (
    ("vocab", "tp"),
    ("embed", None),
    ("embed_norm", None),
    ("heads", "tp"),
    ("kv_heads", "tp"),
    ("head_dim", None),
    ("mlp", "tp"),
    ("layers", None),
    ("experts", "ep"),
    ("router", None),  # router logits [embed, num_experts]: small, every device routes its tokens
    ("q_lora", None),  # MLA low-rank query / KV latents: small, replicated
    ("kv_lora", None),
    # KV cache pools: [layers, pages, page_size, kv_heads, head_dim]
    ("pages", None),
    ("page_size", None),
    # Leading axis of per-replica inputs (one independent sub-batch per dp replica).
    ("replica", "dp"),
)
LOGICAL_NAMES = tuple(name for name, _ in LOGICAL_AXIS_RULES)

KV_CACHE_AXES = ("layers", "pages", "page_size", "kv_heads", "head_dim")


def logical_to_spec(axes: tuple[str | None, ...]) -> P:
    """('layers', 'embed', 'heads') -> PartitionSpec(None, None, 'tp'). A None name is replicated."""
    unknown = [a for a in axes if a is not None and a not in LOGICAL_NAMES]
    if unknown:
        raise ValueError(
            f"logical axis names {unknown} in {axes} have no sharding rule; "
            f"use one of {', '.join(LOGICAL_NAMES)} or add a rule to jlight/sharding/rules.py"
        )
    return nn.logical_to_mesh_axes(axes, LOGICAL_AXIS_RULES)


def is_axes(x) -> bool:
    """A leaf of an axes tree: a tuple of logical names (None for an unnamed dimension)."""
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def _spec_for_leaf(axes: tuple[str, ...], leaf) -> P | QuantizedWeight:
    if isinstance(leaf, QuantizedWeight):
        # values keep the weight's axes; scales drop the input axis ([..., in, out] -> [..., out]). The spec
        # node has the weight's own type (W8A8Weight, Fp8Weight): shard_map matches pytree node types.
        return type(leaf)(logical_to_spec(axes), logical_to_spec(axes[:-2] + axes[-1:]))
    return logical_to_spec(axes)


def param_specs(param_axes: dict, params=None):
    """PartitionSpecs for every weight, in the params tree's structure.

    `params` is only needed when some weights are QuantizedWeights (their scales get their
    own spec); leave it out for a tree of plain arrays.
    """
    if params is None:
        return jax.tree.map(logical_to_spec, param_axes, is_leaf=is_axes)
    return jax.tree.map(_spec_for_leaf, param_axes, params, is_leaf=is_axes)


def named_shardings(mesh: Mesh, specs):
    """The PartitionSpec tree as NamedShardings on `mesh`."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
