"""The Llama-family decoder: Llama 2/3/3.x, Mistral, Qwen2/2.5 (QKV bias), Qwen3 (QK-norm), SmolLM2.

Flax NNX modules (models/module.py): `Llama` holds the embedding, the layers and the LM head;
`LlamaLayer` one layer's weights, declared with their logical axes, and its computation. The
layers' weights are stacked on a leading `layers` axis and run under `lax.scan`, so compile time
does not grow with depth, or held per layer (Layout.unrolled) and run unrolled. Linear weights are
[in, out] matrices (possibly int8 `QuantizedWeight`s); attention heads are flattened into the
out/in dimension (`heads` = num_heads * head_dim, contiguous per head, so splitting it across
devices splits whole heads). The sharding rules (sharding/rules.py) map the axes to mesh axes.
"""
from __future__ import annotations

from flax import nnx

from jlight.core import kv_layout
from jlight.core.config import ModelConfig
from jlight.models import attention_kinds
# fuse_projections and unstack_layers are part of this family's interface: the engine unrolls the
# layers and fuses q/k/v and gate/up with them (EngineConfig.layer_loop, fuse_projections).
from jlight.models.layers import activation, column_projections, fuse_projections, rms_norm, unstack_layers  # noqa: F401
from jlight.models.module import (Layout, ParamMaker, Step, declare, family_functions, layer_group, run_layers, run_layers_tapping,
                                  tapping_forward, value)


class LlamaAttention(nnx.Module):
    """The two norms and the attention of a Llama-family layer; the MoE families' layers add their MLP.

    `kind` is the layer's AttentionKind (models/attention_kinds.py), set by the model once built:
    static for one layer or a stack of alike layers, None for a scanned stack of mixed layers (each
    reads its own from the per-layer kinds). `layer_index` is the layer's index for an unrolled layer (None
    in a stack): in a pool grouped by attention kind it picks the layer's group statically
    (jlight/core/kv_layout.py). `norm_offset` is added to every RMSNorm weight (Gemma's
    norms scale by 1 + w)."""
    norm_offset = 0.0

    def __init__(self, config: ModelConfig, layout: Layout, stack: int | None):
        c = self.config = config
        self.kind = attention_kinds.AttentionKind(c.sliding_window, 0)
        self.layer_index = None
        p = ParamMaker(stack)
        E, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.attn_norm = p((E,), ("embed_norm",))
        declare(self, p.columns(layout, "wqkv", E, {"wq": (q, "heads"), "wk": (kv, "kv_heads"), "wv": (kv, "kv_heads")}))
        if c.attention_bias:
            declare(self, dict(bq=p((q,), ("heads",)), bk=p((kv,), ("kv_heads",)), bv=p((kv,), ("kv_heads",))))
        if c.qk_norm:
            declare(self, dict(q_norm=p((c.head_dim,), ("head_dim",)), k_norm=p((c.head_dim,), ("head_dim",))))
        self.wo = p((q, E), ("heads", "embed"))
        self.mlp_norm = p((E,), ("embed_norm",))

    def attention(self, x, k_cache, v_cache, layer_idx, step: Step):
        """x: [T, embed] (normed) -> ([T, embed], k_cache, v_cache)."""
        c, ops, kernels = self.config, step.ops, step.kernels
        mm = kernels.matmul
        num_tokens = step.md.positions.shape[0]  # all T tokens: x is [T/tp, embed] under sequence parallelism
        q, k, v = column_projections(ops, x, self, ("wq", "wk", "wv"), mm)
        if c.attention_bias:
            q, k, v = (y + value(self, b).astype(y.dtype) for y, b in ((q, "bq"), (k, "bk"), (v, "bv")))
        q = q.reshape(num_tokens, -1, c.head_dim)  # [T, local heads, head_dim]
        k = k.reshape(num_tokens, -1, c.head_dim)
        v = v.reshape(num_tokens, -1, c.head_dim)
        if c.qk_norm:
            q, k = self.norm(q, "q_norm"), self.norm(k, "k_norm")
        window, rope = attention_kinds.resolve(c, self.kind, layer_idx)
        q = attention_kinds.apply_rope_kind(q, step.md, step.rope, rope)
        k = attention_kinds.apply_rope_kind(k, step.md, step.rope, rope)
        slot, md = kv_layout.layer_view(step.md, step.kv_groups, layer_idx, self.layer_index)  # its group's pages
        k_cache, v_cache = kernels.write_kv(k_cache, v_cache, slot, k, v, md.slot_mapping)
        attn = kernels.paged_attention(q, k_cache, v_cache, slot, md, scale=attention_kinds.softmax_scale(c),
                                       sliding_window=window, **self.attention_extras())
        return ops.row_linear(attn.reshape(num_tokens, -1), value(self, "wo"), mm), k_cache, v_cache

    def attention_extras(self) -> dict:
        """The attention kinds' keyword arguments beyond the window: soft-capping (Gemma 2)."""
        cap = attention_kinds.attention_soft_cap(self.config)
        return {} if cap is None else {"soft_cap": cap}

    def norm(self, x, name: str):
        return rms_norm(x, value(self, name), self.config.rms_norm_eps, self.norm_offset)

    def __call__(self, h, k_cache, v_cache, layer_idx, step: Step):
        """The residual stream h [T, embed] through one layer -> (h, k_cache, v_cache)."""
        attn, k_cache, v_cache = self.attention(self.norm(h, "attn_norm"), k_cache, v_cache, layer_idx, step)
        h = h + attn
        return h + self.mlp(self.norm(h, "mlp_norm"), step), k_cache, v_cache


