"""IBM Granite-4.0-H (GraniteMoeHybrid): Mamba-2 layers interleaved with attention layers, each
followed by a shared MLP and, when the config has experts, a routed MoE beside it.

Layer i is a Mamba-2 mixer ("linear_attention"/"mamba" in the config's layer types) or GQA attention
("full_attention"/"attention"; RoPE only if position_embedding_type is "rope", scale
attention_multiplier), then `h + residual_multiplier * mixer(norm(h))` and the same for the MLP.
The embedding is scaled by embedding_multiplier, the logits divided by logits_scaling.

The Mamba-2 mixer and the attention are models/mamba2.py's. The caches: the Mamba layers' "conv" and
"ssm" pools, the attention layers' paged K/V.
The params tree: "mamba_layers" and "attn_layers" groups (models/hybrid.py).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jlight.core.config import ModelConfig
from jlight.core.errors import UnsupportedModelError
from jlight.models.hybrid import HybridDecoder, hybrid_functions
from jlight.models.layers import activation, rms_norm, unstack_layers  # noqa: F401  (unstack_layers: the engine's)
from jlight.models.mamba2 import AttentionMixer, MambaMixer, mamba_state_shapes
from jlight.models.module import ParamMaker, Step, value
from jlight.models.moe import expert_ffn, softmax_topk


def layer_kinds(config: ModelConfig) -> list[str]:
    """"mamba" or "attention" for each layer, from layer_types (or the older layers_block_type)."""
    x = config.extra
    kinds = x.get("layer_types") or x.get("layers_block_type") or ["mamba"] * config.num_layers
    names = {"linear_attention": "mamba", "mamba": "mamba", "full_attention": "attention", "attention": "attention"}
    bad = sorted(set(kinds) - names.keys())
    if bad or len(kinds) != config.num_layers:
        raise UnsupportedModelError(f"layer_types {bad or kinds} of {config.architecture} are not supported: each of the "
                                    f"{config.num_layers} layers must be one of {', '.join(names)}")
    return [names[k] for k in kinds]


class Block(nnx.Module):
    """The two norms and the MLP side of a layer: the shared MLP, plus the routed experts if any."""

    def __init__(self, config: ModelConfig, stack: int | None):
        c = self.config = config
        p = ParamMaker(stack)
        E, x = c.hidden_size, c.extra
        F = x.get("shared_intermediate_size", 1024)
        self.attn_norm = p((E,), ("embed_norm",))
        self.mlp_norm = p((E,), ("embed_norm",))
        self.shared_gate = p((E, F), ("embed", "mlp"))  # the checkpoint's input_linear [gate | up], split at load
        self.shared_up = p((E, F), ("embed", "mlp"))
        self.shared_down = p((F, E), ("mlp", "embed"))
        X = x.get("num_local_experts") or 0
        if X:
            I = c.intermediate_size
            self.router = p((E, X), ("embed", "router"))
            self.experts_gate = p((X, E, I), ("experts", "embed", "mlp"))
            self.experts_up = p((X, E, I), ("experts", "embed", "mlp"))
            self.experts_down = p((X, I, E), ("experts", "mlp", "embed"))

    def mlp(self, x, step: Step):
        c, ops, kernels = self.config, step.ops, step.kernels
        mm, act = kernels.matmul, activation(c.hidden_act)
        gate, up = (ops.column_linear(x, value(self, n), mm) for n in ("shared_gate", "shared_up"))
        out = ops.row_linear(act(gate) * up, value(self, "shared_down"), mm)
        if hasattr(self, "router"):
            logits = jnp.dot(x.astype(jnp.float32), value(self, "router").astype(jnp.float32))  # [T, experts]
            ids, weights = softmax_topk(logits, c.extra.get("num_experts_per_tok") or 2, True)  # = softmax over the top-k logits
            local_ffn = functools.partial(expert_ffn, act=act, impl=kernels.moe_impl, grouped=kernels.grouped_matmul)
            experts = (value(self, n) for n in ("experts_gate", "experts_up", "experts_down"))
            out = out + ops.expert_ffn(local_ffn, x, ids, weights, *experts, num_tokens=step.md.query_start[-1])
        return out

    def __call__(self, h, caches, index: int, step: Step):
        """h [T, embed] through the mixer (self.mix) and the MLP, each a scaled residual."""
        c = self.config
        scale = c.extra.get("residual_multiplier", 1.0)
        out, caches = self.mix(rms_norm(h, value(self, "attn_norm"), c.rms_norm_eps), caches, index, step)
        h = h + out * scale
        return h + self.mlp(rms_norm(h, value(self, "mlp_norm"), c.rms_norm_eps), step) * scale, caches


class MambaLayer(MambaMixer, Block):
    def __init__(self, config: ModelConfig, stack: int | None):
        super().__init__(config, stack)
        self.declare_mamba(config, stack)


class AttentionLayer(AttentionMixer, Block):
    def __init__(self, config: ModelConfig, stack: int | None):
        super().__init__(config, stack)
        self.declare_attention(config, stack)

    @property
    def uses_rope(self) -> bool:
        return self.config.extra.get("position_embedding_type") == "rope"

    def attention_scale(self) -> float:
        return self.config.extra.get("attention_multiplier", 1.0)


class GraniteHybrid(HybridDecoder):
    KINDS = {"mamba": ("mamba_layers", MambaLayer), "attention": ("attn_layers", AttentionLayer)}
    layer_kinds = staticmethod(layer_kinds)

    def embed_scale(self) -> float:
        return self.config.extra.get("embedding_multiplier", 1.0)

    def logits_scale(self) -> float:
        return 1.0 / self.config.extra.get("logits_scaling", 1.0)


param_shapes, param_axes, init_params, forward, compute_logits, kv_cache_shapes = hybrid_functions(GraniteHybrid)


def state_shapes(config: ModelConfig, num_slots: int) -> dict:
    """The Mamba layers' state pools (models/mamba2.py)."""
    return mamba_state_shapes(config, layer_kinds(config).count("mamba"), num_slots)
