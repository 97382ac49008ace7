"""Small layers shared by the model families."""
import jax
import jax.numpy as jnp


def rms_norm(x, weight, eps: float):
    """RMSNorm computed in float32 (as HF does), returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * weight.astype(jnp.float32)).astype(x.dtype)


ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"hidden_act {name!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def split_layers(stacked, donate: bool = False) -> list:
    """A tree of stacked [layers, ...] weights -> one tree per layer (for unrolled layer loops).

    One leaf at a time: with donate=True each stacked leaf is deleted as soon as it is split, so
    the peak is the weights plus one leaf, not twice the weights (the caller must not use the
    stacked tree afterwards).
    """
    leaves, treedef = jax.tree.flatten(stacked)
    num_layers = leaves[0].shape[0]
    split = jax.jit(lambda a: tuple(a[i] for i in range(num_layers)))
    per_leaf = []
    for leaf in leaves:
        per_leaf.append(split(leaf))
        if donate:
            jax.block_until_ready(per_leaf[-1])
            leaf.delete()
    return [jax.tree.unflatten(treedef, [parts[i] for parts in per_leaf]) for i in range(num_layers)]


def run_layers(layer, carry, layers, first: int = 0):
    """Apply `layer(carry, (layer_params, layer_index)) -> (carry, _)` over a stack of layers.

    `layers` is either stacked [n, ...] weights, run under lax.scan (one compiled body), or a list
    of per-layer trees from `split_layers`, run unrolled: each layer's weights are then their own
    buffers, which the matmuls read in place, where a scan would slice them out of the stack on
    every step. Layer indices (for the KV pools) are first, first + 1, ...
    """
    if isinstance(layers, (list, tuple)):
        for i, layer_params in enumerate(layers):
            carry, _ = layer(carry, (layer_params, jnp.int32(first + i)))
        return carry
    n = jax.tree.leaves(layers)[0].shape[0]
    carry, _ = jax.lax.scan(layer, carry, (layers, jnp.arange(first, first + n, dtype=jnp.int32)))
    return carry
