"""gpt-oss: Llama-shaped attention with sinks and alternating windows, and a biased MoE.

  * attention: q/k/v/o projections with biases; each head has a learned sink logit (`sinks`, an
    extra softmax column that takes probability mass and adds no value: the attention kernels'
    `sinks` argument); layers alternate a 128-token sliding window and full attention
    (`layer_types`, models/attention_kinds.py); YaRN RoPE.
  * MoE: router logits x . router + router_bias, top-k of the logits, softmax over the k chosen;
    each expert computes (clamp(up, -l, l) + 1) * g * sigmoid(alpha * g), g = min(gate, l)
    (swiglu_limit l = 7, swiglu_alpha 1.702), then down, all with biases. The gate and up weights go to
    models/moe.expert_ffn with their biases as BiasedExperts, so they keep the [experts, embed, mlp] shapes
    the Pallas grouped matmul's tiles take, and tensor and expert parallelism split the biases with them. The
    down bias is added after the experts' output is summed over devices, weighted like its expert's output.
MXFP4 checkpoints' experts are expanded at load (jlight/loading/mxfp4.py) to the load dtype, or kept as stored.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jlight.core.config import ModelConfig
from jlight.models import llama
# fuse_projections and unstack_layers: as in llama.py (q/k/v).
from jlight.models.layers import fuse_projections, unstack_layers  # noqa: F401
from jlight.models.moe import BiasedExperts, GatedUnit, expert_ffn
from jlight.models.module import Layout, ParamMaker, Step, family_functions, value

kv_cache_shapes = llama.kv_cache_shapes
kv_layer_windows = llama.kv_layer_windows


def moe_settings(config: ModelConfig) -> dict:
    x = config.extra
    num_experts, top_k = x.get("num_local_experts") or 32, x.get("num_experts_per_tok") or 4
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and num_local_experts ({num_experts})")
    return dict(num_experts=num_experts, top_k=top_k, limit=float(x.get("swiglu_limit", 7.0)),
                alpha=float(x.get("swiglu_alpha", 1.702)))


def clamped_swiglu(gate, up, *, limit: float, alpha: float):
    gate = jnp.minimum(gate, limit)
    return (jnp.clip(up, -limit, limit) + 1) * gate * jax.nn.sigmoid(gate * alpha)


class GptOssLayer(llama.LlamaAttention):
    """Attention with sinks and an output bias, then the routed experts."""

    def __init__(self, config: ModelConfig, layout: Layout, stack: int | None):
        super().__init__(config, layout, stack)
        s = moe_settings(config)
        p = ParamMaker(stack)
        E, X, F = config.hidden_size, s["num_experts"], config.intermediate_size
        self.bo = p((E,), ("embed",))
        self.sinks = p((config.num_heads,), ("heads",))  # one logit per query head, split with the heads
        self.router = p((E, X), ("embed", "router"))
        self.router_bias = p((X,), ("router",))
        self.experts_gate = p((X, E, F), ("experts", "embed", "mlp"))
        self.experts_gate_bias = p((X, F), ("experts", "mlp"))
        self.experts_up = p((X, E, F), ("experts", "embed", "mlp"))
        self.experts_up_bias = p((X, F), ("experts", "mlp"))
        self.experts_down = p((X, F, E), ("experts", "mlp", "embed"))
        self.experts_down_bias = p((X, E), ("router", "embed"))  # kept whole: added once, after the experts' sum

    def attention_extras(self) -> dict:
        return {"sinks": value(self, "sinks")}

    def attention(self, x, k_cache, v_cache, layer_idx, step: Step):
        out, k_cache, v_cache = super().attention(x, k_cache, v_cache, layer_idx, step)
        return out + value(self, "bo").astype(out.dtype), k_cache, v_cache

    def mlp(self, x, step: Step):
        """x: [T, embed] -> [T, embed]."""
        s, kernels = moe_settings(self.config), step.kernels
        x32 = x.astype(jnp.float32)
        logits = x32 @ value(self, "router").astype(jnp.float32) + value(self, "router_bias").astype(jnp.float32)
        top, ids = jax.lax.top_k(logits, s["top_k"])  # [T, k]
        weights = jax.nn.softmax(top, axis=-1)
        act = GatedUnit(functools.partial(clamped_swiglu, limit=s["limit"], alpha=s["alpha"]))
        local_ffn = functools.partial(expert_ffn, act=act, impl=kernels.moe_impl, grouped=kernels.grouped_matmul)
        gate, up = (BiasedExperts(value(self, f"experts_{n}"), value(self, f"experts_{n}_bias")) for n in ("gate", "up"))
        out = step.ops.expert_ffn(local_ffn, x, ids.astype(jnp.int32), weights, gate, up, value(self, "experts_down"),
                                  num_tokens=step.md.query_start[-1])
        down_bias = jnp.einsum("tk,tke->te", weights, value(self, "experts_down_bias")[ids].astype(jnp.float32))
        return (out.astype(jnp.float32) + down_bias).astype(x.dtype)


class GptOss(llama.Llama):
    """Llama's decoder over GptOssLayers."""
    Layer = GptOssLayer


param_shapes, param_axes, init_params, forward, compute_logits = family_functions(GptOss)
