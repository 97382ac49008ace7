"""Named model shapes for benchmarks, and models with random weights built from them.

No checkpoint is needed: the weights are random of the right shape and scale, which is
all a dense model's speed measurement needs. A MoE model's also depends on how its router spreads the
tokens over the experts, which the weights decide: `init` picks jlight's normal weights or vLLM's dummy ones.

NAMED_CONFIGS: Llama-family shapes (ModelConfig fields). MOE_CONFIGS: Mixtral- and
DeepSeek-V3-shaped MoE models as HF config.json dicts, at the real models' layer counts;
benchmarks cut the layers (`make_config(name, num_layers=...)`) so the weights fit a GPU.
FAMILY_CONFIGS: Gemma-3-12B, gpt-oss-20b and Qwen3-Next (16 of its 48 layers) shapes as HF config.json
dicts (family_shapes.py, which the vLLM peer vllm_families.py reads too), and tiny dims of each family.
"""
from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp

from jlight.core.config import ModelConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import family_shapes  # noqa: E402

NAMED_CONFIGS = {
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                      num_kv_heads=8, head_dim=128, rope_theta=500000.0),
    "llama3-70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
                       num_kv_heads=8, head_dim=128, rope_theta=500000.0),
    "llama3-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                      num_kv_heads=8, head_dim=64, rope_theta=500000.0),
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                         num_kv_heads=3, head_dim=64, rope_theta=100000.0),
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=8,
                 num_kv_heads=2, head_dim=16),
}


_MIXTRAL = dict(architectures=["MixtralForCausalLM"], model_type="mixtral", max_position_embeddings=32768,
                rope_theta=1e6, rms_norm_eps=1e-5)
_DEEPSEEK_V3 = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", max_position_embeddings=163840,
                    rms_norm_eps=1e-6, routed_scaling_factor=2.5, norm_topk_prob=True, topk_method="noaux_tc",
                    rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32,
                                      beta_slow=1, mscale=1.0, mscale_all_dim=1.0))


def _deepseek_v3(**fields) -> dict:
    return dict(fields, **_DEEPSEEK_V3, num_key_value_heads=fields["num_attention_heads"])  # MLA: one latent, all heads


MOE_CONFIGS = {
    # Mixtral-8x7B: 32 layers (~2.9 GB each in bf16: 8 experts of 3 x 4096 x 14336).
    "mixtral-8x7b": dict(_MIXTRAL, vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2),
    # DeepSeek-V3: 3 dense + 58 MoE layers; a MoE layer is ~22.5 GB of routed experts in bf16
    # (256 x 3 x 7168 x 2048), a dense layer ~1.2 GB, the embedding and LM head ~1.85 GB each.
    "deepseek-v3": _deepseek_v3(vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_hidden_layers=61,
                                num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                                qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, num_experts_per_tok=8,
                                moe_intermediate_size=2048, n_shared_experts=1, first_k_dense_replace=3, n_group=8,
                                topk_group=4),
    # Tiny dims of the same families (CPU smoke runs).
    "tiny-mixtral": dict(_MIXTRAL, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2),
    "tiny-deepseek-v3": _deepseek_v3(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                     num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                                     qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=16, num_experts_per_tok=4,
                                     moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=4,
                                     topk_group=2),
}


def _tiny(name: str, num_layers: int, **fields) -> dict:
    """Tiny dims of a family_shapes config (CPU smoke runs): its layer pattern over num_layers layers."""
    return dict(family_shapes.with_layers(family_shapes.SHAPES[name], num_layers), vocab_size=512, hidden_size=64,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, **fields)


FAMILY_CONFIGS = {
    **family_shapes.SHAPES,
    # Gemma 3: 6 layers (5 local : 1 global), an 8-token window so short prompts pass it.
    "tiny-gemma3": _tiny("gemma3-12b", 6, intermediate_size=128, sliding_window=8, query_pre_attn_scalar=16),
    # gpt-oss: 2 layers (window, full), 8 experts top-2 with biases and sinks, YaRN.
    "tiny-gpt-oss": _tiny("gpt-oss-20b", 2, intermediate_size=32, sliding_window=8, num_local_experts=8,
                          num_experts_per_tok=2, experts_per_token=2),
    # Qwen3-Next: 4 layers (3 DeltaNet : 1 gated attention), 16 experts top-4 and a shared expert.
    "tiny-qwen3-next": _tiny("qwen3-next-16l", 4, intermediate_size=128, linear_num_key_heads=2, linear_num_value_heads=4,
                             linear_key_head_dim=16, linear_value_head_dim=16, num_experts=16, num_experts_per_tok=4,
                             moe_intermediate_size=32, shared_expert_intermediate_size=32),
    # Gemma 4 text, small but with its real head dims (sliding 256, full 512 through the Triton attention kernel on a
    # GPU), per-layer embeddings, KV sharing with 2x MLPs and the final soft-cap: a smoke shape, not a release's.
    "gemma4-smoke": dict(
        architectures=["Gemma4ForCausalLM"], model_type="gemma4_text", vocab_size=4096, hidden_size=512,
        intermediate_size=1024, num_hidden_layers=10, num_attention_heads=8, num_key_value_heads=1, head_dim=256,
        global_head_dim=512, layer_types=["sliding_attention" if (i + 1) % 5 else "full_attention" for i in range(10)],
        sliding_window=512, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0}},
        hidden_size_per_layer_input=64, vocab_size_per_layer_input=4096, num_kv_shared_layers=4,
        use_double_wide_mlp=True, final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh",
        rms_norm_eps=1e-6, max_position_embeddings=8192, tie_word_embeddings=True, attention_k_eq_v=False),
}

