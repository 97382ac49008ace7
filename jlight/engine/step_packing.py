"""A step's host inputs packed into two flat buffers: two host-to-device copies per step, not ~30.

Handed to jit as a pytree, each of the StepInputs' ~30 small numpy arrays is its own
host-to-device transfer, and each costs the host time on the dispatch path, which bounds
batch-1 decode. `pack` copies every integer and bool leaf into one int32 buffer and every
float leaf into one float32 buffer; `unpack`, traced inside the jitted step, slices them back
into the same pytree. Where each leaf lies (the `Layout`) depends only on the leaves' shapes
and dtypes, so it is computed once per input shape and passed to jit as a static argument:
one compiled step per bucket, as before.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

_INT_DTYPES = ("int32", "uint32", "bool")  # -> the int32 buffer (uint32 bit-cast, bool as 0/1)
_FLOAT_DTYPES = ("float32",)  # -> the float32 buffer


class Slot(NamedTuple):
    floating: bool  # in the float32 buffer, else in the int32 buffer
    start: int
    stop: int
    shape: tuple[int, ...]
    dtype: str  # the leaf's own dtype, restored by unpack


class Layout(NamedTuple):
    treedef: Any
    slots: tuple[Slot, ...]
    int_size: int
    float_size: int


_layouts: dict[tuple, Layout] = {}


def _layout(treedef, leaves) -> Layout:
    key = (treedef, tuple((a.shape, a.dtype) for a in leaves))
    layout = _layouts.get(key)
    if layout is None:
        sizes, slots = [0, 0], []
        for a in leaves:
            dtype = str(a.dtype)
            if dtype not in _INT_DTYPES + _FLOAT_DTYPES:
                raise TypeError(f"cannot pack a {dtype} leaf (only {', '.join(_INT_DTYPES + _FLOAT_DTYPES)})")
            floating = dtype in _FLOAT_DTYPES
            start = sizes[floating]
            sizes[floating] += a.size
            slots.append(Slot(floating, start, sizes[floating], tuple(a.shape), dtype))
        layout = _layouts[key] = Layout(treedef, tuple(slots), sizes[0], sizes[1])
    return layout


def pack(tree) -> tuple[np.ndarray, np.ndarray, Layout]:
    """tree of numpy arrays -> (int32 buffer, float32 buffer, layout)."""
    leaves, treedef = jax.tree.flatten(tree)
    layout = _layout(treedef, leaves)
    # Fresh buffers every step: the runtime may keep reading (or, on CPU, alias) a numpy buffer
    # after the call returns, so refilling the previous step's could change its inputs.
    ints = np.empty(layout.int_size, np.int32)
    floats = np.empty(layout.float_size, np.float32)
    for a, s in zip(leaves, layout.slots):
        if s.floating:
            floats[s.start:s.stop] = a.ravel()
        else:
            ints[s.start:s.stop] = a.view(np.int32).ravel() if s.dtype == "uint32" else a.ravel()
    return ints, floats, layout


def unpack(layout: Layout, ints, floats):
    """The tree `pack` packed, from its two buffers (traced inside the jitted step)."""
    leaves = []
    for s in layout.slots:
        a = (floats if s.floating else ints)[s.start:s.stop].reshape(s.shape)
        if s.dtype == "bool":
            a = a != 0
        elif s.dtype == "uint32":
            a = jax.lax.bitcast_convert_type(a, jnp.uint32)
        leaves.append(a)
    return jax.tree.unflatten(layout.treedef, leaves)
