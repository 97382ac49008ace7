"""The Flax side of every family: weights as nnx.Params with logical axes, and a params tree bound
into the family's module while the step is traced.

A family writes its model as Flax NNX modules. Each weight is declared once, in a module's
`__init__`, by `ParamMaker`: an `nnx.Param` whose Flax partitioning metadata are the weight's logical
axis names (`vocab`, `embed`, `heads`, `kv_heads`, `mlp`, `experts`, ...; the stacked layers' leading
axis is `layers`) and whose value is abstract (a ShapeDtypeStruct). Modules are only built abstract:
the values come from a checkpoint (or `init_params`) as a *params tree*, the pure-dict form of the
module's parameter state (`nnx.to_pure_dict`, each `nnx.List` as a Python list). Loaders,
quantization, `jlight convert`'s orbax checkpoints and the sharding plan read and write that tree; its
leaves may be arrays or weight types (QuantizedWeight, FusedWeight, ...), whose metadata stay the
declared ones.

The jitted step takes the params tree and `bind` merges it into the module (`nnx.split` of the
abstract module, its Params' values replaced, `nnx.merge`) while tracing, so the module costs trace
time only. Plain dicts and lists also flatten in jax's C++ pytree code on every call, where an
`nnx.State` of 288 weights flattens in Python: 86 against 396 us a call on a 2-core CPU.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jlight.core.batch_metadata import BatchMetadata
from jlight.core.parallel_ops import ParallelOps
from jlight.models.layers import FUSED_PROJECTIONS


class Step(NamedTuple):
    """What the layers of one forward pass read besides their weights."""
    md: BatchMetadata
    kernels: object  # pallas_kernels.dispatch.Kernels: write_kv, paged_attention, matmul, moe_impl, ...
    ops: ParallelOps  # plain ops on one device, the tensor-parallel ones inside shard_map
    rope: tuple  # the family's RoPE: llama.py's families a tuple of attention_kinds.RopeTable (one per table a layer may
    # name), DeepSeek (inv_freq [rope_dim // 2] float32 numpy, attention factor)
    kv_groups: object = None  # llama.py's families: the pool's kv_layout.KVGroups, used when md has group tables


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a params tree holds its layers: stacked [layers, ...] under lax.scan, or one tree per layer
    (`unrolled`, models/layers.split_layers); and which FUSED_PROJECTIONS names replace their parts
    (`fused`, models/layers.fuse_projections)."""
    unrolled: bool = False
    fused: frozenset = frozenset()

    @classmethod
    def of(cls, params: dict) -> Layout:
        layers = params["layers"]
        first = layers[0] if isinstance(layers, (list, tuple)) else layers
        from_layers = {name for name in first if name in FUSED_PROJECTIONS}
        return cls(unrolled=isinstance(layers, (list, tuple)), fused=frozenset(from_layers))


class ParamMaker:
    """Declares weights: `make(shape, axes)` is an abstract nnx.Param carrying `axes` as its Flax
    logical partitioning. With `stack=n` every weight gets a leading [n] `layers` axis."""

    def __init__(self, stack: int | None = None):
        self.lead = (stack,) if stack else ()
        self.lead_axes = ("layers",) if stack else ()

    def __call__(self, shape: tuple[int, ...], axes: tuple[str | None, ...]) -> nnx.Param:
        assert len(shape) == len(axes), (shape, axes)
        value = jax.ShapeDtypeStruct(self.lead + tuple(shape), jnp.float32)  # its values come from a params tree
        init = nnx.with_partitioning(lambda: value, self.lead_axes + tuple(axes))
        return nnx.Param(init(), eager_sharding=False)

    def columns(self, layout: Layout, fused_name: str, in_dim: int, parts: dict, in_axis: str = "embed") -> dict:
        """The column projections `parts` ({name: (out_dim, out_axis)}) that read one input, or their
        fused weight when the layout fuses them: {attribute name: nnx.Param}. A fused weight runs on
        one device only (the engine fuses without a mesh), so its `out` axis has no name."""
        if fused_name in layout.fused:
            width = sum(out for out, _ in parts.values())
            return {fused_name: self((in_dim, width), (in_axis, None))}
        return {name: self((in_dim, out), (in_axis, axis)) for name, (out, axis) in parts.items()}


def declare(module: nnx.Module, params: dict) -> None:
    """Set each {name: nnx.Param} of `params` as an attribute of `module`."""
    for name, param in params.items():
        setattr(module, name, param)


def value(module: nnx.Module, name: str):
    """The value of a module's weight `name`: an array, a QuantizedWeight, a FusedWeight, ..."""
    return getattr(module, name).get_value()


def _tree_of(node):
    """nnx.to_pure_dict's form -> the params tree's: int-keyed dicts (nnx.List) become lists."""
    if isinstance(node, dict):
        if node and all(isinstance(k, int) for k in node):
            return [_tree_of(node[i]) for i in range(len(node))]
        return {k: _tree_of(v) for k, v in node.items()}
    return node


