"""Qwen3-Next and Qwen3.5 (its text models, dense and MoE): gated DeltaNet layers (three of every four)
and gated-output attention layers, each followed by a sparse MoE with a gated shared expert (or a
dense MLP when the config has no experts).

Norms are Qwen3-Next's RMSNorm: x * rsqrt(mean x^2 + eps) * (1 + w), in float32.
The gated DeltaNet mixer: in_proj_qkvz (per key head: q, k, its value heads' v and z) and in_proj_ba
(per key head: its value heads' b and a), or Qwen3.5's in_proj_qkv ([q | k | v]), in_proj_z,
in_proj_b and in_proj_a; the causal conv1d over [q | k | v] with its rolling state
(Kernels.causal_conv1d), silu; q and k L2-normalised, repeated to the value heads; beta = sigmoid(b),
g = -exp(A_log) softplus(a + dt_bias); the gated delta rule from the row's state slot
(Kernels.delta_rule); per value head an RMSNorm (w, not 1 + w) times silu(z); out_proj.
The attention: q_proj gives per head the query and an output gate; q and k normed over head_dim;
RoPE over the first partial_rotary_factor of head_dim (Qwen3.5's multimodal RoPE is that for text, all
three position ids equal); the output times sigmoid(gate), then o_proj.
The pools: "conv" [delta layers, slots, K-1, conv_dim] and "delta" [delta layers, slots, value heads,
k_dim, v_dim] (float32); the attention layers' paged K/V. Params tree groups: "delta_layers",
"attn_layers" (models/hybrid.py).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jlight.core.config import ModelConfig
from jlight.core.errors import UnsupportedModelError
from jlight.models.hybrid import HybridDecoder, attention_params, hybrid_functions
from jlight.models.layers import activation, rms_norm, unstack_layers  # noqa: F401  (unstack_layers: the engine's)
from jlight.models.module import ParamMaker, Step, declare, value
from jlight.models.moe import expert_ffn, softmax_topk
from jlight.models.rope import apply_rope, inv_frequencies


def layer_kinds(config: ModelConfig) -> list[str]:
    """"delta" or "attention" for each layer: layer_types, else every full_attention_interval-th is attention."""
    x = config.extra
    every = x.get("full_attention_interval", 4)
    types = x.get("layer_types") or ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                                     for i in range(config.num_layers)]
    names = {"linear_attention": "delta", "full_attention": "attention"}
    bad = sorted(set(types) - names.keys())
    if bad or len(types) != config.num_layers:
        raise UnsupportedModelError(f"layer_types {bad or types} of {config.architecture} are not supported: each of the "
                                    f"{config.num_layers} layers must be one of {', '.join(names)}")
    if x.get("mlp_only_layers") or x.get("decoder_sparse_step", 1) != 1:
        raise UnsupportedModelError(f"{config.architecture} with dense layers among sparse ones (mlp_only_layers="
                                    f"{x.get('mlp_only_layers')}, decoder_sparse_step={x.get('decoder_sparse_step')}) is "
                                    "not supported; jlight runs models whose layers are all sparse or all dense")
    return [names[t] for t in types]


def delta_dims(config: ModelConfig) -> dict:
    x = config.extra
    nk, nv = x.get("linear_num_key_heads", 16), x.get("linear_num_value_heads", 32)
    hk, hv = x.get("linear_key_head_dim", 128), x.get("linear_value_head_dim", 128)
    return dict(nk=nk, nv=nv, hk=hk, hv=hv, kernel=x.get("linear_conv_kernel_dim", 4), conv_dim=2 * nk * hk + nv * hv)


def separate_projections(config: ModelConfig) -> bool:
    """Qwen3.5's DeltaNet projections (qkv, z, b, a apart) rather than Qwen3-Next's grouped qkvz and ba."""
    return config.extra.get("model_type", "").startswith("qwen3_5")


def rotary_dim(config: ModelConfig) -> int:
    x = config.extra
    factor = x.get("partial_rotary_factor", 1.0)
    return int(config.head_dim * factor)


def norm1p(x, w, eps):
    """Qwen3-Next's RMSNorm, scaled by 1 + w."""
    return rms_norm(x, 1.0 + w.astype(jnp.float32), eps)


