"""Gemma 4 (text): Gemma 3's layer, with each kind of layer its own attention geometry, keys shared
between layers, per-layer embeddings and a routed MoE beside the MLP (docs/gemma4_scope.md).

What it computes, against models/gemma.py:
  * every RMSNorm scales by w (not 1 + w), in float32; V is RMS-normed without a weight
    (x * (mean(x^2) + eps)^-1/2 over head_dim), after q_norm / k_norm as in Gemma 3;
  * the softmax scale is 1.0, with no attention soft-cap;
  * "sliding_attention" layers (window `sliding_window`) and "full_attention" layers, the last layer
    always full; each kind has its own head_dim and KV heads (`per_layer_config`, or the hub form's
    `global_head_dim` / `num_global_key_value_heads`, the latter only with attention_k_eq_v); with
    attention_k_eq_v the full layers have no v_proj and V is the (un-roped, un-normed) k_proj output;
  * RoPE per kind: the sliding layers' table over their head_dim (rope_local_base_freq), the full
    layers' over theirs, "proportional": inv_freq[j] = theta^(-2j / head_dim) for
    j < int(partial_rotary_factor * head_dim // 2), 0 beyond (unrotated dimensions), over the
    rotate-half pairs (j, j + head_dim / 2) of the whole head;
  * KV sharing: the last num_kv_shared_layers layers compute no K/V; each reads the K/V of the last
    earlier non-shared layer of its own kind; with use_double_wide_mlp those layers' MLPs are 2x wide;
  * per-layer embeddings (hidden_size_per_layer_input P > 0): ple [T, layers, P] =
    (rms_w((h0 @ ple_proj) / sqrt(E)) + ple_embed[ids] * sqrt(P)) / sqrt(2), h0 the scaled token
    embedding; after its MLP, layer i adds rms_w(act(h @ ple_gate) * ple[:, i]) @ ple_out);
  * enable_moe_block: beside the dense MLP every layer runs routed experts on the residual stream r
    entering the MLP: router softmax over rms(r) * router_scale / sqrt(E) @ router, top-k renormalised,
    times expert_scale[expert]; experts read rms_w(r, moe_norm); the MLP's and the experts' outputs are
    each normed (post_mlp_norm_1, post_moe_norm) and summed before post_mlp_norm;
  * every layer ends with h *= layer_scalar; the embedding is scaled by sqrt(hidden_size) and the final
    logits soft-capped as Gemma's.

The params tree holds one group per layer shape (models/hybrid.py's contract): "sliding_layers",
"full_layers" and, for KV-shared layers (no wk, wv, k_norm; a 2x MLP with use_double_wide_mlp),
"shared_sliding_layers" and "shared_full_layers"; the forward runs the layers in model order, each
with its kind static. Top level: embed, final_norm, lm_head, and with PLE ple_embed [Vp, layers * P],
ple_proj [E, layers * P], ple_norm [P].

The KV pool holds the non-shared layers, pool layer = layer index, at one per-token width W = the widest
kind's kv_heads * head_dim: [layers, pages, page_size, W / hd_b, hd_b] with hd_b the largest head_dim of the
kinds. The pool is never reshaped (a reshaped view of the whole pool made XLA copy it every step). A layer of
head_dim hd = hd_b / r writes its K/V heads repeated W / (kv_heads * hd) times, as [T, W / hd_b, hd_b] (a
reshape of the new tokens only), so pool head b holds the layer's view heads r*b .. r*b + r - 1 side by side.
Its attention runs over the pool as it is: query head h, which reads view head j = h // (H / (W / hd)), is
zero-padded to hd_b with its values in segment j % r; q_pad . k_b = q . k_j exactly, and GQA's map
h // (H / (W / hd_b)) is base head j // r. The output's segment j % r is the layer's; the rest is dropped.
The narrower kind's attention does r times the arithmetic of its own head_dim over the same bytes.

On a mesh of tp devices the step runs `mesh_config`'s config (ShardingPlan's mesh_config argument; a tp step
over another config is refused): every kind's KV heads replicated up
to tp (as the plan replicates num_kv_heads), so W is the largest max(kv_heads, tp) * head_dim of the kinds. The pool's
head axis splits over tp; each device holds W / tp contiguous values a token, which mesh_config requires to be
whole heads of every kind, so the view, the repeat and GQA hold per device on the device's query heads. The
K/V projections split on their columns: a kind with at least tp KV heads computes its own heads; a kind with
fewer splits inside a head, its slices are all-gathered and each device keeps the head its query heads read
(head axis_index // (tp / kv_heads)). Per-layer embeddings: ple_embed splits on vocab as embed; ple_proj and
the layers' ple_gate / ple_out are replicated and applied to the device's own tokens (no collective).
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jlight.core import kv_layout
from jlight.core.config import ModelConfig
from jlight.core.errors import UnsupportedModelError
from jlight.models import attention_kinds, module
from jlight.models.hybrid import layer_at, layout_of
# unstack_layers: the engine unrolls every group with it (each group's stacked weights split per layer).
from jlight.models.layers import activation, rms_norm, unstack_layers  # noqa: F401
from jlight.models.module import Layout, ParamMaker, Step, layer_group, value
from jlight.models.moe import expert_ffn, softmax_topk
from jlight.models.rope import inv_frequencies

SLIDING, FULL = "sliding_attention", "full_attention"
# (layer type, KV-shared) -> the params tree's group of those layers
GROUPS = {(SLIDING, False): "sliding_layers", (FULL, False): "full_layers",
          (SLIDING, True): "shared_sliding_layers", (FULL, True): "shared_full_layers"}
_PER_LAYER_FIELDS = ("head_dim", "num_key_value_heads")  # per_layer_config's overrides that jlight reads
MESH_TP = "mesh_config_tp"  # the extra field mesh_config writes: the tp its config was made for


class Geometry(NamedTuple):
    head_dim: int
    kv_heads: int

    @property
    def width(self) -> int:
        """K (or V) values a token holds in one layer."""
        return self.head_dim * self.kv_heads


class Plan(NamedTuple):
    """The static layout of a config's layers."""
    types: tuple  # per layer: SLIDING or FULL
    geometry: dict  # layer type -> Geometry
    producer: tuple  # per layer: the pool layer whose K/V it reads (itself unless KV-shared)
    group_index: tuple  # per layer: its index in its group
    num_pool_layers: int  # the non-shared layers, 0 .. num_pool_layers - 1