# Named HF config.json dicts (make_config reads them through ModelConfig.from_hf_dict).
HF_CONFIGS = {**MOE_CONFIGS, **FAMILY_CONFIGS}

CONFIG_NAMES = sorted(NAMED_CONFIGS) + sorted(HF_CONFIGS)


def make_config(name: str, max_position_embeddings: int | None = None, num_layers: int | None = None,
                num_dense_layers: int | None = None) -> ModelConfig:
    """The ModelConfig of a named shape. max_position_embeddings: default 8192 for the Llama shapes,
    the HF value for the others. num_layers cuts (or extends) the layer count (a config with layer_types
    keeps its family's pattern of layer kinds); for DeepSeek the
    first num_dense_layers stay dense (default: the real model's first_k_dense_replace, at most
    num_layers - 1, so at least one MoE layer remains)."""
    if name in HF_CONFIGS:
        cfg = dict(HF_CONFIGS[name])
        if max_position_embeddings is not None:
            cfg["max_position_embeddings"] = max_position_embeddings
        if num_layers is not None:
            cfg = family_shapes.with_layers(cfg, num_layers) if "layer_types" in cfg else dict(cfg, num_hidden_layers=num_layers)
        if "first_k_dense_replace" in cfg:
            if num_dense_layers is None:
                num_dense_layers = min(cfg["first_k_dense_replace"], cfg["num_hidden_layers"] - 1)
            cfg["first_k_dense_replace"] = num_dense_layers
        elif num_dense_layers:
            raise ValueError(f"model config {name!r} has no dense layers to set; drop num_dense_layers")
        return ModelConfig.from_hf_dict(cfg)
    if name not in NAMED_CONFIGS:
        raise ValueError(f"unknown model config {name!r}; choose one of {', '.join(CONFIG_NAMES)}")
    if num_dense_layers:
        raise ValueError(f"model config {name!r} is a dense Llama shape; num_dense_layers applies to DeepSeek shapes only")
    fields = dict(NAMED_CONFIGS[name])
    if num_layers is not None:
        fields["num_layers"] = num_layers
    return ModelConfig(architecture="LlamaForCausalLM", max_position_embeddings=max_position_embeddings or 8192,
                       rms_norm_eps=1e-5, **fields)


INITS = ("normal", "vllm-dummy")


def vllm_dummy_params(shapes, key):
    """vLLM's load_format="dummy" weights for a tree of arrays' shapes (jax.ShapeDtypeStruct leaves): every
    floating array uniform in [-1e-3, 1e-3), norms and biases too (vllm/model_executor/model_loader/weight_utils.py,
    initialize_dummy_weights). Under them a router with a bias (gpt-oss, DeepSeek-V3's correction bias) routes
    every token to the same top_k experts: the normed hidden states are ~1e-3 of unit size, so the logits'
    token-dependent part (~2e-5) is far below the bias's spread (~6e-4), and a full batch reads top_k experts
    a layer instead of all of them. A benchmark beside vLLM's dummy run gives jlight these weights to do the
    same work."""
    leaves, tree = jax.tree.flatten(shapes)
    keys = jax.random.split(key, max(len(leaves), 1))
    out = [jax.random.uniform(k, s.shape, jnp.float32, -1e-3, 1e-3).astype(s.dtype)
           if jnp.issubdtype(s.dtype, jnp.floating) else jnp.zeros(s.shape, s.dtype) for k, s in zip(keys, leaves)]
    return jax.tree.unflatten(tree, out)


