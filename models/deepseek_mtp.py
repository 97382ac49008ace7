"""DeepSeek-V3's multi-token-prediction (MTP) layer as a draft head (engine/proposers/mtp.py runs it).

The checkpoint's layer num_hidden_layers (`model.layers.{L}.*`, `num_nextn_predict_layers` of them) reads
the target's final normed hidden state at a position with the embedding of the token after it:
  x = eh_proj(concat(enorm(embed(token)), hnorm(hidden)))   (the embedding zeroed at position 0)
  h = a DeepSeek decoder layer (MLA attention, MoE past first_k_dense_replace) over x
  logits = shared_head.head(shared_head.norm(h))
and h, before that norm, is the hidden state the next chained draft reads. Its latent cache has one layer.
"""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jlight.core.config import ModelConfig
from jlight.models import deepseek
from jlight.models.layers import rms_norm
from jlight.models.module import ParamMaker, Step, bind, param_shapes, value


class DeepSeekMTP(nnx.Module):
    def __init__(self, config: ModelConfig):
        c = self.config = config
        p = ParamMaker()
        E, V = c.hidden_size, c.vocab_size
        self.embed = p((V, E), ("vocab", "embed"))
        self.enorm = p((E,), ("embed_norm",))
        self.hnorm = p((E,), ("embed_norm",))
        self.eh_proj = p((2 * E, E), (None, "embed"))
        self.layer = deepseek.DeepSeekLayer(c, None, moe=True)  # layer L, past the first_k_dense_replace dense ones
        self.head_norm = p((E,), ("embed_norm",))
        self.lm_head = p((E, V), ("embed", "vocab"))

    def __call__(self, tokens, hidden, k_cache, v_cache, md, kernels, ops):
        """tokens: [T] int32, each token's successor; hidden: [T, embed] the target's final hidden states (the
        first pass) or the layer's own output (a chained draft) -> ([T, embed], k_cache, v_cache)."""
        c = self.config
        step = Step(md, kernels, ops, deepseek.rope_table(c, deepseek.mla_settings(c)))
        dtype = value(self, "enorm").dtype
        embeds = ops.embed(value(self, "embed"), tokens).astype(dtype)
        embeds = jnp.where((md.positions == 0)[:, None], 0, embeds)  # position 0 has no token before it to predict from
        x = jnp.concatenate([rms_norm(embeds, value(self, "enorm"), c.rms_norm_eps),
                             rms_norm(hidden.astype(dtype), value(self, "hnorm"), c.rms_norm_eps)], axis=-1)
        h, k_cache = self.layer(kernels.matmul(x, value(self, "eh_proj")), k_cache, jnp.int32(0), step)
        return h, k_cache, v_cache

    def draft_tokens(self, h, kernels, ops):
        """The greedy draft after each output h [N, embed]."""
        h = rms_norm(h, value(self, "head_norm"), self.config.rms_norm_eps)
        logits = ops.lm_head(h, value(self, "lm_head"), kernels.matmul)[:, : self.config.vocab_size]
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def mtp_param_shapes(config: ModelConfig) -> dict:
    return param_shapes(DeepSeekMTP(config))


def forward(params: dict, config: ModelConfig, tokens, hidden, k_cache, v_cache, md, kernels, ops):
    return bind(DeepSeekMTP(config), params)(tokens, hidden, k_cache, v_cache, md, kernels, ops)


def draft_tokens(params: dict, config: ModelConfig, h, kernels, ops):
    return bind(DeepSeekMTP(config), params).draft_tokens(h, kernels, ops)


def kv_cache_shapes(config: ModelConfig, num_pages: int, page_size: int):
    """The MTP layer's latent pool, one layer of deepseek.kv_cache_shapes' [pages, page_size, 1, latent + rope],
    and the unused V pool."""
    k_shape, v_shape = deepseek.kv_cache_shapes(config, num_pages, page_size)
    return (1,) + k_shape[1:], v_shape
