"""A step's small parameter arrays travel as one array a (dtype, placement): fewer arrays a launch.

Every array a compiled step takes costs its call host time (the runtime's bookkeeping of each buffer), so a
model of many layers pays for each norm weight, bias and sink vector at every step. `plan` picks the
parameters that are plain vectors (one axis; reached through the params' dicts and lists alone, not fields of
a weight object such as a quantized weight's scales, which kernels take whole) of at most `max_bytes`, and
groups them by dtype and sharding; `pack` concatenates each group once, at start-up, into one flat array; `unpack`,
traced inside the step, slices each parameter back out of its group (static offsets), so the model sees the
tree it was written for.

Invariants:
- unpack(*pack(params, plan), plan) equals params leaf for leaf (values, shapes, dtypes); the packed groups
  are copies made once: params itself is not changed, and the large arrays are passed as they are.
- Only fully replicated arrays (one device, or the same replicated sharding) are grouped; a sharded one stays
  an argument of its own.
- A plan is made from one params tree and fits trees of that structure only (`pack` checks).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

MAX_BYTES = 1 << 20  # a vector this large or smaller may be grouped (norm weights, biases, sinks, routers' biases)


@dataclasses.dataclass(frozen=True)
class PackPlan:
    treedef: object  # the params' structure, flattened to the level plan() looks at
    # for each flattened entry: None (passed as it is) or (group, offset, shape)
    slots: tuple
    groups: tuple  # each group's (dtype, sharding, size)

    @property
    def num_packed(self) -> int:
        return sum(s is not None for s in self.slots)


def _plain_leaves(params):
    """params flattened to its dicts', lists' and plain tuples' entries: arrays, and weight objects (named tuples,
    registered classes) kept whole."""
    return jax.tree_util.tree_flatten(params, is_leaf=lambda x: type(x) not in (dict, list, tuple))


def plan(params, max_bytes: int = MAX_BYTES) -> PackPlan:
    """Which of params' plain vectors to group (see the module docstring), and where each one lies in its group.
    Matrices stay arguments of their own: a slice of a group would have to be copied for a matmul to read it."""
    leaves, treedef = _plain_leaves(params)
    groups: dict[tuple, list] = {}  # (dtype, sharding) -> [size so far]
    order: list[tuple] = []
    slots = []
    for leaf in leaves:
        sharding = getattr(leaf, "sharding", None)
        small = isinstance(leaf, jax.Array) and leaf.ndim == 1 and 0 < leaf.nbytes <= max_bytes
        if not (small and sharding is not None and sharding.is_fully_replicated):
            slots.append(None)
            continue
        key = (np.dtype(leaf.dtype), sharding)
        if key not in groups:
            groups[key] = [0]
            order.append(key)
        offset = groups[key][0]
        groups[key][0] += leaf.size
        slots.append((order.index(key), offset, tuple(leaf.shape)))
    return PackPlan(treedef, tuple(slots), tuple((dtype, sharding, groups[(dtype, sharding)][0]) for dtype, sharding in order))


def pack(params, plan: PackPlan) -> tuple[list, tuple]:
    """(the flattened entries with the grouped ones set to None, the groups as flat arrays on their placement)."""
    leaves, treedef = _plain_leaves(params)
    if treedef != plan.treedef:
        raise ValueError("these params do not have the structure their packing plan was made from")
    members = [[] for _ in plan.groups]
    for leaf, slot in zip(leaves, plan.slots):
        if slot is not None:
            members[slot[0]].append(leaf)
    packed = tuple(jax.jit(lambda *xs: jnp.concatenate([x.reshape(-1) for x in xs]), out_shardings=sharding)(*group)
                   for (_, sharding, _), group in zip(plan.groups, members))
    rest = [None if slot is not None else leaf for leaf, slot in zip(leaves, plan.slots)]
    return rest, packed


def unpack(rest: list, packed: tuple, plan: PackPlan):
    """The params tree again (traced inside the step: each grouped array a static slice of its group)."""
    leaves = [leaf if slot is None else packed[slot[0]][slot[1]:slot[1] + int(np.prod(slot[2], dtype=np.int64))].reshape(slot[2])
              for leaf, slot in zip(rest, plan.slots)]
    return jax.tree_util.tree_unflatten(plan.treedef, leaves)
