"""EAGLE draft heads, EAGLE-1 and EAGLE-3: one Llama decoder layer that reads the target's hidden state
beside the embedding of the token that follows it (engine/proposers/eagle.py runs them).

  EAGLE-1: x = fc(concat(embed(token), hidden)) (fc may carry a bias); the layer without its input
    norm (x + attention(x), then the MLP block); no final norm; logits = the target's lm_head.
  EAGLE-3: the target's residual streams at three layers (low, mid, high), concatenated, fused by
    fc [3 * target embed, embed] into the hidden state; the layer's attention reads
    concat(input_norm(embed(token)), hidden_norm(hidden)), 2 * embed wide, its residual is the hidden
    state (hidden_norm'ed with norm_before_residual); logits = norm, then its own lm_head over a reduced
    vocabulary of draft_vocab_size tokens, draft id i being target id i + d2t[i].
Both share the target's embedding (EAGLE-3 has its own when the checkpoint holds one) and return the
layer's output before any final norm: the hidden state the next chained draft reads. Their K/V pool has
one layer (`kv_cache_shapes`).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from jlight.core.config import ModelConfig
from jlight.models import attention_kinds
from jlight.models.layers import rms_norm
from jlight.models.llama import LlamaLayer
from jlight.models.module import Layout, ParamMaker, Step, bind, declare, param_shapes, value


@dataclasses.dataclass(frozen=True)
class EagleHead:
    """What a head checkpoint's config.json says beyond its Llama layer's ModelConfig."""
    eagle3: bool
    target_hidden_size: int  # width of each target hidden state the head reads
    draft_vocab_size: int  # EAGLE-3's lm_head rows (the config's vocab_size for EAGLE-1)
    fc_bias: bool = False  # EAGLE-1 checkpoints may carry fc.bias
    norm_before_residual: bool = False  # EAGLE-3: the residual is hidden_norm(hidden), not hidden


class EagleLayer(LlamaLayer):
    """The head's decoder layer: Llama's, with EAGLE-1's missing input norm or EAGLE-3's 2 * embed wide
    attention input and hidden_norm."""

    def __init__(self, config: ModelConfig, head: EagleHead):
        super().__init__(config, Layout(unrolled=True), None)
        self.layer_index = 0
        self.head = head
        if head.eagle3:
            E, q, kv = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
            p = ParamMaker()
            declare(self, p.columns(Layout(), "wqkv", 2 * E, {"wq": (q, "heads"), "wk": (kv, "kv_heads"), "wv": (kv, "kv_heads")}))
            self.hidden_norm = p((E,), ("embed_norm",))
        else:
            del self.attn_norm

    def __call__(self, embeds, hidden, k_cache, v_cache, step: Step):
        """embeds, hidden: [T, embed] (EAGLE-1: embeds is fc's output and hidden unused) -> ([T, embed], k_cache, v_cache)."""
        layer = jnp.int32(0)
        if not self.head.eagle3:
            attn, k_cache, v_cache = self.attention(embeds, k_cache, v_cache, layer, step)
            h = embeds + attn
        else:
            normed = self.norm(hidden, "hidden_norm")
            x = jnp.concatenate([self.norm(embeds, "attn_norm"), normed], axis=-1)
            attn, k_cache, v_cache = self.attention(x, k_cache, v_cache, layer, step)
            h = (normed if self.head.norm_before_residual else hidden) + attn
        return h + self.mlp(self.norm(h, "mlp_norm"), step), k_cache, v_cache


class Eagle(nnx.Module):
    def __init__(self, config: ModelConfig, head: EagleHead):
        c, self.head = config, head
        self.config = config
        p = ParamMaker()
        E, V = c.hidden_size, c.vocab_size
        self.embed = p((V, E), ("vocab", "embed"))
        fc_in = 3 * head.target_hidden_size if head.eagle3 else 2 * E
        self.fc = p((fc_in, E), (None, "embed"))
        if head.fc_bias:
            self.fc_bias = p((E,), ("embed",))
        self.layer = EagleLayer(c, head)
        if head.eagle3:
            self.final_norm = p((E,), ("embed_norm",))
            self.d2t = p((head.draft_vocab_size,), ("vocab",))
        self.lm_head = p((E, head.draft_vocab_size if head.eagle3 else V), ("embed", "vocab"))

    def __call__(self, tokens, hidden, k_cache, v_cache, md, kernels, ops, from_target: bool):
        """tokens: [T] int32, each token's successor; hidden: [T, ...] the target's hidden states (from_target:
        the first pass; EAGLE-3's tapped layers, fused by fc here) or the head's own output (a chained draft)
        -> (the layer's output [T, embed], k_cache, v_cache)."""
        c, mm = self.config, kernels.matmul
        step = Step(md, kernels, ops, attention_kinds.rope_tables(c))
        dtype = value(self, "fc").dtype
        embeds = ops.embed(value(self, "embed"), tokens).astype(dtype)
        hidden = hidden.astype(dtype)
        if not self.head.eagle3:
            x = mm(jnp.concatenate([embeds, hidden], axis=-1), value(self, "fc"))
            if self.head.fc_bias:
                x = x + value(self, "fc_bias").astype(x.dtype)
            return self.layer(x, None, k_cache, v_cache, step)
        if from_target:
            hidden = mm(hidden, value(self, "fc"))
        return self.layer(embeds, hidden, k_cache, v_cache, step)

    def draft_tokens(self, h, kernels, ops):
        """The head's greedy draft (a target token id) after each output h [N, embed]."""
        if not self.head.eagle3:
            logits = ops.lm_head(h, value(self, "lm_head"), kernels.matmul)[:, : self.config.vocab_size]
            return jnp.argmax(logits, axis=-1).astype(jnp.int32)
        h = rms_norm(h, value(self, "final_norm"), self.config.rms_norm_eps)
        best = jnp.argmax(ops.lm_head(h, value(self, "lm_head"), kernels.matmul), axis=-1)
        return (best + value(self, "d2t")[best]).astype(jnp.int32)


def head_param_shapes(config: ModelConfig, head: EagleHead) -> dict:
    return param_shapes(Eagle(config, head))


def forward(params: dict, config: ModelConfig, head: EagleHead, tokens, hidden, k_cache, v_cache, md, kernels, ops,
            from_target: bool):
    return bind(Eagle(config, head), params)(tokens, hidden, k_cache, v_cache, md, kernels, ops, from_target)


def draft_tokens(params: dict, config: ModelConfig, head: EagleHead, h, kernels, ops):
    return bind(Eagle(config, head), params).draft_tokens(h, kernels, ops)


def kv_cache_shapes(config: ModelConfig, num_pages: int, page_size: int):
    """The head's K and V pools: one layer, [1, pages, page_size, kv_heads, head_dim] each."""
    shape = (1, num_pages, page_size, config.num_kv_heads, config.head_dim)
    return shape, shape