def _flatten(tree, prefix=()):
    """(path, leaf) pairs of a params tree; dicts and lists are its nodes, anything else a weight."""
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        items = enumerate(tree)
    else:
        yield prefix, tree
        return
    for key, sub in items:
        yield from _flatten(sub, prefix + (key,))


def tree_map_params(fn: Callable, module: nnx.Module):
    """`fn(param)` for every nnx.Param of the module, as a params tree."""
    state = nnx.state(module, nnx.Param)
    return _tree_of(nnx.to_pure_dict(state, extract_fn=fn))


def param_shapes(module: nnx.Module) -> dict:
    """The shape of every weight, in the params tree's structure."""
    return tree_map_params(lambda p: tuple(p.get_value().shape), module)


def param_axes(module: nnx.Module) -> dict:
    """Every weight's logical axis names (its Flax partitioning metadata), in the params tree's
    structure: a tuple per weight, None where a dimension has no name."""
    specs = nnx.get_partition_spec(nnx.state(module, nnx.Param))
    return _tree_of(nnx.to_pure_dict(specs, extract_fn=lambda p: tuple(p.get_value())))


def bind(module: nnx.Module, params: dict) -> nnx.Module:
    """The abstract `module` with the params tree's values as its weights (nnx.split, nnx.merge).

    The tree must hold exactly the module's weights; a ValueError names those that differ."""
    graphdef, state = nnx.split(module)
    declared = dict(nnx.to_flat_state(state))
    given = dict(_flatten(params))
    missing = sorted(".".join(map(str, p)) for p in declared.keys() - given.keys())
    unexpected = sorted(".".join(map(str, p)) for p in given.keys() - declared.keys())
    if missing or unexpected:
        raise ValueError(
            f"the params tree does not match {type(module).__name__}'s weights: missing {missing[:6]}, unexpected "
            f"{unexpected[:6]}; build it with the family's loader (jlight.loading) or init_params for this config")
    return nnx.merge(graphdef, nnx.from_flat_state({p: v.replace(given[p]) for p, v in declared.items()}))


def run_layers(layers, carry, step: Step, first: int = 0):
    """carry -> layer(*carry, layer_index, step) over a group of layers, each returning the new carry.

    `layers` is an nnx.List of per-layer modules, run unrolled (each layer's weights are their own
    buffers, which the matmuls read in place), or one module whose weights are stacked [n, ...],
    run under lax.scan (one compiled body; XLA slices each layer's weights out of the stack on every
    step). Layer indices (into the KV pools) are first, first + 1, ...
    """
    if isinstance(layers, nnx.List):
        for i, layer in enumerate(layers):
            carry = call_layer(layer, carry, first + i, step)
        return carry
    graphdef, state = nnx.split(layers)
    n = jax.tree.leaves(state)[0].shape[0]

    def body(carry, xs):
        layer_state, layer_index = xs
        return nnx.merge(graphdef, layer_state)(*carry, layer_index, step), None

    carry, _ = jax.lax.scan(body, carry, (state, jnp.arange(first, first + n, dtype=jnp.int32)))
    return carry


def call_layer(layer: nnx.Module, carry, index: int, step: Step):
    """layer(*carry, index, step) for one layer of an unrolled loop. With step.kernels.trace_layers_once (the
    default), through one jitted function whose static arguments are the layer's graph (its kind of module and
    static attributes) and step's parts that are not arrays: layers alike are traced and lowered once (a
    function the step calls once a layer, which XLA inlines), not once each, so a 32-layer step lowers in a
    fraction of the time; the index is then an argument, not a constant."""
    if not getattr(step.kernels, "trace_layers_once", False):
        return layer(*carry, jnp.int32(index), step)
    leaves, treedef = jax.tree.flatten(step)
    dynamic = [isinstance(leaf, jax.Array) for leaf in leaves]
    static = _StaticParts(treedef, tuple(_Static(leaf) if not d else None for leaf, d in zip(leaves, dynamic)))
    graphdef, state = nnx.split(layer)
    return _call_layer_traced(graphdef, static, state, carry, jnp.int32(index), [leaf for leaf, d in zip(leaves, dynamic) if d])


class _Static:
    """A static argument's part: compared by value where it can be hashed, else by identity (numpy tables)."""
    __slots__ = ("value", "_key")

    def __init__(self, value):
        self.value = value
        try:
            hash(value)
            self._key = (True, value)
        except TypeError:
            self._key = (False, id(value))

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        if not isinstance(other, _Static) or self._key[0] != other._key[0]:
            return False
        return self.value is other.value if not self._key[0] else (type(self.value) is type(other.value) and self._key == other._key)


