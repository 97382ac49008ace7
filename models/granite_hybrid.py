"""IBM Granite-4.0-H (GraniteMoeHybrid): Mamba-2 layers interleaved with attention layers, each
followed by a shared MLP and, when the config has experts, a routed MoE beside it.

Layer i is a Mamba-2 mixer ("linear_attention"/"mamba" in the config's layer types) or GQA attention
("full_attention"/"attention"; RoPE only if position_embedding_type is "rope", scale
attention_multiplier), then `h + residual_multiplier * mixer(norm(h))` and the same for the MLP.
The embedding is scaled by embedding_multiplier, the logits divided by logits_scaling.

The Mamba-2 mixer: in_proj -> (gate z, xBC, dt); the causal conv1d over xBC with its rolling state
(Kernels.causal_conv1d), silu; the SSD scan over x with B, C from its state slot (Kernels.ssd_scan;
dt = clamp(softplus(dt + dt_bias)), A = -exp(A_log)); + D x; the gated RMSNorm over n_groups groups;
out_proj. Its caches are the "conv" [mamba layers, slots, K-1, conv_dim] and "ssm" [mamba layers,
slots, heads, head_dim, state] pools (float32), the attention layers' the paged K/V pools.
The params tree: "mamba_layers" and "attn_layers" groups (models/hybrid.py).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jlight.core.config import ModelConfig
from jlight.core.errors import UnsupportedModelError
from jlight.models.hybrid import HybridDecoder, attention_params, gated_rms_norm, hybrid_functions
from jlight.models.layers import activation, rms_norm, unstack_layers  # noqa: F401  (unstack_layers: the engine's)
from jlight.models.module import ParamMaker, Step, declare, value
from jlight.models.moe import expert_ffn, softmax_topk
from jlight.models.rope import apply_rope


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


def mamba_dims(config: ModelConfig) -> dict:
    x = config.extra
    heads, groups, state = x.get("mamba_n_heads", 128), x.get("mamba_n_groups", 1), x.get("mamba_d_state", 256)
    inner = int(x.get("mamba_expand", 2) * config.hidden_size)
    head_dim = x.get("mamba_d_head", "auto")
    head_dim = inner // heads if head_dim == "auto" else head_dim
    return dict(heads=heads, groups=groups, state=state, inner=inner, head_dim=head_dim, kernel=x.get("mamba_d_conv", 4),
                conv_dim=inner + 2 * groups * state)


def _as_float(v) -> float:
    """A config float; transformers writes infinities to config.json as {"__float__": "Infinity"}."""
    return float(v["__float__"]) if isinstance(v, dict) else float(v)


class Block(nnx.Module):
    """The two norms and the MLP side of a layer: the shared MLP, plus the routed experts if any."""

    def __init__(self, config: ModelConfig, stack: int | None):
        c = self.config = config
        p = ParamMaker(stack)
        E, x = c.hidden_size, c.extra
        F = x.get("shared_intermediate_size", 1024)
        self.attn_norm = p((E,), ("embed_norm",))
        self.mlp_norm = p((E,), ("embed_norm",))
        self.shared_in = p((E, 2 * F), ("embed", "mlp"))  # [gate | up]
        self.shared_out = p((F, E), ("mlp", "embed"))
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
        gate, up = jnp.split(ops.column_linear(x, value(self, "shared_in"), mm), 2, axis=-1)
        out = ops.row_linear(act(gate) * up, value(self, "shared_out"), mm)
        if hasattr(self, "router"):
            logits = jnp.dot(x.astype(jnp.float32), value(self, "router").astype(jnp.float32))  # [T, experts]
            ids, weights = softmax_topk(logits, c.extra.get("num_experts_per_tok") or 2, True)  # = softmax over the top-k logits
            local_ffn = functools.partial(expert_ffn, act=act, impl=kernels.moe_impl, grouped=kernels.grouped_matmul)
            experts = (value(self, n) for n in ("experts_gate", "experts_up", "experts_down"))
            out = out + ops.expert_ffn(local_ffn, x, ids, weights, *experts)
        return out

    def __call__(self, h, caches, index: int, step: Step):
        """h [T, embed] through the mixer (self.mix) and the MLP, each a scaled residual."""
        c = self.config
        scale = c.extra.get("residual_multiplier", 1.0)
        out, caches = self.mix(rms_norm(h, value(self, "attn_norm"), c.rms_norm_eps), caches, index, step)
        h = h + out * scale
        return h + self.mlp(rms_norm(h, value(self, "mlp_norm"), c.rms_norm_eps), step) * scale, caches


class MambaLayer(Block):
    def __init__(self, config: ModelConfig, stack: int | None):
        super().__init__(config, stack)
        p, d, E = ParamMaker(stack), mamba_dims(config), config.hidden_size
        self.in_proj = p((E, d["inner"] + d["conv_dim"] + d["heads"]), ("embed", None))
        if config.extra.get("mamba_proj_bias", False):
            declare(self, dict(in_proj_bias=p((d["inner"] + d["conv_dim"] + d["heads"],), (None,)),
                               out_proj_bias=p((E,), ("embed_norm",))))
        self.conv_weight = p((d["kernel"], d["conv_dim"]), (None, None))  # tap K-1 reads the current token
        if config.extra.get("mamba_conv_bias", True):
            self.conv_bias = p((d["conv_dim"],), (None,))
        self.dt_bias = p((d["heads"],), (None,))
        self.A_log = p((d["heads"],), (None,))
        self.D = p((d["heads"],), (None,))
        self.gate_norm = p((d["inner"],), (None,))
        self.out_proj = p((d["inner"], E), (None, "embed"))

    def mix(self, x, caches, index: int, step: Step):
        c, kernels, md = self.config, step.kernels, step.md
        d = mamba_dims(c)
        mm = kernels.matmul
        T = x.shape[0]
        proj = mm(x, value(self, "in_proj"))
        if hasattr(self, "in_proj_bias"):
            proj = proj + value(self, "in_proj_bias").astype(proj.dtype)
        gate, xbc, dt = jnp.split(proj, [d["inner"], d["inner"] + d["conv_dim"]], axis=-1)
        k_pages, v_pages, state = caches
        bias = value(self, "conv_bias") if hasattr(self, "conv_bias") else None
        xbc, conv = kernels.causal_conv1d(xbc, value(self, "conv_weight"), bias, state["conv"][index], md.state_slots, md)
        xbc = activation(c.hidden_act)(xbc)
        xs, B, C = jnp.split(xbc, [d["inner"], d["inner"] + d["groups"] * d["state"]], axis=-1)
        lo, hi = (_as_float(v) for v in (c.extra.get("time_step_limit") or (0.0, float("inf"))))
        dt = jnp.clip(jax.nn.softplus(dt.astype(jnp.float32) + value(self, "dt_bias").astype(jnp.float32)), lo, hi)
        A = -jnp.exp(value(self, "A_log").astype(jnp.float32))
        xs = xs.reshape(T, d["heads"], d["head_dim"])
        y, ssm = kernels.ssd_scan(xs, dt, A, B.reshape(T, d["groups"], d["state"]), C.reshape(T, d["groups"], d["state"]),
                                  state["ssm"][index], md.state_slots, md)
        y = y + xs.astype(jnp.float32) * value(self, "D").astype(jnp.float32)[:, None]
        y = gated_rms_norm(y.reshape(T, d["inner"]).astype(x.dtype), gate, value(self, "gate_norm"),
                           d["inner"] // d["groups"], c.rms_norm_eps)
        out = mm(y, value(self, "out_proj"))
        if hasattr(self, "out_proj_bias"):
            out = out + value(self, "out_proj_bias").astype(out.dtype)
        state = dict(state, conv=state["conv"].at[index].set(conv), ssm=state["ssm"].at[index].set(ssm))
        return out, (k_pages, v_pages, state)


class AttentionLayer(Block):
    def __init__(self, config: ModelConfig, stack: int | None):
        super().__init__(config, stack)
        declare(self, attention_params(ParamMaker(stack), config, config.num_heads * config.head_dim))

    def mix(self, x, caches, index: int, step: Step):
        c, kernels, md = self.config, step.kernels, step.md
        mm, T = kernels.matmul, x.shape[0]
        q, k, v = (step.ops.column_linear(x, value(self, n), mm) for n in ("wq", "wk", "wv"))
        if c.attention_bias:
            q, k, v = (y + value(self, b).astype(y.dtype) for y, b in ((q, "bq"), (k, "bk"), (v, "bv")))
        q, k, v = (y.reshape(T, -1, c.head_dim) for y in (q, k, v))
        if c.extra.get("position_embedding_type") == "rope":
            inv_freq, factor = step.rope
            q, k = apply_rope(q, md.positions, inv_freq, factor), apply_rope(k, md.positions, inv_freq, factor)
        k_pages, v_pages, state = caches
        layer = jnp.int32(index)
        k_pages, v_pages = kernels.write_kv(k_pages, v_pages, layer, k, v, md.slot_mapping)
        attn = kernels.paged_attention(q, k_pages, v_pages, layer, md, scale=c.extra.get("attention_multiplier", 1.0),
                                       sliding_window=None)
        out = step.ops.row_linear(attn.reshape(T, -1), value(self, "wo"), mm)
        if c.attention_bias:
            out = out + value(self, "bo").astype(out.dtype)
        return out, (k_pages, v_pages, state)


class GraniteHybrid(HybridDecoder):
    KINDS = {"mamba": ("mamba_layers", MambaLayer), "attention": ("attn_layers", AttentionLayer)}
    layer_kinds = staticmethod(layer_kinds)

    def embed_scale(self) -> float:
        return self.config.extra.get("embedding_multiplier", 1.0)

    def logits_scale(self) -> float:
        return 1.0 / self.config.extra.get("logits_scaling", 1.0)


param_shapes, param_axes, init_params, forward, compute_logits, kv_cache_shapes = hybrid_functions(GraniteHybrid)


def state_shapes(config: ModelConfig, num_slots: int) -> dict:
    """The Mamba layers' state pools (float32): {"conv": [layers, slots, K-1, conv_dim], "ssm": [layers, slots,
    heads, head_dim, state]}."""
    d, n = mamba_dims(config), layer_kinds(config).count("mamba")
    return {"conv": jax.ShapeDtypeStruct((n, num_slots, d["kernel"] - 1, d["conv_dim"]), jnp.float32),
            "ssm": jax.ShapeDtypeStruct((n, num_slots, d["heads"], d["head_dim"], d["state"]), jnp.float32)}