def layer_types(config: ModelConfig) -> tuple[str, ...]:
    """Each layer's type; HF's default (5 sliding : 1 full) without layer_types; the last layer full (as HF forces)."""
    types = list(attention_kinds.layer_types(config) or
                 [SLIDING if (i + 1) % 6 else FULL for i in range(config.num_layers)])
    types[-1] = FULL
    return tuple(types)


def geometries(config: ModelConfig, types: tuple[str, ...]) -> dict:
    """Layer type -> Geometry, from per_layer_config ({layer: overrides}, as transformers saves it) or the hub
    form's global_head_dim (default 512) and num_global_key_value_heads (read only with attention_k_eq_v)."""
    c, x = config, config.extra
    base = Geometry(c.head_dim, c.num_kv_heads)
    per_layer = x.get("per_layer_config")
    if per_layer is not None:
        overrides = {int(k): v or {} for k, v in per_layer.items()}
        unknown = sorted({f for v in overrides.values() for f in v} - set(_PER_LAYER_FIELDS))
        if unknown:
            raise UnsupportedModelError(f"{c.architecture}: per_layer_config overrides {unknown}; jlight reads only "
                                        f"{', '.join(_PER_LAYER_FIELDS)} per layer")
        of_layer = [Geometry(overrides.get(i, {}).get("head_dim", base.head_dim),
                             overrides.get(i, {}).get("num_key_value_heads", base.kv_heads)) for i in range(c.num_layers)]
    else:
        global_kv = x.get("num_global_key_value_heads") if x.get("attention_k_eq_v") else None
        full = Geometry(x.get("global_head_dim") or 512, global_kv or base.kv_heads)
        of_layer = [full if t == FULL else base for t in types]
    out = {}
    for i, (t, g) in enumerate(zip(types, of_layer)):
        if out.setdefault(t, g) != g:
            raise UnsupportedModelError(f"{c.architecture}: per_layer_config gives {t} layers more than one geometry "
                                        f"({out[t]} and layer {i}'s {g}); jlight runs one head_dim and KV heads per kind")
    return out


