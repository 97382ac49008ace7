"""HF config.json dicts of three model families' real shapes, for random-weight benchmarks (issues 31, 32).

Standard library only: jlight's benchmarks (model_configs.py) and the vLLM peer (vllm_families.py, which
writes one as config.json and loads it with load_format="dummy") both import this file, the peer without jax.

  gemma3-12b      google/gemma-3-12b-it's text model as a text-only Gemma3ForCausalLM (model_type gemma3_text):
                  48 layers, 5 local (1024-token window, RoPE base 10,000) : 1 global (RoPE base 1e6, linear
                  scaling factor 8), 16 heads, 8 KV heads of 256, query_pre_attn_scalar 256, gated gelu MLP of
                  15360, vocab 262208, tied embeddings.
  gpt-oss-20b     openai/gpt-oss-20b: 24 layers alternating a 128-token window and full attention, attention
                  sinks and biases, 64 heads, 8 KV heads of 64, 32 experts top-4 of 2880 with the clamped swiglu
                  (limit 7), YaRN RoPE (factor 32 over 4096, theta 150000), vocab 201088. The release stores its
                  experts in MXFP4; these random weights are bf16 everywhere (no quantization_config), so the
                  experts are 4x the release's bytes, on both engines alike.
  qwen3-next-16l  Qwen/Qwen3-Next-80B-A3B-Instruct's shape cut from 48 to 16 layers (27.0B parameters, 54 GB in
                  bf16: one H200 holds it with room for the caches), the 3 gated DeltaNet : 1 gated attention
                  pattern kept: hidden 2048, 16 heads, 2 KV heads of 256, RoPE on a quarter of head_dim (theta
                  1e7), DeltaNet 16 key heads / 32 value heads of 128, conv kernel 4, 512 experts top-10 of 512
                  plus a gated shared expert of 512, vocab 151936.

The dicts are written in transformers 5's form (RoPE in `rope_parameters`, per layer type for Gemma 3; the
layer kinds listed in `layer_types`), which transformers 5 and the vLLM built on it read; jlight's ModelConfig
reads both that and the 4.x form. Field names are those of transformers' Gemma3TextConfig, GptOssConfig and
Qwen3NextConfig. Values not named above are the releases' config.json values (or transformers' defaults where
the release leaves a field out).
"""
from __future__ import annotations

import copy


def _gemma3_layer_types(num_layers: int) -> list[str]:
    """Gemma 3: every sixth layer global, the rest local (sliding_window_pattern 6)."""
    return ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(num_layers)]


def _gpt_oss_layer_types(num_layers: int) -> list[str]:
    """gpt-oss: even layers windowed, odd layers full."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]


def _qwen3_next_layer_types(num_layers: int, interval: int = 4) -> list[str]:
    """Qwen3-Next: every interval-th layer gated attention, the others gated DeltaNet."""
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]


LAYER_TYPES = {"gemma3_text": _gemma3_layer_types, "gpt_oss": _gpt_oss_layer_types, "qwen3_next": _qwen3_next_layer_types}

GEMMA3_12B = dict(
    architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
    vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
    num_attention_heads=16, num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256,
    hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, attention_bias=False,
    sliding_window=1024, layer_types=_gemma3_layer_types(48),
    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
    attn_logit_softcapping=None, final_logit_softcapping=None, max_position_embeddings=131072,
    tie_word_embeddings=True, bos_token_id=2, eos_token_id=[1, 106], pad_token_id=0, torch_dtype="bfloat16",
)

GPT_OSS_20B = dict(
    architectures=["GptOssForCausalLM"], model_type="gpt_oss",
    vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
    num_attention_heads=64, num_key_value_heads=8, head_dim=64, attention_bias=True,
    num_local_experts=32, num_experts_per_tok=4, experts_per_token=4, swiglu_limit=7.0, router_aux_loss_coef=0.9,
    sliding_window=128, layer_types=_gpt_oss_layer_types(24),
    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False},
    initial_context_length=4096, max_position_embeddings=131072, hidden_act="silu", rms_norm_eps=1e-5,
    tie_word_embeddings=False, eos_token_id=200002, pad_token_id=199999, torch_dtype="bfloat16",
)

QWEN3_NEXT_16L = dict(
    architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next",
    vocab_size=151936, hidden_size=2048, intermediate_size=5120, num_hidden_layers=16,
    num_attention_heads=16, num_key_value_heads=2, head_dim=256, attention_bias=False,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, full_attention_interval=4, layer_types=_qwen3_next_layer_types(16),
    num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    # partial_rotary_factor at the top level too (the release's place; Qwen3.5's configs carry both)
    partial_rotary_factor=0.25, rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    max_position_embeddings=262144, hidden_act="silu", rms_norm_eps=1e-6,
    tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16",
)

SHAPES = {"gemma3-12b": GEMMA3_12B, "gpt-oss-20b": GPT_OSS_20B, "qwen3-next-16l": QWEN3_NEXT_16L}


def with_layers(cfg: dict, num_layers: int) -> dict:
    """A copy of cfg with num_layers layers, layer_types following the family's pattern."""
    cfg = copy.deepcopy(cfg)
    cfg["num_hidden_layers"] = num_layers
    if "layer_types" in cfg:
        cfg["layer_types"] = LAYER_TYPES[cfg["model_type"]](num_layers)
    return cfg


def shape(name: str, num_layers: int | None = None, max_position_embeddings: int | None = None) -> dict:
    """A fresh copy of the named config, optionally with another layer count or context length."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; choose one of {', '.join(SHAPES)}")
    cfg = with_layers(SHAPES[name], num_layers) if num_layers is not None else copy.deepcopy(SHAPES[name])
    if max_position_embeddings is not None:
        cfg["max_position_embeddings"] = max_position_embeddings
    return cfg
