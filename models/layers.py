"""Small layers shared by the model families, and the params-tree transforms the engine applies
(per-layer split, fused projections)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jlight.core.gguf_weights import GGUF_WEIGHTS, out_axis


def rms_norm(x, weight, eps: float, offset: float = 0.0):
    """RMSNorm computed in float32 (as HF does), returned in x's dtype; the scale is
    offset + weight (Gemma's norms: 1 + weight, added in float32)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * (offset + weight.astype(jnp.float32))).astype(x.dtype)


ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu2": lambda x: jnp.square(jax.nn.relu(x)),  # Nemotron-H's MLP
}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"hidden_act {name!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def split_layers(stacked, donate: bool = False, through_host: bool = False) -> list:
    """A tree of stacked [layers, ...] weights -> one tree per layer (for unrolled layer loops).

    One leaf at a time: with donate=True each stacked leaf is deleted as soon as it is split, so
    the peak is the weights plus one leaf, not twice the weights (the caller must not use the
    stacked tree afterwards).
    through_host=True (with donate, for leaves on one device): each leaf goes to host memory, is
    deleted, and its slices come back into the place it held. The device's free memory then stays
    in one block, where a split on the device leaves a hole of a leaf's size between its slices and
    the next leaf's, and a KV pool sized to what is free then finds no block large enough.
    """
    leaves, treedef = jax.tree.flatten(stacked)
    num_layers = leaves[0].shape[0]
    split = jax.jit(lambda a: tuple(a[i] for i in range(num_layers)))
    per_leaf = []
    for leaf in leaves:
        if donate and through_host and len(leaf.devices()) == 1:
            (device,) = leaf.devices()
            host = np.asarray(leaf)
            leaf.delete()
            per_leaf.append(tuple(jax.device_put([host[i] for i in range(num_layers)], device)))
            continue
        per_leaf.append(split(leaf))
        if donate:
            jax.block_until_ready(per_leaf[-1])
            leaf.delete()
    return [jax.tree.unflatten(treedef, [parts[i] for parts in per_leaf]) for i in range(num_layers)]


# Column projections that read the same input, fused into one weight so that a step reads them
# in one matmul (one kernel launch, one wider GEMV that fills the GPU better at batch 1):
# q/k/v, and gate/up of the gated MLPs. The fused name -> the projections it replaces, in order.
FUSED_PROJECTIONS = {
    "wqkv": ("wq", "wk", "wv"),
    "w_gate_up": ("w_gate", "w_up"),
    "shared_gate_up": ("shared_gate", "shared_up"),
}


@jax.tree_util.register_pytree_node_class
class FusedWeight:
    """Several [in, out_i] weights concatenated on `out`: weight [..., in, sum(out_i)] (a plain
    array or an int8 QuantizedWeight; GGUF weights, [out, in] rows, on their rows); `widths` = (out_i, ...)
    is static, so slicing a stacked FusedWeight (lax.scan) keeps it."""

    def __init__(self, weight, widths: tuple[int, ...]):
        self.weight, self.widths = weight, tuple(widths)

    def tree_flatten(self):
        return (self.weight,), self.widths

    @classmethod
    def tree_unflatten(cls, widths, children):
        return cls(children[0], widths)


def _out_width(w) -> int:
    return w.shape[-1] if isinstance(w, GGUF_WEIGHTS) else (w.values if hasattr(w, "values") else w).shape[-1]


def _fusable(weights) -> bool:
    """Same container type, same dtypes, same dims but `out` (the last axis; a GGUF weight's rows)."""
    axis = out_axis(weights[0])

    def others(shape):
        return shape[:axis] + (shape[axis + 1:] if axis != -1 else ())
    kinds = {(type(w), tuple((leaf.dtype, others(leaf.shape)) for leaf in jax.tree.leaves(w))) for w in weights}
    if len(kinds) != 1:
        return False
    leaves = jax.tree.leaves(weights[0])
    return all(leaf.ndim >= 1 for leaf in leaves) and leaves[0].ndim >= 2


@functools.partial(jax.jit, static_argnums=1)
def _concat(ws, axis: int):
    return jax.tree.map(lambda *leaves: jnp.concatenate(leaves, axis=axis), *ws)


def _concat_out(ws):
    return _concat(ws, out_axis(ws[0]))


def fuse_projections(layers, delete_parts: bool = False):
    """Replace each complete group of FUSED_PROJECTIONS in a layer tree by one FusedWeight.

    `layers`: stacked weights (a dict) or per-layer dicts (a list, from split_layers). A group
    whose parts differ in type or dtype (e.g. one kept in bf16 by quantize_params(keep=...)) stays
    as it is. delete_parts=True frees each group's parts once fused, so the extra memory at any
    time is one group (one layer's group when per-layer); the caller must not use them afterwards.
    Single device only: fused columns do not split into whole q/k/v heads across devices.
    """
    if isinstance(layers, (list, tuple)):
        return [fuse_projections(lp, delete_parts) for lp in layers]
    lp = dict(layers)
    for fused_name, names in FUSED_PROJECTIONS.items():
        parts = [lp.get(n) for n in names]
        if any(p is None for p in parts) or not _fusable(parts):
            continue
        lp[fused_name] = FusedWeight(_concat_out(parts), tuple(_out_width(p) for p in parts))
        for n in names:
            del lp[n]
        if delete_parts:
            jax.block_until_ready(lp[fused_name].weight)
            for leaf in jax.tree.leaves(parts):
                leaf.delete()
    return lp


def column_projections(ops, x, layer, names: tuple[str, ...], matmul) -> list:
    """x times each column projection `names` of a layer module: one matmul if they were fused
    (fuse_projections), split back into the parts' outputs."""
    fused_name = next(f for f, group in FUSED_PROJECTIONS.items() if group == names)
    if not hasattr(layer, fused_name):
        return [ops.column_linear(x, getattr(layer, n).get_value(), matmul) for n in names]
    fused = getattr(layer, fused_name).get_value()
    y = ops.column_linear(x, fused.weight, matmul)
    bounds = np.cumsum(fused.widths)[:-1].tolist()
    return jnp.split(y, bounds, axis=-1)


def unstack_layers(params: dict, donate: bool = False, through_host: bool = False) -> dict:
    """Split every stacked group of a params tree ("layers", DeepSeek's "dense_layers") into one
    tree per layer, for the unrolled forward (the GPU default).

    Costs a longer compile (the layer body is compiled once per layer) and buys weights that the
    matmul kernels read where they lie, instead of a per-step slice copy out of the stack.
    donate=True frees each stacked weight as it is split (split_layers), so the peak is the weights
    plus one leaf rather than twice the weights; through_host=True keeps the free memory in one block
    as it does (split_layers).
    """
    return {name: split_layers(group, donate, through_host) if isinstance(group, dict) else group
            for name, group in params.items()}
