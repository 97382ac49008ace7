"""The Llama-family decoder: Llama 2/3/3.x, Mistral, Qwen2/2.5 (QKV bias), Qwen3 (QK-norm), SmolLM2.

Pure functions over a params pytree. Layer weights are stacked on a leading `layers` axis
and run with `lax.scan`, so compile time does not grow with depth. Linear weights are
[in, out] matrices (possibly int8 `QuantizedWeight`s); attention heads are flattened into
the out/in dimension (`heads` = num_heads * head_dim, contiguous per head, so splitting
it across devices splits whole heads).

Every weight's logical axes are in `param_axes`; the sharding rules map them to mesh axes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jlight.core.parallel_ops import ParallelOps
from jlight.core.batch_metadata import BatchMetadata
from jlight.core.config import ModelConfig
from jlight.models.rope import apply_rope, inv_frequencies
# fuse_projections is part of this family's interface: the engine fuses q/k/v and gate/up with it
# for single-device runs (EngineConfig.fuse_projections).
from jlight.models.layers import activation, column_projections, fuse_projections, rms_norm, run_layers, split_layers  # noqa: F401


def param_axes(config: ModelConfig) -> dict:
    """Logical axis names of every weight, in the same tree structure as the params."""
    layers = {
        "attn_norm": ("layers", "embed_norm"),
        "wq": ("layers", "embed", "heads"),
        "wk": ("layers", "embed", "kv_heads"),
        "wv": ("layers", "embed", "kv_heads"),
        "wo": ("layers", "heads", "embed"),
        "mlp_norm": ("layers", "embed_norm"),
        "w_gate": ("layers", "embed", "mlp"),
        "w_up": ("layers", "embed", "mlp"),
        "w_down": ("layers", "mlp", "embed"),
    }
    if config.attention_bias:
        layers.update(bq=("layers", "heads"), bk=("layers", "kv_heads"), bv=("layers", "kv_heads"))
    if config.qk_norm:
        layers.update(q_norm=("layers", "head_dim"), k_norm=("layers", "head_dim"))
    axes = {"embed": ("vocab", "embed"), "layers": layers, "final_norm": ("embed_norm",), "lm_head": ("embed", "vocab")}
    return axes


def param_shapes(config: ModelConfig) -> dict:
    """Shape of every weight (same tree as param_axes)."""
    c = config
    L, E, F, V = c.num_layers, c.hidden_size, c.intermediate_size, c.vocab_size
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    layers = {
        "attn_norm": (L, E), "wq": (L, E, q), "wk": (L, E, kv), "wv": (L, E, kv), "wo": (L, q, E),
        "mlp_norm": (L, E), "w_gate": (L, E, F), "w_up": (L, E, F), "w_down": (L, F, E),
    }
    if c.attention_bias:
        layers.update(bq=(L, q), bk=(L, kv), bv=(L, kv))
    if c.qk_norm:
        layers.update(q_norm=(L, c.head_dim), k_norm=(L, c.head_dim))
    return {"embed": (V, E), "layers": layers, "final_norm": (E,), "lm_head": (E, V)}


def init_params(config: ModelConfig, key: jax.Array, dtype=jnp.bfloat16) -> dict:
    """Random weights of the right shapes and scale (for benchmarks; no checkpoint needed)."""
    return random_params(param_shapes(config), key, dtype)


def random_params(shapes: dict, key: jax.Array, dtype) -> dict:
    """Normal(0, 1/fan_in) for matrices, ones for norms, for any tree of shapes."""
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(key, len(leaves))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))[0]]
    out = []
    for k, shape, path in zip(keys, leaves, paths):
        if "norm" in path:
            out.append(jnp.ones(shape, dtype))
        else:
            fan_in = shape[-2] if len(shape) >= 2 else shape[-1]
            out.append((jax.random.normal(k, shape, jnp.float32) / np.sqrt(fan_in)).astype(dtype))
    return jax.tree.unflatten(treedef, out)


def kv_cache_shapes(config: ModelConfig, num_pages: int, page_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of the K and V page pools: [layers, pages, page_size, kv_heads, head_dim] each."""
    shape = (config.num_layers, num_pages, page_size, config.num_kv_heads, config.head_dim)
    return shape, shape


