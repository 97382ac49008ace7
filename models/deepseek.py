"""DeepSeek-V2 / V3: multi-head latent attention (MLA) over a compressed cache, and DeepSeekMoE.

MLA: keys and values of all heads come from one normalised latent c (kv_lora_rank values per
token) plus one RoPE key shared by the heads (qk_rope_head_dim values). The cache stores only
[c, k_rope]; the K up-projection is absorbed into the query and the V up-projection into the
output (`kernels.write_latent` and `kernels.latent_attention`, pallas_kernels/mla_reference.py), so
nothing per-head is ever cached or expanded.

MLP: the first `first_k_dense_replace` layers are dense (their own "dense_layers" stack, run
first); the rest are MoE layers with `n_shared_experts` always-on experts plus routed
ones: V2 softmax scores with greedy / group-limited top-k, V3 sigmoid scores with the
e_score_correction_bias and group-limited top-k (noaux_tc), both times routed_scaling_factor.
Each stack runs under lax.scan, or unrolled over per-layer weights after `unstack_layers`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jlight.core.parallel_ops import ParallelOps
from jlight.core.batch_metadata import BatchMetadata
from jlight.core.config import ModelConfig
from jlight.core.quantization import QuantizedWeight, dequantize
from jlight.models import llama
from jlight.models.layers import activation, rms_norm, run_layers, split_layers
from jlight.models.moe import deepseek_v2_topk, deepseek_v3_topk, expert_ffn
from jlight.models.rope import apply_rope, inv_frequencies
from jlight.models.rope_yarn import softmax_scale_multiplier, yarn_inv_frequencies

compute_logits = llama.compute_logits


def mla_settings(config: ModelConfig) -> dict:
    """MLA and MoE hyper-parameters, with the HF defaults of each version."""
    x = config.extra
    v3 = config.architecture == "DeepseekV3ForCausalLM"
    s = dict(
        v3=v3,
        q_lora_rank=x.get("q_lora_rank", 1536),
        kv_lora_rank=x.get("kv_lora_rank", 512),
        nope_dim=x.get("qk_nope_head_dim", 128),
        rope_dim=x.get("qk_rope_head_dim", 64),
        v_dim=x.get("v_head_dim", 128),
        num_experts=x.get("n_routed_experts") or x.get("num_experts") or (256 if v3 else 64),
        top_k=x.get("num_experts_per_tok") or 8,
        expert_size=x.get("moe_intermediate_size") or (2048 if v3 else 1407),
        num_shared=x.get("n_shared_experts", 1 if v3 else 2) or 0,
        num_dense=x.get("first_k_dense_replace", 3 if v3 else 0) or 0,
        topk_method=x.get("topk_method") or ("noaux_tc" if v3 else "greedy"),
        num_groups=x.get("n_group") or (8 if v3 else 1),
        topk_group=x.get("topk_group") or (4 if v3 else 1),
        normalize=bool(x.get("norm_topk_prob", v3)),
        scaling=float(x.get("routed_scaling_factor", 2.5 if v3 else 1.0)),
        interleaved_rope=bool(x.get("rope_interleave", True)),
    )
    if not 0 <= s["num_dense"] < config.num_layers:
        raise ValueError(
            f"first_k_dense_replace={s['num_dense']} must be in [0, num_hidden_layers={config.num_layers}); "
            "fix the model's config.json")
    if s["num_experts"] % s["num_groups"]:
        raise ValueError(f"n_routed_experts={s['num_experts']} is not divisible by n_group={s['num_groups']}; fix config.json")
    return s


def _group_shapes(config, s, n: int, moe: bool) -> dict:
    """Shapes of one stack of n layers (dense MLP or MoE)."""
    E, H = config.hidden_size, config.num_heads
    C, R, qk = s["kv_lora_rank"], s["rope_dim"], s["nope_dim"] + s["rope_dim"]
    g = {"attn_norm": (n, E), "mlp_norm": (n, E), "wkv_a": (n, E, C + R), "kv_a_norm": (n, C),
         "wkv_b": (n, C, H * (s["nope_dim"] + s["v_dim"])), "wo": (n, H * s["v_dim"], E)}
    if s["q_lora_rank"]:
        g.update(wq_a=(n, E, s["q_lora_rank"]), q_a_norm=(n, s["q_lora_rank"]), wq_b=(n, s["q_lora_rank"], H * qk))
    else:
        g.update(wq=(n, E, H * qk))
    if moe:
        X, F, S = s["num_experts"], s["expert_size"], s["expert_size"] * s["num_shared"]
        g.update(router=(n, E, X), experts_gate=(n, X, E, F), experts_up=(n, X, E, F), experts_down=(n, X, F, E))
        if s["v3"]:
            g.update(router_bias=(n, X))
        if S:
            g.update(shared_gate=(n, E, S), shared_up=(n, E, S), shared_down=(n, S, E))
    else:
        F = config.intermediate_size
        g.update(w_gate=(n, E, F), w_up=(n, E, F), w_down=(n, F, E))
    return g


_AXES = {
    "attn_norm": ("embed_norm",), "mlp_norm": ("embed_norm",), "wkv_a": ("embed", "kv_lora"),
    "kv_a_norm": ("kv_lora",), "wkv_b": ("kv_lora", "heads"), "wo": ("heads", "embed"),
    "wq_a": ("embed", "q_lora"), "q_a_norm": ("q_lora",), "wq_b": ("q_lora", "heads"), "wq": ("embed", "heads"),
    "router": ("embed", "router"), "router_bias": ("router",),
    "experts_gate": ("experts", "embed", "mlp"), "experts_up": ("experts", "embed", "mlp"),
    "experts_down": ("experts", "mlp", "embed"),
    "shared_gate": ("embed", "mlp"), "shared_up": ("embed", "mlp"), "shared_down": ("mlp", "embed"),
    "w_gate": ("embed", "mlp"), "w_up": ("embed", "mlp"), "w_down": ("mlp", "embed"),
}


def param_shapes(config: ModelConfig) -> dict:
    s = mla_settings(config)
    V, E, k = config.vocab_size, config.hidden_size, s["num_dense"]
    shapes = {"embed": (V, E)}
    if k:
        shapes["dense_layers"] = _group_shapes(config, s, k, moe=False)
    shapes["layers"] = _group_shapes(config, s, config.num_layers - k, moe=True)
    shapes.update(final_norm=(E,), lm_head=(E, V))
    return shapes


def param_axes(config: ModelConfig) -> dict:
    shapes = param_shapes(config)
    axes = {"embed": ("vocab", "embed"), "final_norm": ("embed_norm",), "lm_head": ("embed", "vocab")}
    for group in ("dense_layers", "layers"):
        if group in shapes:
            axes[group] = {name: ("layers",) + _AXES[name] for name in shapes[group]}
    return axes


def kv_cache_shapes(config: ModelConfig, num_pages: int, page_size: int):
    """K pool: [layers, pages, page_size, 1, kv_lora_rank + qk_rope_head_dim] latents; V pool unused."""
    s = mla_settings(config)
    return (config.num_layers, num_pages, page_size, 1, s["kv_lora_rank"] + s["rope_dim"]), (config.num_layers, 1, 1, 1, 1)


def _rope(config: ModelConfig, s: dict):
    scaling = config.rope_scaling
    if scaling and scaling.get("rope_type", scaling.get("type")) == "yarn":
        return yarn_inv_frequencies(s["rope_dim"], config.rope_theta, scaling, config.max_position_embeddings)
    return inv_frequencies(s["rope_dim"], config.rope_theta, scaling)


def _as_array(w, dtype):
    return dequantize(w, dtype) if isinstance(w, QuantizedWeight) else w.astype(dtype)


def mla_attention(c, s, lp, x, cache, layer_idx, md: BatchMetadata, kernels, ops: ParallelOps, rope, scale):
    """x: [T, embed] (normed) -> ([T, embed], cache)."""
    mm = kernels.matmul
    num_tokens = md.positions.shape[0]  # not x.shape[0]: under collective matmul x may be split on tokens
    C, nope = s["kv_lora_rank"], s["nope_dim"]
    # Under sequence parallelism x holds only this device's T/tp tokens. The replicated low-rank
    # projections (wq_a, wkv_a) are row-wise, so each device runs them on its own tokens and the
    # narrow results, not x, are made whole: the query latent by column_linear's all-gather into
    # wq_b, the KV latent by gather_sequence (kv_lora_rank + rope values a token instead of embed).
    if s["q_lora_rank"]:
        q = ops.column_linear(rms_norm(mm(x, lp["wq_a"]), lp["q_a_norm"], c.rms_norm_eps), lp["wq_b"], mm)
    else:
        q = ops.column_linear(x, lp["wq"], mm)
    q = q.reshape(num_tokens, -1, nope + s["rope_dim"])  # [T, local heads, nope + rope]
    q_nope, q_rope = q[..., :nope], q[..., nope:]
    kv = ops.gather_sequence(mm(x, lp["wkv_a"]))  # [T, C + rope]: one latent shared by all heads
    latent = rms_norm(kv[:, :C], lp["kv_a_norm"], c.rms_norm_eps)
    k_rope = kv[:, None, C:]  # [T, 1, rope]
    if s["interleaved_rope"]:
        # DeepSeek rotates adjacent pairs (0,1),(2,3)...; de-interleaving q and k the same way
        # turns that into the rotate-half layout without changing any q.k product.
        q_rope = jnp.concatenate([q_rope[..., 0::2], q_rope[..., 1::2]], axis=-1)
        k_rope = jnp.concatenate([k_rope[..., 0::2], k_rope[..., 1::2]], axis=-1)
    inv_freq, rope_factor = rope
    q_rope = apply_rope(q_rope, md.positions, inv_freq, rope_factor)
    k_rope = apply_rope(k_rope, md.positions, inv_freq, rope_factor)
    cache = kernels.write_latent(cache, layer_idx, jnp.concatenate([latent, k_rope[:, 0]], axis=-1), md.slot_mapping)
    w_kv_b = _as_array(lp["wkv_b"], q.dtype).reshape(C, -1, nope + s["v_dim"])  # [C, local heads, nope + v]
    q_latent = jnp.einsum("thd,chd->thc", q_nope, w_kv_b[..., :nope])  # K up-projection absorbed: [T, heads, C]
    out_latent = kernels.latent_attention(q_latent, q_rope, cache, layer_idx, md, scale=scale)
    out = jnp.einsum("thc,chd->thd", out_latent, w_kv_b[..., nope:])  # V up-projection: [T, heads, v]
    return ops.row_linear(out.reshape(num_tokens, -1), lp["wo"], mm), cache


def _dense_mlp(c, lp, x, mm, ops: ParallelOps, prefix=""):
    act = activation(c.hidden_act)
    gate = ops.column_linear(x, lp[prefix + "gate"], mm)
    up = ops.column_linear(x, lp[prefix + "up"], mm)
    return ops.row_linear(act(gate) * up, lp[prefix + "down"], mm)


def moe_mlp(c, s, lp, x, kernels, ops: ParallelOps):
    """Shared experts plus routed experts. x: [T, embed] -> [T, embed]."""
    logits = jnp.dot(x.astype(jnp.float32), lp["router"].astype(jnp.float32))  # [T, experts], float32 as HF
    if s["v3"]:
        ids, weights = deepseek_v3_topk(logits, lp["router_bias"], s["top_k"], num_groups=s["num_groups"],
                                        topk_group=s["topk_group"], normalize=s["normalize"], scaling=s["scaling"])
    else:
        ids, weights = deepseek_v2_topk(logits, s["top_k"], method=s["topk_method"], num_groups=s["num_groups"],
                                        topk_group=s["topk_group"], normalize=s["normalize"], scaling=s["scaling"])
    local_ffn = functools.partial(expert_ffn, act=activation(c.hidden_act), impl=kernels.moe_impl,
                                  grouped=kernels.grouped_matmul)
    out = ops.expert_ffn(local_ffn, x, ids, weights, lp["experts_gate"], lp["experts_up"], lp["experts_down"])
    if s["num_shared"]:
        out = out + _dense_mlp(c, lp, x, kernels.matmul, ops, prefix="shared_")
    return out


def forward(params: dict, config: ModelConfig, tokens, k_cache, v_cache, md: BatchMetadata, kernels, ops: ParallelOps):
    """tokens: [T] int32 -> (hidden [T, embed] after the final norm, k_cache, v_cache).

    k_cache is the latent pool of kv_cache_shapes; v_cache is passed through untouched.
    """
    c = config
    s = mla_settings(c)
    rope = _rope(c, s)
    scale = (s["nope_dim"] + s["rope_dim"]) ** -0.5 * softmax_scale_multiplier(c.rope_scaling, c.max_position_embeddings)

    def make_layer(moe: bool):
        def layer(carry, xs):
            h, cache = carry
            lp, layer_idx = xs
            attn, cache = mla_attention(c, s, lp, rms_norm(h, lp["attn_norm"], c.rms_norm_eps), cache, layer_idx, md, kernels, ops, rope, scale)
            h = h + attn
            x = rms_norm(h, lp["mlp_norm"], c.rms_norm_eps)
            h = h + (moe_mlp(c, s, lp, x, kernels, ops) if moe else _dense_mlp(c, lp, x, kernels.matmul, ops, prefix="w_"))
            return (h, cache), None
        return layer

    h = ops.embed(params["embed"], tokens).astype(params["final_norm"].dtype)  # [T, embed]
    k = s["num_dense"]
    if k:
        h, k_cache = run_layers(make_layer(False), (h, k_cache), params["dense_layers"], 0)
    h, k_cache = run_layers(make_layer(True), (h, k_cache), params["layers"], k)
    h = rms_norm(h, params["final_norm"], c.rms_norm_eps)
    h = ops.gather_sequence(h)
    return h, k_cache, v_cache


def unstack_layers(params: dict, donate: bool = False) -> dict:
    """Per-layer weights of both stacks (dense and MoE) for the unrolled forward (GPU default, see
    llama.unstack_layers). donate=True frees each stacked weight as it is split."""
    out = dict(params, layers=split_layers(params["layers"], donate))
    if "dense_layers" in params:
        out["dense_layers"] = split_layers(params["dense_layers"], donate)
    return out


def init_params(config: ModelConfig, key: jax.Array, dtype=jnp.bfloat16) -> dict:
    """Random weights of this family's shapes (for benchmarks; no checkpoint needed)."""
    return llama.random_params(param_shapes(config), key, dtype)