class _StaticParts(NamedTuple):
    treedef: object
    leaves: tuple  # _Static for a static leaf, None where an array goes

    def rebuild(self, arrays) -> Step:
        arrays = iter(arrays)
        return jax.tree.unflatten(self.treedef, [next(arrays) if s is None else s.value for s in self.leaves])


@functools.partial(jax.jit, static_argnums=(0, 1))
def _call_layer_traced(graphdef, static: _StaticParts, state, carry, index, arrays):
    return nnx.merge(graphdef, state)(*carry, index, static.rebuild(arrays))


def run_layers_tapping(layers, carry, step: Step, taps: tuple[int, ...]):
    """run_layers over unrolled layers, also returning the residual stream (carry[0]) entering each layer
    of `taps` (len(layers): after the last), concatenated on the last axis in layer order."""
    if not isinstance(layers, nnx.List):
        raise ValueError("tapping hidden states between layers needs unrolled layers; set layer_loop='unroll'")
    tapped = {}
    for i, layer in enumerate(layers):
        if i in taps:
            tapped[i] = carry[0]
        carry = call_layer(layer, carry, i, step)
    if len(layers) in taps:
        tapped[len(layers)] = carry[0]
    return carry, jnp.concatenate([tapped[i] for i in sorted(taps)], axis=-1)


def layer_group(make_layer: Callable, num_layers: int, layout: Layout):
    """`num_layers` layers as the layout holds them: an nnx.List of `make_layer(None)`, or one
    `make_layer(num_layers)` whose weights are stacked."""
    if layout.unrolled:
        return nnx.List([make_layer(None) for _ in range(num_layers)])
    return make_layer(num_layers)


def random_params(shapes: dict, key: jax.Array, dtype) -> dict:
    """Normal(0, 1/fan_in) for matrices, ones for norms, for any tree of shapes (benchmarks, tests)."""
    is_shape = lambda x: isinstance(x, tuple)
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=is_shape)
    keys = jax.random.split(key, len(leaves))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(shapes, is_leaf=is_shape)[0]]
    out = []
    for k, shape, path in zip(keys, leaves, paths):
        if "norm" in path:
            out.append(jnp.ones(shape, dtype))
        else:
            fan_in = shape[-2] if len(shape) >= 2 else shape[-1]
            out.append((jax.random.normal(k, shape, jnp.float32) / np.sqrt(fan_in)).astype(dtype))
    return jax.tree.unflatten(treedef, out)


class FamilyFunctions(NamedTuple):
    """A family's contract (docs/ARCHITECTURE.md, "Model family") over its model class, whose
    `__init__(config, layout)` declares the weights, `__call__(tokens, k_cache, v_cache, md, kernels,
    ops) -> (hidden, k_cache, v_cache)` runs the decoder and `logits(hidden, kernels, ops)` the LM head."""
    param_shapes: Callable  # (config, layout=Layout()) -> weight shapes; the stacked tree is what loaders fill
    param_axes: Callable  # (config, layout=Layout()) -> logical axes, in that layout's tree
    init_params: Callable  # (config, key, dtype) -> random weights (benchmarks, tests)
    forward: Callable  # (params, config, tokens [T], k_cache, v_cache, md, kernels, ops) -> (hidden [T, E], k_cache, v_cache)
    compute_logits: Callable  # (params, config, hidden [N, E], kernels, ops) -> float32 logits [N, vocab]


def tapping_forward(model_class) -> Callable:
    """forward_tapping(params, config, tokens, k_cache, v_cache, md, kernels, ops, layers) -> (hidden, tapped
    [T, len(layers) * embed], k_cache, v_cache): the forward of a model class whose __call__ takes `taps`
    (run_layers_tapping), for a speculative head that reads the target's inner layers (EAGLE-3)."""

    def forward_tapping(params: dict, config, tokens, k_cache, v_cache, md: BatchMetadata, kernels, ops: ParallelOps, layers):
        return bind(model_class(config, Layout.of(params)), params)(tokens, k_cache, v_cache, md, kernels, ops, taps=layers)

    return forward_tapping


def family_functions(model_class) -> FamilyFunctions:
    def shapes(config, layout: Layout = Layout()):
        return param_shapes(model_class(config, layout))

    def axes(config, layout: Layout = Layout()):
        return param_axes(model_class(config, layout))

    def init_params(config, key: jax.Array, dtype=jnp.bfloat16) -> dict:
        return random_params(shapes(config), key, dtype)

    def forward(params: dict, config, tokens, k_cache, v_cache, md: BatchMetadata, kernels, ops: ParallelOps):
        return bind(model_class(config, Layout.of(params)), params)(tokens, k_cache, v_cache, md, kernels, ops)

    def compute_logits(params: dict, config, hidden, kernels, ops: ParallelOps):
        return bind(model_class(config, Layout.of(params)), params).logits(hidden, kernels, ops)

    return FamilyFunctions(shapes, axes, init_params, forward, compute_logits)
