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
