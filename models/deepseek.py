"""DeepSeek-V2 / V3: multi-head latent attention (MLA) over a compressed cache, and DeepSeekMoE.

MLA: keys and values of all heads come from one normalised latent c (kv_lora_rank values per
token) plus one RoPE key shared by the heads (qk_rope_head_dim values). The cache stores only
[c, k_rope]; the K up-projection is absorbed into the query and the V up-projection into the
output (`kernels.write_latent` and `kernels.latent_attention`, pallas_kernels/mla_reference.py), so
nothing per-head is ever cached or expanded.

MLP: the first `first_k_dense_replace` layers are dense (their own "dense_layers" group, run
first); the rest are MoE layers with `n_shared_experts` always-on experts plus routed
ones: V2 softmax scores with greedy / group-limited top-k, V3 sigmoid scores with the
e_score_correction_bias and group-limited top-k (noaux_tc), both times routed_scaling_factor.
Flax NNX modules as llama.py's (`DeepSeekLayer`, `DeepSeek`); each group of layers runs under
lax.scan over stacked weights, or unrolled over per-layer weights.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
from flax import nnx

from jlight.core.config import ModelConfig
from jlight.core.quantization import QuantizedWeight, dequantize
from jlight.models import llama
# unstack_layers is part of this family's interface (the engine's unrolled layers); the engine does
# not fuse its projections (no fuse_projections here).
from jlight.models.layers import activation, rms_norm, unstack_layers  # noqa: F401
from jlight.models.module import Layout, ParamMaker, Step, declare, family_functions, layer_group, run_layers, value
from jlight.models.moe import deepseek_v2_topk, deepseek_v3_topk, expert_ffn
from jlight.models.rope import apply_rope, inv_frequencies
from jlight.models.rope_yarn import softmax_scale_multiplier, yarn_inv_frequencies


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


class DeepSeekLayer(nnx.Module):
    """One layer: MLA attention, then a dense gated MLP (moe=False) or the shared and routed experts."""

    def __init__(self, config: ModelConfig, stack: int | None, moe: bool):
        c = self.config = config
        s = mla_settings(c)
        self.moe = moe
        p = ParamMaker(stack)
        E, H = c.hidden_size, c.num_heads
        C, R, qk = s["kv_lora_rank"], s["rope_dim"], s["nope_dim"] + s["rope_dim"]
        self.attn_norm = p((E,), ("embed_norm",))
        if s["q_lora_rank"]:
            Q = s["q_lora_rank"]
            declare(self, dict(wq_a=p((E, Q), ("embed", "q_lora")), q_a_norm=p((Q,), ("q_lora",)), wq_b=p((Q, H * qk), ("q_lora", "heads"))))
        else:
            self.wq = p((E, H * qk), ("embed", "heads"))
        self.wkv_a = p((E, C + R), ("embed", "kv_lora"))
        self.kv_a_norm = p((C,), ("kv_lora",))
        self.wkv_b = p((C, H * (s["nope_dim"] + s["v_dim"])), ("kv_lora", "heads"))
        self.wo = p((H * s["v_dim"], E), ("heads", "embed"))
        self.mlp_norm = p((E,), ("embed_norm",))
        if not moe:
            F = c.intermediate_size
            declare(self, dict(w_gate=p((E, F), ("embed", "mlp")), w_up=p((E, F), ("embed", "mlp")), w_down=p((F, E), ("mlp", "embed"))))
            return
        X, F, S = s["num_experts"], s["expert_size"], s["expert_size"] * s["num_shared"]
        self.router = p((E, X), ("embed", "router"))
        if s["v3"]:
            self.router_bias = p((X,), ("router",))
        self.experts_gate = p((X, E, F), ("experts", "embed", "mlp"))
        self.experts_up = p((X, E, F), ("experts", "embed", "mlp"))
        self.experts_down = p((X, F, E), ("experts", "mlp", "embed"))
        if S:
            declare(self, dict(shared_gate=p((E, S), ("embed", "mlp")), shared_up=p((E, S), ("embed", "mlp")),
                               shared_down=p((S, E), ("mlp", "embed"))))

    def attention(self, x, cache, layer_idx, step: Step):
        """x: [T, embed] (normed) -> ([T, embed], cache)."""
        c, ops, kernels, md = self.config, step.ops, step.kernels, step.md
        s = mla_settings(c)
        mm = kernels.matmul
        num_tokens = md.positions.shape[0]  # not x.shape[0]: under collective matmul x may be split on tokens
        C, nope = s["kv_lora_rank"], s["nope_dim"]
        # Under sequence parallelism x holds only this device's T/tp tokens. The replicated low-rank
        # projections (wq_a, wkv_a) are row-wise, so each device runs them on its own tokens and the
        # narrow results, not x, are made whole: the query latent by column_linear's all-gather into
        # wq_b, the KV latent by gather_sequence (kv_lora_rank + rope values a token instead of embed).
        if s["q_lora_rank"]:
            q_latent = rms_norm(mm(x, value(self, "wq_a")), value(self, "q_a_norm"), c.rms_norm_eps)
            q = ops.column_linear(q_latent, value(self, "wq_b"), mm)
        else:
            q = ops.column_linear(x, value(self, "wq"), mm)
        q = q.reshape(num_tokens, -1, nope + s["rope_dim"])  # [T, local heads, nope + rope]
        q_nope, q_rope = q[..., :nope], q[..., nope:]
        kv = ops.gather_sequence(mm(x, value(self, "wkv_a")))  # [T, C + rope]: one latent shared by all heads
        latent = rms_norm(kv[:, :C], value(self, "kv_a_norm"), c.rms_norm_eps)
        k_rope = kv[:, None, C:]  # [T, 1, rope]
        if s["interleaved_rope"]:
            # DeepSeek rotates adjacent pairs (0,1),(2,3)...; de-interleaving q and k the same way
            # turns that into the rotate-half layout without changing any q.k product.
            q_rope = jnp.concatenate([q_rope[..., 0::2], q_rope[..., 1::2]], axis=-1)
            k_rope = jnp.concatenate([k_rope[..., 0::2], k_rope[..., 1::2]], axis=-1)
        inv_freq, rope_factor = step.rope
        q_rope = apply_rope(q_rope, md.positions, inv_freq, rope_factor)
        k_rope = apply_rope(k_rope, md.positions, inv_freq, rope_factor)
        cache = kernels.write_latent(cache, layer_idx, jnp.concatenate([latent, k_rope[:, 0]], axis=-1), md.slot_mapping)
        w_kv_b = _as_array(value(self, "wkv_b"), q.dtype).reshape(C, -1, nope + s["v_dim"])  # [C, local heads, nope + v]
        q_latent = jnp.einsum("thd,chd->thc", q_nope, w_kv_b[..., :nope])  # K up-projection absorbed: [T, heads, C]
        out_latent = kernels.latent_attention(q_latent, q_rope, cache, layer_idx, md, scale=softmax_scale(c, s))
        out = jnp.einsum("thc,chd->thd", out_latent, w_kv_b[..., nope:])  # V up-projection: [T, heads, v]
        return ops.row_linear(out.reshape(num_tokens, -1), value(self, "wo"), mm), cache

    def _dense_mlp(self, x, step: Step, prefix: str):
        ops, mm = step.ops, step.kernels.matmul
        gate = ops.column_linear(x, value(self, prefix + "gate"), mm)
        up = ops.column_linear(x, value(self, prefix + "up"), mm)
        return ops.row_linear(activation(self.config.hidden_act)(gate) * up, value(self, prefix + "down"), mm)

    def moe_mlp(self, x, step: Step):
        """Shared experts plus routed experts. x: [T, embed] -> [T, embed]."""
        c, ops, kernels = self.config, step.ops, step.kernels
        s = mla_settings(c)
        logits = jnp.dot(x.astype(jnp.float32), value(self, "router").astype(jnp.float32))  # [T, experts], float32 as HF
        if s["v3"]:
            ids, weights = deepseek_v3_topk(logits, value(self, "router_bias"), s["top_k"], num_groups=s["num_groups"],
                                            topk_group=s["topk_group"], normalize=s["normalize"], scaling=s["scaling"])
        else:
            ids, weights = deepseek_v2_topk(logits, s["top_k"], method=s["topk_method"], num_groups=s["num_groups"],
                                            topk_group=s["topk_group"], normalize=s["normalize"], scaling=s["scaling"])
        local_ffn = functools.partial(expert_ffn, act=activation(c.hidden_act), impl=kernels.moe_impl,
                                      grouped=kernels.grouped_matmul)
        out = ops.expert_ffn(local_ffn, x, ids, weights, *(value(self, n) for n in ("experts_gate", "experts_up", "experts_down")),
                             num_tokens=step.md.query_start[-1])
        if s["num_shared"]:
            out = out + self._dense_mlp(x, step, "shared_")
        return out

    def __call__(self, h, cache, layer_idx, step: Step):
        """The residual stream h [T, embed] through one layer -> (h, cache)."""
        eps = self.config.rms_norm_eps
        attn, cache = self.attention(rms_norm(h, value(self, "attn_norm"), eps), cache, layer_idx, step)
        h = h + attn
        x = rms_norm(h, value(self, "mlp_norm"), eps)
        return h + (self.moe_mlp(x, step) if self.moe else self._dense_mlp(x, step, "w_")), cache


class DeepSeek(llama.Llama):
    """The decoder: embedding, the dense layers' group (if any), the MoE layers, final norm, LM head
    (Llama's `logits`)."""

    def __init__(self, config: ModelConfig, layout: Layout = Layout()):
        c = self.config = config
        k = mla_settings(c)["num_dense"]
        p = ParamMaker()
        self.embed = p((c.vocab_size, c.hidden_size), ("vocab", "embed"))
        if k:
            self.dense_layers = layer_group(lambda stack: DeepSeekLayer(c, stack, moe=False), k, layout)
        self.layers = layer_group(lambda stack: DeepSeekLayer(c, stack, moe=True), c.num_layers - k, layout)
        self.final_norm = p((c.hidden_size,), ("embed_norm",))
        self.lm_head = p((c.hidden_size, c.vocab_size), ("embed", "vocab"))

    def __call__(self, tokens, k_cache, v_cache, md, kernels, ops):
        """tokens: [T] int32 -> (hidden [T, embed] after the final norm, k_cache, v_cache).

        k_cache is the latent pool of kv_cache_shapes; v_cache is passed through untouched.
        """
        c = self.config
        s = mla_settings(c)
        step = Step(md, kernels, ops, rope_table(c, s))
        final_norm = value(self, "final_norm")
        h = ops.embed(value(self, "embed"), tokens).astype(final_norm.dtype)  # [T, embed]
        if s["num_dense"]:
            h, k_cache = run_layers(self.dense_layers, (h, k_cache), step, 0)
        h, k_cache = run_layers(self.layers, (h, k_cache), step, s["num_dense"])
        h = rms_norm(h, final_norm, c.rms_norm_eps)
        return ops.gather_sequence(h), k_cache, v_cache


param_shapes, param_axes, init_params, forward, compute_logits = family_functions(DeepSeek)


def kv_cache_shapes(config: ModelConfig, num_pages: int, page_size: int):
    """K pool: [layers, pages, page_size, 1, kv_lora_rank + qk_rope_head_dim] latents; V pool unused."""
    s = mla_settings(config)
    return (config.num_layers, num_pages, page_size, 1, s["kv_lora_rank"] + s["rope_dim"]), (config.num_layers, 1, 1, 1, 1)


def rope_table(config: ModelConfig, s: dict):
    """The MLA RoPE (inv_freq, attention factor) of the decoder's layers (and its MTP layer's)."""
    scaling = config.rope_scaling
    if scaling and scaling.get("rope_type", scaling.get("type")) == "yarn":
        return yarn_inv_frequencies(s["rope_dim"], config.rope_theta, scaling, config.max_position_embeddings)
    return inv_frequencies(s["rope_dim"], config.rope_theta, scaling)


def softmax_scale(config: ModelConfig, s: dict) -> float:
    """The attention's softmax scale: 1/sqrt(q.k dims), times DeepSeek's YaRN mscale^2."""
    return (s["nope_dim"] + s["rope_dim"]) ** -0.5 * softmax_scale_multiplier(config.rope_scaling, config.max_position_embeddings)


def _as_array(w, dtype):
    return dequantize(w, dtype) if isinstance(w, QuantizedWeight) else w.astype(dtype)
