"""Sparse-MoE decoders with Llama-style attention: Mixtral, Qwen3-MoE and Qwen2-MoE.

Attention is the Llama family's (GQA over the paged K/V cache, optional QKV bias for Qwen2-MoE
and QK-norm for Qwen3-MoE): `MixtralLayer` extends llama.LlamaAttention with a routed mixture of
experts as its MLP:
  * Mixtral: softmax over the experts, top-k, weights renormalised over the k chosen;
  * Qwen3-MoE / Qwen2-MoE: the same, renormalised only if `norm_topk_prob`;
  * Qwen2-MoE adds a shared expert scaled by sigmoid(x . shared_expert_gate).
Expert weights are [experts, in, out] per layer (stacked [layers, experts, in, out]); the routed FFN
runs through `ops.expert_ffn` (models/moe.expert_ffn on one device, expert parallel under a mesh).
The layers run under lax.scan, or unrolled over per-layer weights, as llama.py's.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jlight.core.config import ModelConfig
from jlight.core.errors import UnsupportedModelError
from jlight.models import llama
# fuse_projections and unstack_layers: as in llama.py (q/k/v and the shared expert's gate/up).
from jlight.models.layers import activation, column_projections, fuse_projections, unstack_layers  # noqa: F401
from jlight.models.moe import expert_ffn, softmax_topk
from jlight.models.module import Layout, ParamMaker, Step, declare, family_functions, value

kv_cache_shapes = llama.kv_cache_shapes
kv_layer_windows = llama.kv_layer_windows


def moe_settings(config: ModelConfig) -> dict:
    """The MoE hyper-parameters, with the HF defaults of each architecture."""
    x = config.extra
    model_type = x.get("model_type", "mixtral")
    num_experts = x.get("num_local_experts") or x.get("num_experts") or 8
    if model_type == "mixtral":
        expert_size, normalize, shared_size = config.intermediate_size, True, 0
    else:
        expert_size = x.get("moe_intermediate_size") or config.intermediate_size
        normalize = bool(x.get("norm_topk_prob", model_type == "qwen3_moe"))
        shared_size = x.get("shared_expert_intermediate_size", 0) if model_type == "qwen2_moe" else 0
        if x.get("mlp_only_layers") or x.get("decoder_sparse_step", 1) != 1:
            raise UnsupportedModelError(
                f"{config.architecture} with dense layers (mlp_only_layers={x.get('mlp_only_layers')}, "
                f"decoder_sparse_step={x.get('decoder_sparse_step')}) is not supported; jlight runs models "
                "whose every layer is sparse (decoder_sparse_step=1, mlp_only_layers=[])"
            )
    top_k = x.get("num_experts_per_tok") or 2
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and the number of experts ({num_experts})")
    return dict(num_experts=num_experts, top_k=top_k, expert_size=expert_size, normalize=normalize, shared_size=shared_size)


class MixtralLayer(llama.LlamaAttention):
    """Llama attention and the routed experts (+ the gated shared expert of Qwen2-MoE)."""

    def __init__(self, config: ModelConfig, layout: Layout, stack: int | None):
        super().__init__(config, layout, stack)
        s = moe_settings(config)
        p = ParamMaker(stack)
        E, X, F = config.hidden_size, s["num_experts"], s["expert_size"]
        self.router = p((E, X), ("embed", "router"))  # small; kept whole on every device
        self.experts_gate = p((X, E, F), ("experts", "embed", "mlp"))
        self.experts_up = p((X, E, F), ("experts", "embed", "mlp"))
        self.experts_down = p((X, F, E), ("experts", "mlp", "embed"))
        if s["shared_size"]:
            S = s["shared_size"]
            declare(self, p.columns(layout, "shared_gate_up", E, {"shared_gate": (S, "mlp"), "shared_up": (S, "mlp")}))
            self.shared_down = p((S, E), ("mlp", "embed"))
            self.shared_expert_gate = p((E, 1), ("embed", "router"))

    def mlp(self, x, step: Step):
        """Routed experts (+ the gated shared expert of Qwen2-MoE). x: [T, embed] -> [T, embed]."""
        c, ops, kernels = self.config, step.ops, step.kernels
        s = moe_settings(c)
        act = activation(c.hidden_act)
        # Router in float32: near-ties between experts must break the same way as in the reference.
        logits = jnp.dot(x.astype(jnp.float32), value(self, "router").astype(jnp.float32))  # [T, num_experts]
        ids, weights = softmax_topk(logits, s["top_k"], s["normalize"])
        local_ffn = functools.partial(expert_ffn, act=act, impl=kernels.moe_impl, grouped=kernels.grouped_matmul)
        out = ops.expert_ffn(local_ffn, x, ids, weights, *(value(self, n) for n in ("experts_gate", "experts_up", "experts_down")),
                             num_tokens=step.md.query_start[-1])
        if s["shared_size"]:
            mm = kernels.matmul
            gate, up = column_projections(ops, x, self, ("shared_gate", "shared_up"), mm)
            shared = ops.row_linear(act(gate) * up, value(self, "shared_down"), mm)
            shared_scale = jax.nn.sigmoid(jnp.dot(x.astype(jnp.float32), value(self, "shared_expert_gate").astype(jnp.float32)))  # [T, 1]
            out = out + (shared.astype(jnp.float32) * shared_scale).astype(out.dtype)
        return out


class Mixtral(llama.Llama):
    """Llama's decoder over MixtralLayers."""
    Layer = MixtralLayer


param_shapes, param_axes, init_params, forward, compute_logits = family_functions(Mixtral)