def plan(config: ModelConfig) -> Plan:
    c, x = config, config.extra
    types = layer_types(c)
    shared = int(x.get("num_kv_shared_layers") or 0)
    first_shared = c.num_layers - shared
    producer = list(range(c.num_layers))
    for i in range(first_shared, c.num_layers):
        earlier = [j for j in range(first_shared) if types[j] == types[i]]
        if not earlier:
            raise UnsupportedModelError(f"{c.architecture}: num_kv_shared_layers={shared} leaves no non-shared "
                                        f"{types[i]} layer for layer {i} to read its K/V from")
        producer[i] = earlier[-1]
    seen, group_index = {}, []
    for i, t in enumerate(types):
        key = (t, i >= first_shared)
        group_index.append(seen.get(key, 0))
        seen[key] = group_index[-1] + 1
    return Plan(types, geometries(c, types), tuple(producer), tuple(group_index), first_shared)


def check_supported(config: ModelConfig) -> None:
    """Raise UnsupportedModelError for what this module does not compute."""
    c = config
    p = plan(c)
    base = base_geometry(c)
    for t in set(p.types):
        g = p.geometry[t]
        views = pool_width(c) // g.head_dim
        if pool_width(c) % base.head_dim or base.head_dim % g.head_dim or c.num_heads % views:
            raise UnsupportedModelError(
                f"{c.architecture}: {t} layers (head_dim {g.head_dim}, {g.kv_heads} KV heads) do not fit the KV pool's "
                f"{pool_width(c)}-wide view of {base.head_dim}-wide heads: num_attention_heads {c.num_heads} must be a "
                f"multiple of {views}, and {g.head_dim} divide {base.head_dim}, which must divide {pool_width(c)}")
    if c.extra.get("enable_moe_block") and not (c.extra.get("num_experts") and c.extra.get("top_k_experts")
                                                and c.extra.get("moe_intermediate_size")):
        raise UnsupportedModelError(f"{c.architecture}: enable_moe_block needs num_experts, top_k_experts and "
                                    "moe_intermediate_size in config.json")


def pool_width(config: ModelConfig) -> int:
    """W: the widest per-token K (or V) width of the layers that write the pool."""
    p = plan(config)
    return max(p.geometry[t].width for t in set(p.types[:p.num_pool_layers]))


