"""Gemma 2 and Gemma 3 (text): Llama-shaped decoders with Gemma's norms and attention kinds.

What differs from llama.py's layers:
  * every RMSNorm scales by (1 + weight), in float32 (`norm_offset`);
  * four norms per layer: before and after the attention (`attn_norm`, `post_attn_norm`) and
    before and after the MLP (`mlp_norm`, `post_mlp_norm`), the post norms applied to the branch
    before it joins the residual stream;
  * the embedding is scaled by sqrt(hidden_size) (in the embedding's dtype, as HF does);
  * the softmax scale is query_pre_attn_scalar^-0.5;
  * interleaved local (sliding-window) and global layers (`layer_types`; Gemma 2 alternates, Gemma 3
    has 5 local : 1 global), Gemma 3's local layers with their own RoPE base (rope_local_base_freq):
    models/attention_kinds.py;
  * Gemma 2 soft-caps the attention scores (attn_logit_softcapping) and the final logits
    (final_logit_softcapping): cap * tanh(x / cap);
  * Gemma 3 norms q and k over head_dim (q_norm, k_norm);
  * the MLP is gated gelu (tanh approximation, hidden_activation), the embeddings tied.
"""
from __future__ import annotations

import math

import jax.numpy as jnp

from jlight.core.config import ModelConfig
from jlight.models import llama
# fuse_projections and unstack_layers: as in llama.py (q/k/v and gate/up).
from jlight.models.layers import fuse_projections, unstack_layers  # noqa: F401
from jlight.models.module import Layout, ParamMaker, Step, family_functions

kv_cache_shapes = llama.kv_cache_shapes
kv_layer_windows = llama.kv_layer_windows


class GemmaLayer(llama.LlamaLayer):
    """Gemma's layer: Llama's attention and gated MLP between four (1 + w) norms."""
    norm_offset = 1.0

    def __init__(self, config: ModelConfig, layout: Layout, stack: int | None):
        super().__init__(config, layout, stack)
        p = ParamMaker(stack)
        E = config.hidden_size
        self.post_attn_norm = p((E,), ("embed_norm",))
        self.post_mlp_norm = p((E,), ("embed_norm",))

    def __call__(self, h, k_cache, v_cache, layer_idx, step: Step):
        attn, k_cache, v_cache = self.attention(self.norm(h, "attn_norm"), k_cache, v_cache, layer_idx, step)
        h = h + self.norm(attn, "post_attn_norm")
        return h + self.norm(self.mlp(self.norm(h, "mlp_norm"), step), "post_mlp_norm"), k_cache, v_cache


class Gemma(llama.Llama):
    """Llama's decoder over GemmaLayers, the embedding scaled by sqrt(hidden), logits soft-capped."""
    Layer = GemmaLayer

    def scale_embedding(self, h):
        return h * jnp.asarray(math.sqrt(self.config.hidden_size), h.dtype)

    def logits(self, hidden, kernels, ops):
        logits = super().logits(hidden, kernels, ops)
        cap = self.config.extra.get("final_logit_softcapping")
        return logits if not cap else cap * jnp.tanh(logits / cap)


param_shapes, param_axes, init_params, forward, compute_logits = family_functions(Gemma)