class LlamaLayer(LlamaAttention):
    """A Llama-family layer: attention and the gated MLP (gate, up, down)."""

    def __init__(self, config: ModelConfig, layout: Layout, stack: int | None):
        super().__init__(config, layout, stack)
        p = ParamMaker(stack)
        E, F = config.hidden_size, config.intermediate_size
        declare(self, p.columns(layout, "w_gate_up", E, {"w_gate": (F, "mlp"), "w_up": (F, "mlp")}))
        self.w_down = p((F, E), ("mlp", "embed"))

    def mlp(self, x, step: Step):
        ops, mm = step.ops, step.kernels.matmul
        gate, up = column_projections(ops, x, self, ("w_gate", "w_up"), mm)
        return ops.row_linear(activation(self.config.hidden_act)(gate) * up, value(self, "w_down"), mm)


class Llama(nnx.Module):
    """The decoder: token embedding, the layers, the final norm and the LM head."""
    Layer = LlamaLayer  # the MoE families swap in their layer

    def __init__(self, config: ModelConfig, layout: Layout = Layout()):
        c = self.config = config
        p = ParamMaker()
        self.embed = p((c.vocab_size, c.hidden_size), ("vocab", "embed"))
        self.layers = layer_group(lambda stack: self.Layer(c, layout, stack), c.num_layers, layout)
        kinds = attention_kinds.layer_kinds(c)
        for layer, kind in zip(self.layers, kinds) if layout.unrolled else [(self.layers, attention_kinds.static_kind(kinds))]:
            layer.kind = kind
        self.kv_groups = kv_layout.group_layers(kv_layer_windows(c))
        if layout.unrolled and self.kv_groups.num_groups > 1:  # else the index is unused, and layers alike trace as one
            for i, layer in enumerate(self.layers):
                layer.layer_index = i
        self.final_norm = p((c.hidden_size,), ("embed_norm",))
        self.lm_head = p((c.hidden_size, c.vocab_size), ("embed", "vocab"))  # tied embeddings: a copy of embed.T

    def __call__(self, tokens, k_cache, v_cache, md, kernels, ops, taps: tuple[int, ...] = ()):
        """tokens: [T] int32 -> (hidden [T, embed] after the final norm, k_cache, v_cache); with `taps` (layer
        indices) -> (hidden, the residual stream entering each of those layers concatenated, k_cache, v_cache)."""
        c = self.config
        step = Step(md, kernels, ops, attention_kinds.rope_tables(c), self.kv_groups)
        final_norm = value(self, "final_norm")
        h = self.scale_embedding(ops.embed(value(self, "embed"), tokens).astype(final_norm.dtype))  # [T, embed]
        if taps:
            (h, k_cache, v_cache), tapped = run_layers_tapping(self.layers, (h, k_cache, v_cache), step, taps)
        else:
            h, k_cache, v_cache = run_layers(self.layers, (h, k_cache, v_cache), step)  # scanned or unrolled
        h = rms_norm(h, final_norm, c.rms_norm_eps, self.Layer.norm_offset)
        h = ops.gather_sequence(h)  # whole [T, embed] again if split on tokens
        return (h, tapped, k_cache, v_cache) if taps else (h, k_cache, v_cache)

    def scale_embedding(self, h):
        """The embedded tokens as the first layer reads them (Gemma scales them)."""
        return h

    def logits(self, hidden, kernels, ops):
        """hidden: [N, embed] (already normed) -> float32 logits [N, vocab]."""
        return ops.lm_head(hidden, value(self, "lm_head"), kernels.matmul)


param_shapes, param_axes, init_params, forward, compute_logits = family_functions(Llama)
forward_tapping = tapping_forward(Llama)  # EAGLE-3's target features (engine/proposers/eagle.py)


def kv_layer_windows(config: ModelConfig) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention): the engine groups the KV pool's layers by it
    (jlight/core/kv_layout.py) and frees the pages a window no longer sees (engine/kv_groups.py)."""
    return tuple(k.sliding_window for k in attention_kinds.layer_kinds(config))


def kv_cache_shapes(config: ModelConfig, num_pages: int, page_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of the K and V page pools: [layers, pages, page_size, kv_heads, head_dim] each."""
    shape = (config.num_layers, num_pages, page_size, config.num_kv_heads, config.head_dim)
    return shape, shape