def base_geometry(config: ModelConfig) -> Geometry:
    """The pool's own [.., W / hd_b, hd_b] geometry: hd_b the largest head_dim of the kinds."""
    p = plan(config)
    head_dim = max(p.geometry[t].head_dim for t in set(p.types))
    return Geometry(head_dim, pool_width(config) // head_dim)


def mesh_config(config: ModelConfig, tp: int) -> ModelConfig:
    """The config the engine runs on a mesh of `tp` tensor-parallel devices (sharding/plan.py): each kind's KV
    heads replicated up to tp, written as per_layer_config for every layer, so kv_cache_shapes and the layers'
    views are the mesh's. Raises ValueError, naming the fields, where a kind's KV heads do not split over tp or a
    device's W / tp values a token are not whole heads of a kind that its query heads can share."""
    c = config
    if tp == 1:
        return c
    p = plan(c)
    where = f"{c.architecture} on tp={tp}"
    for t in sorted(set(p.types)):
        g = p.geometry[t]
        if g.kv_heads % tp and (tp % g.kv_heads or g.head_dim % (tp // g.kv_heads)):
            raise ValueError(f"{where}: {t} layers have {g.kv_heads} KV heads of head_dim {g.head_dim} "
                             f"({_geometry_fields(c, t)}); tp must divide the KV heads, or be a multiple of them "
                             "that divides head_dim times the KV heads (each device then keeps a copy of one head); "
                             "choose another tp")
    geometry = {t: Geometry(g.head_dim, max(g.kv_heads, tp)) for t, g in p.geometry.items()}
    per_layer = {str(i): {"head_dim": geometry[t].head_dim, "num_key_value_heads": geometry[t].kv_heads}
                 for i, t in enumerate(p.types)}
    out = dataclasses.replace(c, num_kv_heads=c.num_kv_heads * max(1, tp // c.num_kv_heads),
                              extra={**c.extra, "per_layer_config": per_layer, MESH_TP: tp})
    width = pool_width(out)
    for t in sorted(set(p.types)):
        hd = geometry[t].head_dim
        if (width // tp) % hd or c.num_heads % (width // hd):
            raise ValueError(f"{where}: the KV pool is {width} values a token ({width // tp} a device), its {t} layers' "
                             f"view {width // hd} heads of head_dim {hd}; each device's share must be whole heads and "
                             f"num_attention_heads ({c.num_heads}) a multiple of the view's heads; choose another tp")
    return out


def _geometry_fields(config: ModelConfig, layer_type: str) -> str:
    """The config fields that set a kind's head_dim and KV heads, for messages."""
    if config.extra.get("per_layer_config") is not None:
        return "per_layer_config"
    if layer_type == SLIDING:
        return "head_dim, num_key_value_heads"
    kv = "num_global_key_value_heads" if config.extra.get("attention_k_eq_v") else "num_key_value_heads"
    return f"global_head_dim, {kv}"


def proportional_inv_freq(head_dim: int, theta: float, scaling: dict) -> np.ndarray:
    """Gemma 4's "proportional" RoPE: [head_dim // 2] float32, the first int(f * head_dim // 2) entries
    theta^(-2j / head_dim), the rest 0 (unrotated), all divided by `factor`."""
    rotated = int(scaling.get("partial_rotary_factor", 1.0) * head_dim // 2)
    inv = np.zeros(head_dim // 2, np.float64)
    inv[:rotated] = 1.0 / theta ** (np.arange(0, 2 * rotated, 2, dtype=np.float64) / head_dim)
    return (inv / scaling.get("factor", 1.0)).astype(np.float32)


def rope_tables(config: ModelConfig) -> dict:
    """Layer type -> its attention_kinds.RopeTable, over that type's head_dim."""
    c, geometry = config, plan(config).geometry
    tables = {}
    for t, g in geometry.items():
        if t == SLIDING:
            theta, scaling = c.extra.get("rope_local_base_freq", 10000.0), c.extra.get("rope_local_scaling")
        else:
            theta, scaling = c.rope_theta, c.rope_scaling
        if (scaling or {}).get("rope_type") == "proportional":
            tables[t] = attention_kinds.RopeTable(proportional_inv_freq(g.head_dim, float(theta), scaling))
        else:
            tables[t] = attention_kinds.RopeTable(*inv_frequencies(g.head_dim, float(theta), scaling))
    return tables


def _own_heads(y, head_dim: int, ops):
    """A K or V projection's output [T, columns] (this device's columns) -> [T, heads, head_dim], the KV heads this
    device keeps: its columns as whole heads; or, when its kind has fewer KV heads than tp (the columns split inside
    a head), the whole heads all-gathered over tp and the one its query heads read kept (module docstring)."""
    if y.shape[-1] >= head_dim:
        return y.reshape(y.shape[0], -1, head_dim)
    share = head_dim // y.shape[-1]  # devices that hold one head between them
    whole = jax.lax.all_gather(y, ops.axis_name, axis=1, tiled=True)  # [T, kv_heads * head_dim]
    head = jax.lax.axis_index(ops.axis_name) // share
    return jax.lax.dynamic_slice_in_dim(whole, head * head_dim, head_dim, axis=1)[:, None]


def _segments(query_heads: int, view_heads: int, r: int) -> np.ndarray | None:
    """[query_heads, r] bool: the segment of hd_b that query head h's view head j = h // (query_heads / view_heads)
    occupies in its pool head (j % r); None where r == 1 (the layer's head_dim is the pool's)."""
    if r == 1:
        return None
    j = np.arange(query_heads) // (query_heads // view_heads)
    return np.arange(r)[None, :] == (j % r)[:, None]


def _rms(x, eps: float):
    """RMSNorm without a weight (V, the router's input), in float32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


class Gemma4Layer(nnx.Module):
    """One layer's weights and computation; `layer_type` and `shared` fix its shape (its group)."""

    def __init__(self, config: ModelConfig, layer_type: str, shared: bool, stack: int | None):
        c, x = self.config, self.x = config, config.extra
        self.layer_type, self.shared = layer_type, shared
        g = plan(c).geometry[layer_type]
        self.k_is_v = bool(x.get("attention_k_eq_v")) and layer_type == FULL
        p = ParamMaker(stack)
        E, H = c.hidden_size, c.num_heads
        F = c.intermediate_size * (2 if shared and x.get("use_double_wide_mlp") else 1)
        for name in ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm"):
            setattr(self, name, p((E,), ("embed_norm",)))
        self.wq = p((E, H * g.head_dim), ("embed", "heads"))
        self.q_norm = p((g.head_dim,), ("head_dim",))
        if not shared:
            self.wk = p((E, g.width), ("embed", "kv_heads"))
            self.k_norm = p((g.head_dim,), ("head_dim",))
            if not self.k_is_v:
                self.wv = p((E, g.width), ("embed", "kv_heads"))
        self.wo = p((H * g.head_dim, E), ("heads", "embed"))
        self.w_gate = p((E, F), ("embed", "mlp"))
        self.w_up = p((E, F), ("embed", "mlp"))
        self.w_down = p((F, E), ("mlp", "embed"))
        self.layer_scalar = p((1,), (None,))
        P = x.get("hidden_size_per_layer_input") or 0
        if P:
            self.ple_gate = p((E, P), ("embed", None))
            self.ple_out = p((P, E), (None, "embed"))
            self.ple_post_norm = p((E,), ("embed_norm",))
        if x.get("enable_moe_block"):
            X, I = x["num_experts"], x["moe_intermediate_size"]
            self.router = p((E, X), ("embed", "router"))
            self.router_scale = p((E,), ("embed_norm",))
            self.expert_scale = p((X,), (None,))
            self.experts_gate = p((X, E, I), ("experts", "embed", "mlp"))
            self.experts_up = p((X, E, I), ("experts", "embed", "mlp"))
            self.experts_down = p((X, I, E), ("experts", "mlp", "embed"))
            for name in ("post_mlp_norm_1", "moe_norm", "post_moe_norm"):
                setattr(self, name, p((E,), ("embed_norm",)))

    def norm(self, x, name: str):
        return rms_norm(x, value(self, name), self.config.rms_norm_eps)

    def attention(self, x, k_cache, v_cache, pool_layer: int, step: Step):
        """x: [T, embed] (normed) -> ([T, embed], k_cache, v_cache). pool_layer: the pool layer this layer
        writes (its own index) or, KV-shared, reads (its producer's)."""
        c, ops, kernels = self.config, step.ops, step.kernels
        mm, eps = kernels.matmul, c.rms_norm_eps
        g = plan(c).geometry[self.layer_type]
        table = step.rope[self.layer_type]
        num_tokens = step.md.positions.shape[0]
        q = ops.column_linear(x, value(self, "wq"), mm).reshape(num_tokens, -1, g.head_dim)  # [T, heads, head_dim]
        q = attention_kinds.apply_table(self.norm(q, "q_norm"), step.md, table)
        heads = k_cache.shape[-2] * k_cache.shape[-1] // g.head_dim  # this device's view heads (W / tp / head_dim)
        segment = _segments(q.shape[1], heads, k_cache.shape[-1] // g.head_dim)  # [query heads, r] one-hot
        if segment is not None and not isinstance(k_cache, jax.Array):
            raise UnsupportedModelError(f"{c.architecture}: a {type(k_cache).__name__} KV pool (kv_cache_dtype int8) "
                                        "scales each pool head as one, which here holds several heads of the layers' "
                                        "narrower head_dim; use kv_cache_dtype auto or fp8")
        slot, md = kv_layout.layer_view(step.md, step.kv_groups, jnp.int32(pool_layer), pool_layer)
        if not self.shared:
            k = _own_heads(ops.column_linear(x, value(self, "wk"), mm), g.head_dim, ops)  # [T, kv heads here, head_dim]
            v = k if self.k_is_v else _own_heads(ops.column_linear(x, value(self, "wv"), mm), g.head_dim, ops)
            k = attention_kinds.apply_table(self.norm(k, "k_norm"), step.md, table)
            repeat = heads // k.shape[1]
            k, v = (jnp.repeat(y, repeat, axis=1).reshape((num_tokens,) + k_cache.shape[-2:]) for y in (k, _rms(v, eps)))
            k_cache, v_cache = kernels.write_kv(k_cache, v_cache, slot, k, v, md.slot_mapping)
        window = c.sliding_window if self.layer_type == SLIDING else None
        if segment is not None:  # [T, H, hd] -> [T, H, hd_b], zero outside the head's segment
            q = jnp.where(segment[:, :, None], q[:, :, None], 0).reshape(num_tokens, q.shape[1], -1)
        attn = kernels.paged_attention(q, k_cache, v_cache, slot, md, scale=1.0, sliding_window=window)
        if segment is not None:  # each head's own segment
            attn = attn.reshape(num_tokens, q.shape[1], -1, g.head_dim)[:, np.arange(q.shape[1]), segment.argmax(1)]
        out = ops.row_linear(attn.reshape(num_tokens, -1), value(self, "wo"), mm)
        return out, k_cache, v_cache

    def mlp(self, x, step: Step):
        ops, mm = step.ops, step.kernels.matmul
        gate, up = (ops.column_linear(x, value(self, n), mm) for n in ("w_gate", "w_up"))
        return ops.row_linear(activation(self.config.hidden_act)(gate) * up, value(self, "w_down"), mm)

    def experts(self, r, step: Step):
        """The routed experts' output [T, embed] for the residual stream r [T, embed]."""
        c, x, kernels = self.config, self.x, step.kernels
        z = _rms(r, c.rms_norm_eps).astype(jnp.float32) * value(self, "router_scale").astype(jnp.float32)
        logits = jnp.dot(z * c.hidden_size ** -0.5, value(self, "router").astype(jnp.float32))  # [T, experts]
        ids, weights = softmax_topk(logits, x["top_k_experts"], True)
        weights = weights * value(self, "expert_scale").astype(jnp.float32)[ids]
        act = activation(c.hidden_act)
        local_ffn = lambda *a: expert_ffn(*a, act=act, impl=kernels.moe_impl, grouped=kernels.grouped_matmul)  # noqa: E731
        gate, up, down = (value(self, n) for n in ("experts_gate", "experts_up", "experts_down"))
        return step.ops.expert_ffn(local_ffn, self.norm(r, "moe_norm"), ids, weights, gate, up, down, num_tokens=step.md.query_start[-1])

    def __call__(self, h, k_cache, v_cache, ple, pool_layer: int, step: Step):
        """h [T, embed] through the layer -> (h, k_cache, v_cache); ple: its per-layer input [T, P] or None."""
        attn, k_cache, v_cache = self.attention(self.norm(h, "attn_norm"), k_cache, v_cache, pool_layer, step)
        h = h + self.norm(attn, "post_attn_norm")
        y = self.mlp(self.norm(h, "mlp_norm"), step)
        if hasattr(self, "router"):
            y = self.norm(y, "post_mlp_norm_1") + self.norm(self.experts(h, step), "post_moe_norm")
        h = h + self.norm(y, "post_mlp_norm")
        if ple is not None:  # replicated weights on this device's tokens (h's and ple's, split alike)
            mm = step.kernels.matmul
            gated = activation(self.config.hidden_act)(mm(h, value(self, "ple_gate"))) * ple
            h = h + self.norm(mm(gated, value(self, "ple_out")), "ple_post_norm")
        return h * value(self, "layer_scalar").astype(h.dtype), k_cache, v_cache


class Gemma4(nnx.Module):
    """The decoder: embedding (and per-layer embeddings), the layers by group, the final norm, the LM head."""

    def __init__(self, config: ModelConfig, layout: Layout = Layout()):
        c = self.config = config
        check_supported(c)
        self.plan = plan(c)
        p = ParamMaker()
        E, L = c.hidden_size, c.num_layers
        self.embed = p((c.vocab_size, E), ("vocab", "embed"))
        for (t, shared), group in GROUPS.items():
            n = sum(1 for i, ti in enumerate(self.plan.types) if ti == t and (i >= self.plan.num_pool_layers) == shared)
            if n:
                setattr(self, group, layer_group(lambda stack, t=t, shared=shared: Gemma4Layer(c, t, shared, stack), n, layout))
        P = c.extra.get("hidden_size_per_layer_input") or 0
        if P:
            self.ple_embed = p((c.extra.get("vocab_size_per_layer_input") or c.vocab_size, L * P), ("vocab", None))
            self.ple_proj = p((E, L * P), ("embed", None))
            self.ple_norm = p((P,), (None,))
        self.kv_groups = kv_layout.group_layers(kv_layer_windows(c))
        self.final_norm = p((E,), ("embed_norm",))
        self.lm_head = p((E, c.vocab_size), ("embed", "vocab"))  # tied embeddings: a copy of embed.T

    def per_layer_inputs(self, tokens, h0, step: Step):
        """ple [T, layers, P] from the tokens and the scaled token embedding h0 [T, embed] ([T / tp, ..] both
        under sequence parallelism: ops.embed splits the lookup as it splits h0; ple_proj is replicated)."""
        c, ops = self.config, step.ops
        P = c.extra["hidden_size_per_layer_input"]
        tok = ops.embed(value(self, "ple_embed"), tokens).astype(h0.dtype) * jnp.asarray(math.sqrt(P), h0.dtype)
        proj = step.kernels.matmul(h0, value(self, "ple_proj")) * jnp.asarray(c.hidden_size ** -0.5, h0.dtype)
        proj = rms_norm(proj.reshape(h0.shape[0], c.num_layers, P), value(self, "ple_norm"), c.rms_norm_eps)
        return (proj + tok.reshape(proj.shape)) * jnp.asarray(2 ** -0.5, h0.dtype)

    def __call__(self, tokens, k_cache, v_cache, md, kernels, ops):
        c, pl = self.config, self.plan
        if getattr(ops, "tp", 1) != c.extra.get(MESH_TP, 1):
            raise UnsupportedModelError(f"{c.architecture} runs on tp={getattr(ops, 'tp', 1)} only with the config of "
                                        "gemma4.mesh_config(config, tp), which ShardingPlan takes as its mesh_config "
                                        "argument; build the plan with it")
        step = Step(md, kernels, ops, rope_tables(c), self.kv_groups)
        final_norm = value(self, "final_norm")
        h = ops.embed(value(self, "embed"), tokens).astype(final_norm.dtype)
        h = h * jnp.asarray(math.sqrt(c.hidden_size), h.dtype)  # [T, embed]
        ple = self.per_layer_inputs(tokens, h, step) if hasattr(self, "ple_embed") else None  # [T, layers, P]
        for i, t in enumerate(pl.types):
            layer = layer_at(getattr(self, GROUPS[(t, i >= pl.num_pool_layers)]), pl.group_index[i])
            h, k_cache, v_cache = layer(h, k_cache, v_cache, None if ple is None else ple[:, i], pl.producer[i], step)
        h = rms_norm(h, final_norm, c.rms_norm_eps)
        return ops.gather_sequence(h), k_cache, v_cache

    def logits(self, hidden, kernels, ops):
        logits = ops.lm_head(hidden, value(self, "lm_head"), kernels.matmul)
        cap = self.config.extra.get("final_logit_softcapping")
        return logits if not cap else cap * jnp.tanh(logits / cap)


_GROUP_NAMES = tuple(GROUPS.values())


def param_shapes(config: ModelConfig, layout: Layout = Layout()):
    return module.param_shapes(Gemma4(config, layout))


def param_axes(config: ModelConfig, layout: Layout = Layout()):
    return module.param_axes(Gemma4(config, layout))


def init_params(config: ModelConfig, key, dtype=jnp.bfloat16):
    return module.random_params(param_shapes(config), key, dtype)


def forward(params, config, tokens, k_cache, v_cache, md, kernels, ops):
    return module.bind(Gemma4(config, layout_of(params, _GROUP_NAMES)), params)(tokens, k_cache, v_cache, md, kernels, ops)


def compute_logits(params, config, hidden, kernels, ops):
    return module.bind(Gemma4(config, layout_of(params, _GROUP_NAMES)), params).logits(hidden, kernels, ops)


def kv_layer_windows(config: ModelConfig) -> tuple[int | None, ...]:
    """The sliding window of each pool layer (the non-shared layers; None: full attention)."""
    p = plan(config)
    return tuple(config.sliding_window if t == SLIDING else None for t in p.types[:p.num_pool_layers])


def kv_cache_shapes(config: ModelConfig, num_pages: int, page_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """[pool layers, pages, page_size, W / hd_b, hd_b] each (the module docstring's pool, never reshaped)."""
    g = base_geometry(config)
    shape = (plan(config).num_pool_layers, num_pages, page_size, pool_width(config) // g.head_dim, g.head_dim)
    return shape, shape