def attention(c: ModelConfig, lp, x, k_cache, v_cache, layer_idx, md: BatchMetadata, kernels, ops: ParallelOps, inv_freq,
              rope_factor):
    """Attention of one Llama-family layer (the MoE families use it too).

    x: [T, embed] (normed) -> ([T, embed], k_cache, v_cache).
    """
    mm = kernels.matmul
    num_tokens = md.positions.shape[0]  # all T tokens: x is [T/tp, embed] under sequence parallelism
    q, k, v = column_projections(ops, x, lp, ("wq", "wk", "wv"), mm)
    if c.attention_bias:
        q, k, v = q + lp["bq"].astype(q.dtype), k + lp["bk"].astype(k.dtype), v + lp["bv"].astype(v.dtype)
    q = q.reshape(num_tokens, -1, c.head_dim)  # [T, local heads, head_dim]
    k = k.reshape(num_tokens, -1, c.head_dim)
    v = v.reshape(num_tokens, -1, c.head_dim)
    if c.qk_norm:
        q = rms_norm(q, lp["q_norm"], c.rms_norm_eps)
        k = rms_norm(k, lp["k_norm"], c.rms_norm_eps)
    q = apply_rope(q, md.positions, inv_freq, rope_factor)
    k = apply_rope(k, md.positions, inv_freq, rope_factor)
    k_cache, v_cache = kernels.write_kv(k_cache, v_cache, layer_idx, k, v, md.slot_mapping)
    attn = kernels.paged_attention(q, k_cache, v_cache, layer_idx, md, scale=c.head_dim ** -0.5, sliding_window=c.sliding_window)
    return ops.row_linear(attn.reshape(num_tokens, -1), lp["wo"], mm), k_cache, v_cache


def forward(params: dict, config: ModelConfig, tokens, k_cache, v_cache, md: BatchMetadata, kernels, ops: ParallelOps):
    """Run the decoder over a flat ragged batch of tokens.

    tokens: [T] int32. Returns (hidden [T, embed] after the final norm, k_cache, v_cache).
    `kernels` supplies write_kv, paged_attention and matmul (see pallas_kernels.dispatch); `ops` the
    parallel ops (jlight/core/parallel_ops.py: plain on one device, tensor-parallel under a mesh).
    """
    c = config
    mm = kernels.matmul
    act = activation(c.hidden_act)
    inv_freq, rope_factor = inv_frequencies(c.head_dim, c.rope_theta, c.rope_scaling)

    def layer(carry, xs):
        h, k_cache, v_cache = carry
        lp, layer_idx = xs
        x = rms_norm(h, lp["attn_norm"], c.rms_norm_eps)
        attn, k_cache, v_cache = attention(c, lp, x, k_cache, v_cache, layer_idx, md, kernels, ops, inv_freq, rope_factor)
        h = h + attn
        x = rms_norm(h, lp["mlp_norm"], c.rms_norm_eps)
        gate, up = column_projections(ops, x, lp, ("w_gate", "w_up"), mm)
        h = h + ops.row_linear(act(gate) * up, lp["w_down"], mm)
        return (h, k_cache, v_cache), None

    h = ops.embed(params["embed"], tokens)
    dtype = params["final_norm"].dtype
    h = h.astype(dtype)
    h, k_cache, v_cache = run_layers(layer, (h, k_cache, v_cache), params["layers"])  # scanned or unrolled
    h = rms_norm(h, params["final_norm"], c.rms_norm_eps)
    h = ops.gather_sequence(h)  # whole [T, embed] again if the residual stream was split on tokens
    return h, k_cache, v_cache


def unstack_layers(params: dict, donate: bool = False) -> dict:
    """Split the stacked [layers, ...] weights into one dict per layer (for the unrolled forward).

    Costs a longer compile (the layer body is compiled num_layers times) and buys weights that
    the matmul kernels read where they lie, instead of a per-step slice copy out of the stack.
    donate=True frees each stacked weight as it is split, so the peak is the weights plus one
    leaf rather than twice the weights (models/layers.split_layers).
    """
    return dict(params, layers=split_layers(params["layers"], donate))


def compute_logits(params: dict, config: ModelConfig, hidden, kernels, ops: ParallelOps):
    """hidden: [N, embed] (already normed) -> float32 logits [N, vocab]."""
    return ops.lm_head(hidden, params["lm_head"], kernels.matmul)
