"""NVIDIA Nemotron-H and Nemotron-3 (NemotronHForCausalLM): a stack of single-mixer layers, each
Mamba-2, attention, an MLP or an MoE, in the order the config's layer types (or
hybrid_override_pattern: M, *, -, E) give.

A layer is `h + mixer(norm(h))`. Mamba-2 and attention are models/mamba2.py's (attention without RoPE,
scale head_dim ** -0.5; dt clamped below at time_step_min); the MLP is up_proj, relu2 (mlp_hidden_act),
down_proj. The MoE: DeepSeek-V3's router (sigmoid scores, the correction bias choosing, group-limited,
routed_scaling_factor; models/moe.deepseek_v3_topk), ungated relu2 experts, optionally between a latent
down- and up-projection (moe_latent_size), plus the shared MLP on the layer's input. The ungated experts
run through the gated expert FFN (models/moe.expert_ffn, so every MoE implementation and expert
parallelism serve them) as relu(x W_up) * (x W_up), which is relu2(x W_up) exactly.
The final norm is norm_f. The params tree: "mamba_layers", "attn_layers", "mlp_layers", "moe_layers".
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
from jlight.models.moe import deepseek_v3_topk, expert_ffn

_KINDS = {"linear_attention": "mamba", "mamba": "mamba", "M": "mamba", "full_attention": "attention",
          "attention": "attention", "*": "attention", "mlp": "mlp", "-": "mlp", "moe": "moe", "E": "moe"}


def layer_kinds(config: ModelConfig) -> list[str]:
    x = config.extra
    types = x.get("layer_types") or x.get("layers_block_type") or list(x.get("hybrid_override_pattern") or "")
    bad = sorted(set(types) - _KINDS.keys())
    if bad or len(types) != config.num_layers:
        raise UnsupportedModelError(
            f"layer types {bad or types} of {config.architecture} are not supported: each of the {config.num_layers} "
            "layers must be Mamba-2 (M), attention (*), an MLP (-) or an MoE (E)")
    return [_KINDS[t] for t in types]


class Block(nnx.Module):
    """A layer's norm; the mixer (self.mix) adds its output to the residual stream."""

    def __init__(self, config: ModelConfig, stack: int | None):
        self.config = config
        self.norm = ParamMaker(stack)((config.hidden_size,), ("embed_norm",))

    def __call__(self, h, caches, index: int, step: Step):
        out, caches = self.mix(rms_norm(h, value(self, "norm"), self.config.rms_norm_eps), caches, index, step)
        return h + out, caches


class MambaLayer(MambaMixer, Block):
    def __init__(self, config: ModelConfig, stack: int | None):
        super().__init__(config, stack)
        self.declare_mamba(config, stack)


class AttentionLayer(AttentionMixer, Block):
    uses_rope = False

    def __init__(self, config: ModelConfig, stack: int | None):
        super().__init__(config, stack)
        self.declare_attention(config, stack)


class MlpLayer(Block):
    def __init__(self, config: ModelConfig, stack: int | None):
        super().__init__(config, stack)
        p, E, F = ParamMaker(stack), config.hidden_size, config.intermediate_size
        self.up_proj = p((E, F), ("embed", "mlp"))
        self.down_proj = p((F, E), ("mlp", "embed"))
        if config.extra.get("mlp_bias"):
            self.up_bias = p((F,), ("mlp",))
            self.down_bias = p((E,), ("embed_norm",))

    def mix(self, x, caches, index: int, step: Step):
        ops, mm = step.ops, step.kernels.matmul
        up = ops.column_linear(x, value(self, "up_proj"), mm)
        if hasattr(self, "up_bias"):
            up = up + value(self, "up_bias").astype(up.dtype)
        out = ops.row_linear(activation(self.config.extra.get("mlp_hidden_act", "relu2"))(up), value(self, "down_proj"), mm)
        if hasattr(self, "down_bias"):
            out = out + value(self, "down_bias").astype(out.dtype)
        return out, caches


class MoeLayer(Block):
    def __init__(self, config: ModelConfig, stack: int | None):
        super().__init__(config, stack)
        c, x, p, E = config, config.extra, ParamMaker(stack), config.hidden_size
        if x.get("mlp_hidden_act", "relu2") != "relu2":
            raise UnsupportedModelError(f"mlp_hidden_act={x.get('mlp_hidden_act')!r} in {c.architecture}'s MoE layers is not "
                                        "supported; jlight runs its experts as relu2")
        X, I, S = x.get("n_routed_experts", 8), x.get("moe_intermediate_size", 7688), x.get("moe_shared_expert_intermediate_size", 7688)
        latent = x.get("moe_latent_size")
        inner = latent or E
        self.router = p((E, X), ("embed", "router"))
        self.router_bias = p((X,), ("router",))
        self.experts_up = p((X, inner, I), ("experts", "embed", "mlp"))
        self.experts_down = p((X, I, inner), ("experts", "mlp", "embed"))
        self.shared_up = p((E, S), ("embed", "mlp"))
        self.shared_down = p((S, E), ("mlp", "embed"))
        if latent:
            self.latent_in = p((E, latent), ("embed", None))
            self.latent_out = p((latent, E), (None, "embed"))

    def mix(self, x, caches, index: int, step: Step):
        c, ops, kernels = self.config, step.ops, step.kernels
        xs, mm = c.extra, kernels.matmul
        logits = jnp.dot(x.astype(jnp.float32), value(self, "router").astype(jnp.float32))  # [T, experts]
        ids, weights = deepseek_v3_topk(logits, value(self, "router_bias"), xs.get("num_experts_per_tok", 2),
                                        num_groups=xs.get("n_group", 1), topk_group=xs.get("topk_group", 1),
                                        normalize=bool(xs.get("norm_topk_prob", True)),
                                        scaling=xs.get("routed_scaling_factor", 1.0))
        h = mm(x, value(self, "latent_in")) if hasattr(self, "latent_in") else x
        local_ffn = functools.partial(expert_ffn, act=jax.nn.relu, impl=kernels.moe_impl, grouped=kernels.grouped_matmul)
        up = value(self, "experts_up")
        routed = ops.expert_ffn(local_ffn, h, ids, weights, up, up, value(self, "experts_down"),  # relu(h W) * (h W)
                                num_tokens=step.md.query_start[-1])
        if hasattr(self, "latent_out"):
            routed = mm(routed, value(self, "latent_out"))
        shared = ops.row_linear(activation("relu2")(ops.column_linear(x, value(self, "shared_up"), mm)),
                                value(self, "shared_down"), mm)
        return routed + shared, caches


class NemotronH(HybridDecoder):
    KINDS = {"mamba": ("mamba_layers", MambaLayer), "attention": ("attn_layers", AttentionLayer),
             "mlp": ("mlp_layers", MlpLayer), "moe": ("moe_layers", MoeLayer)}
    layer_kinds = staticmethod(layer_kinds)


param_shapes, param_axes, init_params, forward, compute_logits, kv_cache_shapes = hybrid_functions(NemotronH)


def state_shapes(config: ModelConfig, num_slots: int) -> dict:
    """The Mamba layers' state pools (models/mamba2.py)."""
    return mamba_state_shapes(config, layer_kinds(config).count("mamba"), num_slots)