class Block(nnx.Module):
    """The two norms and the MLP side: routed experts with a gated shared expert, or a dense MLP."""

    def __init__(self, config: ModelConfig, stack: int | None):
        c = self.config = config
        p, x, E = ParamMaker(stack), config.extra, config.hidden_size
        self.attn_norm = p((E,), ("embed_norm",))
        self.mlp_norm = p((E,), ("embed_norm",))
        X = x.get("num_experts") or 0
        if X:
            I, S = x.get("moe_intermediate_size", 512), x.get("shared_expert_intermediate_size", 512)
            self.router = p((E, X), ("embed", "router"))
            self.experts_gate = p((X, E, I), ("experts", "embed", "mlp"))
            self.experts_up = p((X, E, I), ("experts", "embed", "mlp"))
            self.experts_down = p((X, I, E), ("experts", "mlp", "embed"))
            declare(self, dict(shared_gate=p((E, S), ("embed", "mlp")), shared_up=p((E, S), ("embed", "mlp")),
                               shared_down=p((S, E), ("mlp", "embed")), shared_expert_gate=p((E, 1), ("embed", "router"))))
        else:
            F = c.intermediate_size
            declare(self, dict(w_gate=p((E, F), ("embed", "mlp")), w_up=p((E, F), ("embed", "mlp")),
                               w_down=p((F, E), ("mlp", "embed"))))

    def _gated_mlp(self, x, step: Step, names):
        ops, mm, act = step.ops, step.kernels.matmul, activation(self.config.hidden_act)
        gate, up = (ops.column_linear(x, value(self, n), mm) for n in names[:2])
        return ops.row_linear(act(gate) * up, value(self, names[2]), mm)

    def mlp(self, x, step: Step):
        c, ops, kernels = self.config, step.ops, step.kernels
        if not hasattr(self, "router"):
            return self._gated_mlp(x, step, ("w_gate", "w_up", "w_down"))
        x32 = x.astype(jnp.float32)
        logits = jnp.dot(x32, value(self, "router").astype(jnp.float32))  # [T, experts]
        ids, weights = softmax_topk(logits, c.extra.get("num_experts_per_tok") or 10, bool(c.extra.get("norm_topk_prob", True)))
        local_ffn = functools.partial(expert_ffn, act=activation(c.hidden_act), impl=kernels.moe_impl,
                                      grouped=kernels.grouped_matmul)
        out = ops.expert_ffn(local_ffn, x, ids, weights, *(value(self, n) for n in ("experts_gate", "experts_up", "experts_down")),
                             num_tokens=step.md.query_start[-1])
        shared = self._gated_mlp(x, step, ("shared_gate", "shared_up", "shared_down"))
        scale = jax.nn.sigmoid(jnp.dot(x32, value(self, "shared_expert_gate").astype(jnp.float32)))  # [T, 1]
        return out + (shared.astype(jnp.float32) * scale).astype(out.dtype)

    def __call__(self, h, caches, index: int, step: Step):
        eps = self.config.rms_norm_eps
        out, caches = self.mix(norm1p(h, value(self, "attn_norm"), eps), caches, index, step)
        h = h + out
        return h + self.mlp(norm1p(h, value(self, "mlp_norm"), eps), step), caches


class DeltaLayer(Block):
    def __init__(self, config: ModelConfig, stack: int | None):
        super().__init__(config, stack)
        p, d, E = ParamMaker(stack), delta_dims(config), config.hidden_size
        if separate_projections(config):
            declare(self, dict(in_proj_qkv=p((E, d["conv_dim"]), ("embed", None)),
                               in_proj_z=p((E, d["nv"] * d["hv"]), ("embed", None)),
                               in_proj_b=p((E, d["nv"]), ("embed", None)), in_proj_a=p((E, d["nv"]), ("embed", None))))
        else:
            self.in_proj_qkvz = p((E, 2 * d["nk"] * d["hk"] + 2 * d["nv"] * d["hv"]), ("embed", None))
            self.in_proj_ba = p((E, 2 * d["nv"]), ("embed", None))
        self.conv_weight = p((d["kernel"], d["conv_dim"]), (None, None))  # tap K-1 reads the current token
        self.dt_bias = p((d["nv"],), (None,))
        self.A_log = p((d["nv"],), (None,))
        self.gate_norm = p((d["hv"],), (None,))
        self.out_proj = p((d["nv"] * d["hv"], E), (None, "embed"))

    def mix(self, x, caches, index: int, step: Step):
        c, kernels, md = self.config, step.kernels, step.md
        d, mm, T = delta_dims(c), kernels.matmul, x.shape[0]
        nk, nv, hk, hv = d["nk"], d["nv"], d["hk"], d["hv"]
        r = nv // nk
        if hasattr(self, "in_proj_qkv"):
            mixed = mm(x, value(self, "in_proj_qkv"))  # [T, conv_dim]: q | k | v
            z, b, a = (mm(x, value(self, n)) for n in ("in_proj_z", "in_proj_b", "in_proj_a"))
        else:
            qkvz = mm(x, value(self, "in_proj_qkvz")).reshape(T, nk, 2 * hk + 2 * r * hv)
            q, k, v, z = jnp.split(qkvz, [hk, 2 * hk, 2 * hk + r * hv], axis=-1)
            b, a = jnp.split(mm(x, value(self, "in_proj_ba")).reshape(T, nk, 2 * r), 2, axis=-1)
            mixed = jnp.concatenate([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], axis=-1)  # [T, conv_dim]
        k_pages, v_pages, state = caches
        mixed, conv = kernels.causal_conv1d(mixed, value(self, "conv_weight"), None, state["conv"], index, md.state_slots, md)
        mixed = activation(c.hidden_act)(mixed)
        q, k, v = jnp.split(mixed, [nk * hk, 2 * nk * hk], axis=-1)
        l2 = lambda t: t * jax.lax.rsqrt(jnp.sum(t * t, axis=-1, keepdims=True) + 1e-6)
        q, k = (jnp.repeat(l2(t.reshape(T, nk, hk)), r, axis=1) for t in (q, k))  # [T, nv, hk]
        beta = jax.nn.sigmoid(b.reshape(T, nv).astype(jnp.float32))
        g = -jnp.exp(value(self, "A_log").astype(jnp.float32)) * jax.nn.softplus(
            a.reshape(T, nv).astype(jnp.float32) + value(self, "dt_bias").astype(jnp.float32))
        o, delta = kernels.delta_rule(q, k, v.reshape(T, nv, hv), g, beta, state["delta"], index, md.state_slots, md)
        o = rms_norm(o, value(self, "gate_norm"), c.rms_norm_eps) * jax.nn.silu(z.reshape(T, nv, hv).astype(jnp.float32))
        out = mm(o.reshape(T, nv * hv).astype(x.dtype), value(self, "out_proj"))
        state = dict(state, conv=conv, delta=delta)
        return out, (k_pages, v_pages, state)


