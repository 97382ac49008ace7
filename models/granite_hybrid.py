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

from jlight.core.batch_metadata import BatchMetadata
from jlight.core.config import ModelConfig
from jlight.core.errors import UnsupportedModelError
from jlight.core.parallel_ops import ParallelOps
from jlight.core.recurrent_state import PagesAndState
from jlight.models.hybrid import gated_rms_norm, layer_at, layout_of
from jlight.models.layers import activation, rms_norm, unstack_layers  # noqa: F401  (unstack_layers: the engine's)
from jlight.models.module import Layout, ParamMaker, Step, bind, declare, layer_group, param_axes as _axes, \
    param_shapes as _shapes, random_params, value
from jlight.models.moe import expert_ffn, softmax_topk
from jlight.models.rope import apply_rope, inv_frequencies

GROUPS = ("mamba_layers", "attn_layers")


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
            self.experts_gate_up = p((X, E, 2 * I), ("experts", "embed", "mlp"))  # [gate | up]
            self.experts_down = p((X, I, E), ("experts", "mlp", "embed"))

    def mlp(self, x, step: Step):
        c, ops, kernels = self.config, step.ops, step.kernels
        mm, act = kernels.matmul, activation(c.hidden_act)
        gate, up = jnp.split(ops.column_linear(x, value(self, "shared_in"), mm), 2, axis=-1)
        out = ops.row_linear(act(gate) * up, value(self, "shared_out"), mm)
        if hasattr(self, "router"):
            logits = jnp.dot(x.astype(jnp.float32), value(self, "router").astype(jnp.float32))  # [T, experts]
            ids, weights = softmax_topk(logits, c.extra.get("num_experts_per_tok") or 2, True)  # = softmax over the top-k logits
            gate_up = value(self, "experts_gate_up")
            w_gate, w_up = jnp.split(gate_up, 2, axis=-1)
            local_ffn = functools.partial(expert_ffn, act=act, impl=kernels.moe_impl, grouped=kernels.grouped_matmul)
            out = out + ops.expert_ffn(local_ffn, x, ids, weights, w_gate, w_up, value(self, "experts_down"))
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
        c, p = config, ParamMaker(stack)
        E, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        declare(self, dict(wq=p((E, q), ("embed", "heads")), wk=p((E, kv), ("embed", "kv_heads")),
                           wv=p((E, kv), ("embed", "kv_heads")), wo=p((q, E), ("heads", "embed"))))
        if c.attention_bias:
            declare(self, dict(bq=p((q,), ("heads",)), bk=p((kv,), ("kv_heads",)), bv=p((kv,), ("kv_heads",)),
                               bo=p((E,), ("embed_norm",))))

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


class GraniteHybrid(nnx.Module):
    def __init__(self, config: ModelConfig, layout: Layout = Layout()):
        c = self.config = config
        p = ParamMaker()
        kinds = layer_kinds(c)
        self.embed = p((c.vocab_size, c.hidden_size), ("vocab", "embed"))
        for group, kind, make in (("mamba_layers", "mamba", MambaLayer), ("attn_layers", "attention", AttentionLayer)):
            n = kinds.count(kind)
            if n:
                setattr(self, group, layer_group(functools.partial(make, c), n, layout))
        self.final_norm = p((c.hidden_size,), ("embed_norm",))
        self.lm_head = p((c.hidden_size, c.vocab_size), ("embed", "vocab"))

    def __call__(self, tokens, k_cache: PagesAndState, v_cache, md: BatchMetadata, kernels, ops):
        c = self.config
        step = Step(md, kernels, ops, inv_frequencies(c.head_dim, c.rope_theta, c.rope_scaling))
        final_norm = value(self, "final_norm")
        h = ops.embed(value(self, "embed"), tokens).astype(final_norm.dtype) * c.extra.get("embedding_multiplier", 1.0)
        caches = (k_cache.pages, v_cache, k_cache.state)
        seen = {"mamba": 0, "attention": 0}
        for kind in layer_kinds(c):
            group = self.mamba_layers if kind == "mamba" else self.attn_layers
            h, caches = layer_at(group, seen[kind])(h, caches, seen[kind], step)
            seen[kind] += 1
        k_pages, v_cache, state = caches
        return ops.gather_sequence(rms_norm(h, final_norm, c.rms_norm_eps)), PagesAndState(k_pages, state), v_cache

    def logits(self, hidden, kernels, ops):
        logits = ops.lm_head(hidden, value(self, "lm_head"), kernels.matmul)
        return logits / self.config.extra.get("logits_scaling", 1.0)


def param_shapes(config: ModelConfig, layout: Layout = Layout()) -> dict:
    return _shapes(GraniteHybrid(config, layout))


def param_axes(config: ModelConfig, layout: Layout = Layout()) -> dict:
    return _axes(GraniteHybrid(config, layout))


def init_params(config: ModelConfig, key: jax.Array, dtype=jnp.bfloat16) -> dict:
    return random_params(param_shapes(config), key, dtype)


def forward(params, config, tokens, k_cache, v_cache, md, kernels, ops: ParallelOps):
    return bind(GraniteHybrid(config, layout_of(params, GROUPS)), params)(tokens, k_cache, v_cache, md, kernels, ops)


def compute_logits(params, config, hidden, kernels, ops: ParallelOps):
    return bind(GraniteHybrid(config, layout_of(params, GROUPS)), params).logits(hidden, kernels, ops)


def kv_cache_shapes(config: ModelConfig, num_pages: int, page_size: int):
    """The attention layers' K and V page pools: [attention layers, pages, page_size, kv_heads, head_dim]."""
    shape = (layer_kinds(config).count("attention"), num_pages, page_size, config.num_kv_heads, config.head_dim)
    return shape, shape


def state_shapes(config: ModelConfig, num_slots: int) -> dict:
    """The Mamba layers' state pools (float32): {"conv": [layers, slots, K-1, conv_dim], "ssm": [layers, slots,
    heads, head_dim, state]}."""
    d, n = mamba_dims(config), layer_kinds(config).count("mamba")
    return {"conv": jax.ShapeDtypeStruct((n, num_slots, d["kernel"] - 1, d["conv_dim"]), jnp.float32),
            "ssm": jax.ShapeDtypeStruct((n, num_slots, d["heads"], d["head_dim"], d["state"]), jnp.float32)}
