"""The Mamba-2 mixer and the plain GQA attention of the Mamba-2 hybrids (Granite-4.0-H, Nemotron-H), as
mixins of a hybrid layer module (models/hybrid.py): `declare_*` declares the weights, `mix(x, caches,
index, step) -> (out, caches)` computes.

The Mamba-2 mixer: in_proj -> (gate z, xBC, dt); the causal conv1d over xBC with its rolling state
(Kernels.causal_conv1d), its activation; the SSD scan over x with B, C from the row's state slot
(Kernels.ssd_scan; dt = clamp(softplus(dt + dt_bias)), A = -exp(A_log)); + D x; the gated RMSNorm
(x * silu(z), normed over n_groups groups); out_proj. Its pools: "conv" [mamba layers, slots, K-1,
conv_dim] and "ssm" [mamba layers, slots, heads, head_dim, state], float32. `mamba_dims` reads both
families' config names (Granite's mamba_n_heads..., Nemotron-H's mamba_num_heads, ssm_state_size...).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jlight.core.config import ModelConfig
from jlight.models.hybrid import attention_params, gated_rms_norm
from jlight.models.layers import activation
from jlight.models.module import ParamMaker, Step, declare, value
from jlight.models.rope import apply_rope


def _first(x: dict, names: tuple[str, ...], default):
    return next((x[n] for n in names if x.get(n) is not None), default)


def _as_float(v) -> float:
    """A config float; transformers writes infinities to config.json as {"__float__": "Infinity"}."""
    return float(v["__float__"]) if isinstance(v, dict) else float(v)


def mamba_dims(config: ModelConfig) -> dict:
    x = config.extra
    heads = _first(x, ("mamba_n_heads", "mamba_num_heads"), 128)
    groups = _first(x, ("mamba_n_groups", "n_groups"), 1)
    state = _first(x, ("mamba_d_state", "ssm_state_size"), 256)
    head_dim = _first(x, ("mamba_d_head", "mamba_head_dim"), "auto")
    inner = int(_first(x, ("mamba_expand", "expand"), 2) * config.hidden_size) if head_dim == "auto" else heads * head_dim
    head_dim = inner // heads if head_dim == "auto" else head_dim
    if "time_step_min" in x:  # Nemotron-H: dt clamped below at time_step_min
        limit = (x["time_step_min"], float("inf"))
    else:
        limit = x.get("time_step_limit") or (0.0, float("inf"))
    return dict(heads=heads, groups=groups, state=state, inner=inner, head_dim=head_dim,
                kernel=_first(x, ("mamba_d_conv", "conv_kernel"), 4), conv_dim=inner + 2 * groups * state,
                conv_bias=bool(_first(x, ("mamba_conv_bias", "use_conv_bias"), True)),
                proj_bias=bool(_first(x, ("mamba_proj_bias", "use_bias"), False)),
                act=_first(x, ("mamba_hidden_act",), config.hidden_act), dt_limit=tuple(_as_float(v) for v in limit))


def mamba_state_shapes(config: ModelConfig, num_layers: int, num_slots: int) -> dict:
    """{"conv": [layers, slots, K-1, conv_dim], "ssm": [layers, slots, heads, head_dim, state]}, float32."""
    d = mamba_dims(config)
    return {"conv": jax.ShapeDtypeStruct((num_layers, num_slots, d["kernel"] - 1, d["conv_dim"]), jnp.float32),
            "ssm": jax.ShapeDtypeStruct((num_layers, num_slots, d["heads"], d["head_dim"], d["state"]), jnp.float32)}


class MambaMixer:
    """Mixin: the Mamba-2 mixer's weights and computation."""

    def declare_mamba(self, config: ModelConfig, stack: int | None):
        p, d, E = ParamMaker(stack), mamba_dims(config), config.hidden_size
        width = d["inner"] + d["conv_dim"] + d["heads"]
        self.in_proj = p((E, width), ("embed", None))
        if d["proj_bias"]:
            declare(self, dict(in_proj_bias=p((width,), (None,)), out_proj_bias=p((E,), ("embed_norm",))))
        self.conv_weight = p((d["kernel"], d["conv_dim"]), (None, None))  # tap K-1 reads the current token
        if d["conv_bias"]:
            self.conv_bias = p((d["conv_dim"],), (None,))
        self.dt_bias = p((d["heads"],), (None,))
        self.A_log = p((d["heads"],), (None,))
        self.D = p((d["heads"],), (None,))
        self.gate_norm = p((d["inner"],), (None,))
        self.out_proj = p((d["inner"], E), (None, "embed"))

    def mix(self, x, caches, index: int, step: Step):
        c, kernels, md = self.config, step.kernels, step.md
        d, mm, T = mamba_dims(c), kernels.matmul, x.shape[0]
        proj = mm(x, value(self, "in_proj"))
        if hasattr(self, "in_proj_bias"):
            proj = proj + value(self, "in_proj_bias").astype(proj.dtype)
        gate, xbc, dt = jnp.split(proj, [d["inner"], d["inner"] + d["conv_dim"]], axis=-1)
        k_pages, v_pages, state = caches
        bias = value(self, "conv_bias") if hasattr(self, "conv_bias") else None
        xbc, conv = kernels.causal_conv1d(xbc, value(self, "conv_weight"), bias, state["conv"], index, md.state_slots, md)
        xbc = activation(d["act"])(xbc)
        xs, B, C = jnp.split(xbc, [d["inner"], d["inner"] + d["groups"] * d["state"]], axis=-1)
        dt = jnp.clip(jax.nn.softplus(dt.astype(jnp.float32) + value(self, "dt_bias").astype(jnp.float32)), *d["dt_limit"])
        A = -jnp.exp(value(self, "A_log").astype(jnp.float32))
        xs = xs.reshape(T, d["heads"], d["head_dim"])
        y, ssm = kernels.ssd_scan(xs, dt, A, B.reshape(T, d["groups"], d["state"]), C.reshape(T, d["groups"], d["state"]),
                                  state["ssm"], index, md.state_slots, md)
        y = y + xs.astype(jnp.float32) * value(self, "D").astype(jnp.float32)[:, None]
        y = gated_rms_norm(y.reshape(T, d["inner"]).astype(x.dtype), gate, value(self, "gate_norm"),
                           d["inner"] // d["groups"], c.rms_norm_eps)
        out = mm(y, value(self, "out_proj"))
        if hasattr(self, "out_proj_bias"):
            out = out + value(self, "out_proj_bias").astype(out.dtype)
        state = dict(state, conv=conv, ssm=ssm)
        return out, (k_pages, v_pages, state)


class AttentionMixer:
    """Mixin: GQA attention over the paged K/V, RoPE if `uses_rope`, softmax scale `attention_scale`."""
    uses_rope = True

    def attention_scale(self) -> float:
        return self.config.head_dim ** -0.5

    def declare_attention(self, config: ModelConfig, stack: int | None):
        declare(self, attention_params(ParamMaker(stack), config, config.num_heads * config.head_dim))

    def mix(self, x, caches, index: int, step: Step):
        c, kernels, md = self.config, step.kernels, step.md
        mm, T = kernels.matmul, x.shape[0]
        q, k, v = (step.ops.column_linear(x, value(self, n), mm) for n in ("wq", "wk", "wv"))
        if c.attention_bias:
            q, k, v = (y + value(self, b).astype(y.dtype) for y, b in ((q, "bq"), (k, "bk"), (v, "bv")))
        q, k, v = (y.reshape(T, -1, c.head_dim) for y in (q, k, v))
        if self.uses_rope:
            inv_freq, factor = step.rope
            q, k = apply_rope(q, md.positions, inv_freq, factor), apply_rope(k, md.positions, inv_freq, factor)
        k_pages, v_pages, state = caches
        layer = jnp.int32(index)
        k_pages, v_pages = kernels.write_kv(k_pages, v_pages, layer, k, v, md.slot_mapping)
        attn = kernels.paged_attention(q, k_pages, v_pages, layer, md, scale=self.attention_scale(), sliding_window=None)
        out = step.ops.row_linear(attn.reshape(T, -1), value(self, "wo"), mm)
        if c.attention_bias:
            out = out + value(self, "bo").astype(out.dtype)
        return out, (k_pages, v_pages, state)