class GatedAttentionLayer(Block):
    def __init__(self, config: ModelConfig, stack: int | None):
        super().__init__(config, stack)
        c, p = config, ParamMaker(stack)
        declare(self, attention_params(p, c, 2 * c.num_heads * c.head_dim))  # per head: the query and its output gate
        declare(self, dict(q_norm=p((c.head_dim,), ("head_dim",)), k_norm=p((c.head_dim,), ("head_dim",))))

    def mix(self, x, caches, index: int, step: Step):
        c, kernels, md = self.config, step.kernels, step.md
        mm, T, hd, eps = kernels.matmul, x.shape[0], c.head_dim, c.rms_norm_eps
        q, k, v = (step.ops.column_linear(x, value(self, n), mm) for n in ("wq", "wk", "wv"))
        if c.attention_bias:
            q, k, v = (y + value(self, b).astype(y.dtype) for y, b in ((q, "bq"), (k, "bk"), (v, "bv")))
        q, gate = jnp.split(q.reshape(T, -1, 2 * hd), 2, axis=-1)  # per head: the query, then its output gate
        q, k = norm1p(q, value(self, "q_norm"), eps), norm1p(k.reshape(T, -1, hd), value(self, "k_norm"), eps)
        rot = rotary_dim(c)
        inv_freq, factor = step.rope
        q, k = (jnp.concatenate([apply_rope(t[..., :rot], md.positions, inv_freq, factor), t[..., rot:]], axis=-1)
                for t in (q, k))
        k_pages, v_pages, state = caches
        layer = jnp.int32(index)
        k_pages, v_pages = kernels.write_kv(k_pages, v_pages, layer, k, v.reshape(T, -1, hd), md.slot_mapping)
        attn = kernels.paged_attention(q, k_pages, v_pages, layer, md, scale=hd ** -0.5, sliding_window=None)
        attn = attn.reshape(T, -1) * jax.nn.sigmoid(gate.reshape(T, -1).astype(jnp.float32)).astype(attn.dtype)
        out = step.ops.row_linear(attn, value(self, "wo"), mm)
        if c.attention_bias:
            out = out + value(self, "bo").astype(out.dtype)
        return out, (k_pages, v_pages, state)


class Qwen3Next(HybridDecoder):
    KINDS = {"delta": ("delta_layers", DeltaLayer), "attention": ("attn_layers", GatedAttentionLayer)}
    layer_kinds = staticmethod(layer_kinds)

    def norm_weight(self, w):
        return 1.0 + w.astype(jnp.float32)

    def rope(self):
        c = self.config
        return inv_frequencies(rotary_dim(c), c.rope_theta, c.rope_scaling)


param_shapes, param_axes, init_params, forward, compute_logits, kv_cache_shapes = hybrid_functions(Qwen3Next)


def state_shapes(config: ModelConfig, num_slots: int) -> dict:
    """The DeltaNet layers' state pools (float32): {"conv": [layers, slots, K-1, conv_dim], "delta": [layers,
    slots, value heads, k_dim, v_dim]}."""
    d, n = delta_dims(config), layer_kinds(config).count("delta")
    return {"conv": jax.ShapeDtypeStruct((n, num_slots, d["kernel"] - 1, d["conv_dim"]), jnp.float32),
            "delta": jax.ShapeDtypeStruct((n, num_slots, d["nv"], d["hk"], d["hv"]), jnp.float32)}
