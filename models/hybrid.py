"""What the hybrid families (attention layers interleaved with recurrent ones) share: a layer of
a stacked group taken by index, the gated RMSNorm, and the params-tree contract over groups.

A hybrid family's params tree holds one stacked group per kind of layer (e.g. "mamba_layers",
"attn_layers", each [n, ...] of that kind, in model order), since the kinds have different weights;
the forward runs the layers in the checkpoint's order, layer i taking the next layer of its kind's
group. Unrolled (models/layers.unstack_layers), each group is a list of per-layer trees.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jlight.core.recurrent_state import PagesAndState
from jlight.models import module
from jlight.models.layers import rms_norm
from jlight.models.module import Layout, ParamMaker, Step, layer_group, value
from jlight.models.rope import inv_frequencies


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


def attention_params(p: ParamMaker, config, q_width: int) -> dict:
    """The q/k/v/o projections of a hybrid family's attention layer (q_width: wq's output width), with
    the biases when the config has them (o_proj's too)."""
    c = config
    E, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    params = dict(wq=p((E, q_width), ("embed", "heads")), wk=p((E, kv), ("embed", "kv_heads")),
                  wv=p((E, kv), ("embed", "kv_heads")), wo=p((q, E), ("heads", "embed")))
    if c.attention_bias:
        params.update(bq=p((q_width,), ("heads",)), bk=p((kv,), ("kv_heads",)), bv=p((kv,), ("kv_heads",)),
                      bo=p((E,), ("embed_norm",)))
    return params


def gated_rms_norm(x, gate, weight, group_size: int, eps: float):
    """Mamba-2's / DeltaNet's gated norm: (x * silu(gate)) RMS-normalised over groups of group_size
    channels, in float32, times weight. x, gate: [T, C] -> [T, C] in x's dtype."""
    x32 = x.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))
    g = x32.reshape(x.shape[:-1] + (-1, group_size))
    g = g * jax.lax.rsqrt(jnp.mean(g * g, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * g.reshape(x.shape)).astype(x.dtype)


class HybridDecoder(nnx.Module):
    """Embedding, the layers of each kind in their groups, the final norm and the LM head.

    A family subclasses it with `KINDS` = {kind: (group name, layer class)} ("attention" names the
    attention layers, which index the KV pools) and `layer_kinds(config)`, each layer's kind in
    model order; `embed_scale`, `norm_weight` (e.g. 1 + w) and `logits_scale` say what differs.
    A layer is `layer(h, caches, index, step) -> (h, caches)`, caches being (K pages, V pages, state
    pools), index its place among the layers of its kind.
    """
    KINDS: dict = {}

    @staticmethod
    def layer_kinds(config) -> list[str]:  # each family says its own (granite_hybrid, nemotron_h, qwen3_next)
        raise NotImplementedError("a HybridDecoder subclass gives layer_kinds(config): each layer's kind in model order")

    def __init__(self, config, layout: Layout = Layout()):
        c = self.config = config
        p = ParamMaker()
        kinds = self.layer_kinds(c)
        self.embed = p((c.vocab_size, c.hidden_size), ("vocab", "embed"))
        for kind, (group, make) in self.KINDS.items():
            if kinds.count(kind):
                setattr(self, group, layer_group(functools.partial(make, c), kinds.count(kind), layout))
        self.final_norm = p((c.hidden_size,), ("embed_norm",))
        self.lm_head = p((c.hidden_size, c.vocab_size), ("embed", "vocab"))

    def embed_scale(self) -> float:
        return 1.0

    def logits_scale(self) -> float:
        return 1.0

    def norm_weight(self, w):
        return w

    def rope(self):
        c = self.config
        return inv_frequencies(c.head_dim, c.rope_theta, c.rope_scaling)

    def __call__(self, tokens, k_cache: PagesAndState, v_cache, md, kernels, ops):
        c = self.config
        step = Step(md, kernels, ops, self.rope())
        final_norm = value(self, "final_norm")
        h = ops.embed(value(self, "embed"), tokens).astype(final_norm.dtype) * self.embed_scale()  # [T, embed]
        caches = (k_cache.pages, v_cache, k_cache.state)
        seen = dict.fromkeys(self.KINDS, 0)
        for kind in self.layer_kinds(c):
            h, caches = layer_at(getattr(self, self.KINDS[kind][0]), seen[kind])(h, caches, seen[kind], step)
            seen[kind] += 1
        k_pages, v_cache, state = caches
        h = rms_norm(h, self.norm_weight(final_norm), c.rms_norm_eps)
        return ops.gather_sequence(h), PagesAndState(k_pages, state), v_cache

    def logits(self, hidden, kernels, ops):
        logits = ops.lm_head(hidden, value(self, "lm_head"), kernels.matmul)
        scale = self.logits_scale()
        return logits if scale == 1.0 else logits * scale


class HybridFunctions(NamedTuple):
    """A hybrid family's contract (module.FamilyFunctions, plus its pools' shapes)."""
    param_shapes: Callable
    param_axes: Callable
    init_params: Callable
    forward: Callable
    compute_logits: Callable
    kv_cache_shapes: Callable  # (config, num_pages, page_size) -> (k_shape, v_shape), attention layers only


def hybrid_functions(model_class) -> HybridFunctions:
    groups = tuple(group for group, _ in model_class.KINDS.values())

    def shapes(config, layout: Layout = Layout()):
        return module.param_shapes(model_class(config, layout))

    def axes(config, layout: Layout = Layout()):
        return module.param_axes(model_class(config, layout))

    def init_params(config, key, dtype=jnp.bfloat16):
        return module.random_params(shapes(config), key, dtype)

    def forward(params, config, tokens, k_cache, v_cache, md, kernels, ops):
        return module.bind(model_class(config, layout_of(params, groups)), params)(tokens, k_cache, v_cache, md, kernels, ops)

    def compute_logits(params, config, hidden, kernels, ops):
        return module.bind(model_class(config, layout_of(params, groups)), params).logits(hidden, kernels, ops)

    def kv_cache_shapes(config, num_pages: int, page_size: int):
        """[attention layers, pages, page_size, kv_heads, head_dim] each."""
        shape = (model_class.layer_kinds(config).count("attention"), num_pages, page_size, config.num_kv_heads, config.head_dim)
        return shape, shape

    return HybridFunctions(shapes, axes, init_params, forward, compute_logits, kv_cache_shapes)