def random_loaded_model(name: str, dtype, seed: int = 0, max_position_embeddings: int = 8192, mxfp4: bool = False,
                        init: str = "normal"):
    """A jlight.loading.LoadedModel with random weights and no tokenizer. mxfp4: the routed experts' weights
    ([layers, experts, in, out] `experts_*`) as random MXFP4 (Mxfp4Weight: codes uniform, exponents near 2^-7, rows
    past a multiple of 32 kept as the float tail), what quantization="mxfp4" runs from a gpt-oss checkpoint.
    init: "normal" (the family's init_params: normal(0, 1/fan_in), norms at one) or "vllm-dummy"
    (vllm_dummy_params: vLLM's dummy weights, for a MoE model's routing as vLLM's dummy run has it)."""
    from jlight.loading import LoadedModel
    from jlight.models import get_model_family

    if init not in INITS:
        raise ValueError(f"init={init!r}: expected one of {', '.join(INITS)}")
    config = make_config(name, max_position_embeddings)
    make = lambda k: get_model_family(config).init_params(config, k, dtype)
    if init == "vllm-dummy":
        make = lambda k, normal=make: vllm_dummy_params(jax.eval_shape(normal, k), k)
    params = jax.jit(make)(jax.random.PRNGKey(seed))
    if mxfp4:
        params = dict(params, layers=random_mxfp4_experts(params["layers"], seed))
    return LoadedModel(config=config, params=params, tokenizer=None, generation_config={}, name=f"random-{name}", dtype=dtype)


def random_mxfp4_experts(layers: dict, seed: int) -> dict:
    """`layers` with each stacked expert weight [L, X, in, out] replaced by a random Mxfp4Weight of that shape
    (the float weight freed as it goes)."""
    from jlight.core.quantization import Mxfp4Weight

    names = [n for n, w in layers.items() if n.startswith("experts_") and getattr(w, "ndim", 0) == 4]
    if not names:
        raise ValueError("mxfp4: this shape has no stacked expert weights ([layers, experts, in, out] experts_*)")
    out, key = dict(layers), jax.random.PRNGKey(seed + 1)
    for name in names:
        w = layers[name]
        *lead, d_in, d_out = w.shape
        if d_in % 32:
            raise ValueError(f"mxfp4: {name} has {d_in} input rows, not whole 32-row blocks")
        key, kb, ks = jax.random.split(key, 3)
        blocks = jax.random.bits(kb, (*lead, d_in // 2, d_out), jnp.uint8)
        scales = jax.random.randint(ks, (*lead, d_in // 32, d_out), 118, 123, jnp.int32).astype(jnp.uint8)
        out[name] = Mxfp4Weight(blocks, scales)
        jax.block_until_ready(out[name])
        w.delete()
    return out


def routed_fraction(config: ModelConfig) -> float:
    """top_k / num_experts of a MoE config (the share of its routed experts one token reads); 1.0 without experts."""
    x = config.extra
    experts = x.get("num_local_experts") or x.get("num_experts") or x.get("n_routed_experts")
    top_k = x.get("num_experts_per_tok")
    return top_k / experts if experts and top_k else 1.0


def decode_bytes(sizes, fraction: float = 1.0) -> int:
    """sizes: (keystr path, bytes) of a params tree's leaves. The bytes a decode step reads: every leaf but the
    embedding table, the routed experts' (params named experts_*) counted at `fraction` (routed_fraction for
    what one token reads of a MoE model, 1.0 for all of them)."""
    return int(sum(n * (fraction if "['experts_" in key else 1.0) for key, n in sizes if key != "['embed']"))


def shape_sizes(name: str, dtype=None) -> dict:
    """Parameters and bytes of a named shape's random weights in jlight's layout (no weights made: eval_shape).
    jlight keeps tied embeddings as two tables (embed and lm_head), so hf_params counts the tied table once.
    decode_bytes: what a decode step reads (every weight but the embedding); active_bytes: what batch-1 decode
    reads of a MoE model (the routed experts at top_k / num_experts)."""
    import math

    import jax.numpy as jnp

    from jlight.models import get_model_family

    dtype = dtype or jnp.bfloat16
    config = make_config(name)
    leaves = jax.tree_util.tree_leaves_with_path(jax.eval_shape(
        lambda k: get_model_family(config).init_params(config, k, dtype), jax.random.PRNGKey(0)))
    sizes = [(jax.tree_util.keystr(path), math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize) for path, leaf in leaves]
    params = sum(math.prod(leaf.shape) for _, leaf in leaves)
    return dict(name=name, architecture=config.architecture, layers=config.num_layers, params=params,
                hf_params=params - (config.vocab_size * config.hidden_size if config.tie_word_embeddings else 0),
                bytes=sum(n for _, n in sizes), decode_bytes=decode_bytes(sizes),
                active_bytes=decode_bytes(sizes, routed_fraction(config)))


if __name__ == "__main__":  # python benchmarks/model_configs.py [NAME ...]: sizes of the named shapes in bf16
    for name in sys.argv[1:] or sorted(family_shapes.SHAPES):
        s = shape_sizes(name)
        print(f"{name}: {s['architecture']}, {s['layers']} layers, {s['params'] / 1e9:.3f}B params ({s['hf_params']:,} in HF's "
              f"count), {s['bytes'] / 1e9:.2f} GB bf16; a decode step reads {s['decode_bytes'] / 1e9:.2f} GB, batch-1 "
              f"{s['active_bytes'] / 1e9:.2f} GB")
