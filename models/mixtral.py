"""Sparse-MoE decoders with Llama-style attention: Mixtral, Qwen3-MoE and Qwen2-MoE.

Attention is the Llama family's (GQA over the paged K/V cache, optional QKV bias for Qwen2-MoE
and QK-norm for Qwen3-MoE). The MLP of every layer is a routed mixture of experts:
  * Mixtral: softmax over the experts, top-k, weights renormalised over the k chosen;
  * Qwen3-MoE / Qwen2-MoE: the same, renormalised only if `norm_topk_prob`;
  * Qwen2-MoE adds a shared expert scaled by sigmoid(x . shared_expert_gate).
Expert weights are stacked [layers, experts, in, out]; the routed FFN runs through
`ops.expert_ffn` (models/moe.expert_ffn on one device, expert parallel under a mesh). The layers
run under lax.scan, or unrolled over per-layer weights after `unstack_layers` (as llama.py).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jlight.core.parallel_ops import ParallelOps
from jlight.core.batch_metadata import BatchMetadata
from jlight.core.config import ModelConfig
from jlight.core.errors import UnsupportedModelError
from jlight.models import llama
from jlight.models.moe import expert_ffn, softmax_topk
from jlight.models.rope import inv_frequencies
# fuse_projections: as in llama.py (q/k/v and the shared expert's gate/up).
from jlight.models.layers import activation, column_projections, fuse_projections, rms_norm, run_layers  # noqa: F401

kv_cache_shapes = llama.kv_cache_shapes
compute_logits = llama.compute_logits


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


def _attention_axes(config):
    return {k: v for k, v in llama.param_axes(config)["layers"].items() if k not in ("w_gate", "w_up", "w_down")}


def _attention_shapes(config):
    return {k: v for k, v in llama.param_shapes(config)["layers"].items() if k not in ("w_gate", "w_up", "w_down")}


def param_axes(config: ModelConfig) -> dict:
    axes = llama.param_axes(config)
    layers = _attention_axes(config)
    layers.update(
        router=("layers", "embed", "router"),  # small; kept whole on every device
        experts_gate=("layers", "experts", "embed", "mlp"),
        experts_up=("layers", "experts", "embed", "mlp"),
        experts_down=("layers", "experts", "mlp", "embed"),
    )
    if moe_settings(config)["shared_size"]:
        layers.update(
            shared_gate=("layers", "embed", "mlp"), shared_up=("layers", "embed", "mlp"),
            shared_down=("layers", "mlp", "embed"), shared_expert_gate=("layers", "embed", "router"),
        )
    axes["layers"] = layers
    return axes


def param_shapes(config: ModelConfig) -> dict:
    s = moe_settings(config)
    L, E, X, F = config.num_layers, config.hidden_size, s["num_experts"], s["expert_size"]
    shapes = llama.param_shapes(config)
    layers = _attention_shapes(config)
    layers.update(router=(L, E, X), experts_gate=(L, X, E, F), experts_up=(L, X, E, F), experts_down=(L, X, F, E))
    if s["shared_size"]:
        S = s["shared_size"]
        layers.update(shared_gate=(L, E, S), shared_up=(L, E, S), shared_down=(L, S, E), shared_expert_gate=(L, E, 1))
    shapes["layers"] = layers
    return shapes


def sparse_mlp(c: ModelConfig, s: dict, lp, x, kernels, ops: ParallelOps):
    """Routed experts (+ the gated shared expert of Qwen2-MoE). x: [T, embed] -> [T, embed]."""
    act = activation(c.hidden_act)
    # Router in float32: near-ties between experts must break the same way as in the reference.
    logits = jnp.dot(x.astype(jnp.float32), lp["router"].astype(jnp.float32))  # [T, num_experts]
    ids, weights = softmax_topk(logits, s["top_k"], s["normalize"])
    local_ffn = functools.partial(expert_ffn, act=act, impl=kernels.moe_impl,
                                  grouped=kernels.grouped_matmul)
    out = ops.expert_ffn(local_ffn, x, ids, weights, lp["experts_gate"], lp["experts_up"], lp["experts_down"])
    if s["shared_size"]:
        mm = kernels.matmul
        gate, up = column_projections(ops, x, lp, ("shared_gate", "shared_up"), mm)
        shared = ops.row_linear(act(gate) * up, lp["shared_down"], mm)
        shared_scale = jax.nn.sigmoid(jnp.dot(x.astype(jnp.float32), lp["shared_expert_gate"].astype(jnp.float32)))  # [T, 1]
        out = out + (shared.astype(jnp.float32) * shared_scale).astype(out.dtype)
    return out


def forward(params: dict, config: ModelConfig, tokens, k_cache, v_cache, md: BatchMetadata, kernels, ops: ParallelOps):
    """tokens: [T] int32 -> (hidden [T, embed] after the final norm, k_cache, v_cache)."""
    c = config
    s = moe_settings(c)
    inv_freq, rope_factor = inv_frequencies(c.head_dim, c.rope_theta, c.rope_scaling)

    def layer(carry, xs):
        h, k_cache, v_cache = carry
        lp, layer_idx = xs
        attn, k_cache, v_cache = llama.attention(
            c, lp, rms_norm(h, lp["attn_norm"], c.rms_norm_eps), k_cache, v_cache, layer_idx, md, kernels, ops, inv_freq, rope_factor)
        h = h + attn
        h = h + sparse_mlp(c, s, lp, rms_norm(h, lp["mlp_norm"], c.rms_norm_eps), kernels, ops)
        return (h, k_cache, v_cache), None

    h = ops.embed(params["embed"], tokens).astype(params["final_norm"].dtype)  # [T, embed]
    h, k_cache, v_cache = run_layers(layer, (h, k_cache, v_cache), params["layers"])  # scanned or unrolled
    h = rms_norm(h, params["final_norm"], c.rms_norm_eps)
    h = ops.gather_sequence(h)
    return h, k_cache, v_cache


# Per-layer weights for the unrolled forward: one "layers" stack, as in llama.py.
unstack_layers = llama.unstack_layers


def init_params(config: ModelConfig, key: jax.Array, dtype=jnp.bfloat16) -> dict:
    """Random weights of this family's shapes (for benchmarks; no checkpoint needed)."""
    return llama.random_params(param_shapes(config), key, dtype)
