"""Shared helpers of the MoE / MLA tests (no tests here): tiny random-weight transformers
models of each MoE family, and loading them into jlight."""
from __future__ import annotations

import glob
import os

import jax.numpy as jnp
import numpy as np

# Small enough to compile in seconds; enough experts (8) and groups (4) to exercise routing.
_BASE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
             initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0)
TINY_MOE_CONFIGS = {
    "MixtralForCausalLM": dict(model_type="mixtral", intermediate_size=32, num_key_value_heads=2,
                               num_local_experts=8, num_experts_per_tok=2, sliding_window=None),
    "Qwen3MoeForCausalLM": dict(model_type="qwen3_moe", intermediate_size=64, moe_intermediate_size=32,
                                num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=3,
                                norm_topk_prob=True, use_sliding_window=False),
    "Qwen2MoeForCausalLM": dict(model_type="qwen2_moe", intermediate_size=64, moe_intermediate_size=32,
                                shared_expert_intermediate_size=48, num_key_value_heads=2, num_experts=8,
                                num_experts_per_tok=2, norm_topk_prob=False, use_sliding_window=False),
    # transformers' DeepSeek classes need num_key_value_heads == num_attention_heads.
    "DeepseekV2ForCausalLM": dict(model_type="deepseek_v2", num_hidden_layers=3, intermediate_size=96,
                                  moe_intermediate_size=32, num_key_value_heads=4, n_routed_experts=8,
                                  n_shared_experts=2, num_experts_per_tok=2, first_k_dense_replace=1,
                                  kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                  v_head_dim=16, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                  routed_scaling_factor=1.5,
                                  rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                                       original_max_position_embeddings=128, beta_fast=32,
                                                       beta_slow=1, mscale=0.707, mscale_all_dim=0.707)),
    "DeepseekV3ForCausalLM": dict(model_type="deepseek_v3", num_hidden_layers=3, intermediate_size=96,
                                  moe_intermediate_size=32, num_key_value_heads=4, n_routed_experts=8,
                                  n_shared_experts=1, num_experts_per_tok=3, first_k_dense_replace=1,
                                  kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                  v_head_dim=16, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                  norm_topk_prob=True,
                                  rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                                       original_max_position_embeddings=128, beta_fast=32,
                                                       beta_slow=1, mscale=1.0, mscale_all_dim=1.0)),
}


def make_tiny_moe_model(root: str, architecture: str):
    """Save a seeded tiny `architecture` model (+ a tiny tokenizer) under root; return (path, torch model)."""
    import torch
    import transformers

    from tiny_models import write_tiny_tokenizer

    settings = {**_BASE, **TINY_MOE_CONFIGS[architecture]}
    config = transformers.AutoConfig.for_model(settings.pop("model_type"), **settings)
    config.architectures = [architecture]
    torch.manual_seed(0)
    model = getattr(transformers, architecture)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "e_score_correction_bias" in name:
                p.copy_(torch.randn_like(p) * 0.1)  # a non-zero bias, so noaux_tc's bias path is checked
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(torch.randn_like(b) * 0.1)
    path = os.path.join(root, architecture)
    model.save_pretrained(path, safe_serialization=True)
    write_tiny_tokenizer(path, vocab_size=settings["vocab_size"])
    return path, model


def load_jlight(path: str, dtype=jnp.float32):
    """(ModelConfig, params) read from a HF directory through jlight's own loading code."""
    from safetensors import safe_open

    from jlight.core.config import ModelConfig
    from jlight.loading.assemble import assemble_params

    config = ModelConfig.from_json_file(os.path.join(path, "config.json"))

    def tensors():
        for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
            with safe_open(file, "np") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

    return config, assemble_params(config, tensors(), dtype)


def relative_error(ours: np.ndarray, ref: np.ndarray) -> float:
    """max |ours - ref| relative to the logits' scale (max |ref|)."""
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


def check_against_transformers(path: str, hf_model, prompt: list[int]) -> None:
    """float32 prefill logits within 1e-4 of transformers', and 32 identical greedy tokens."""
    from direct_forward import SingleSequenceRunner, hf_greedy, hf_logits

    config, params = load_jlight(path)
    runner = SingleSequenceRunner(params, config, prefill_bucket=32)
    assert relative_error(runner.prefill_logits(prompt), hf_logits(hf_model, prompt)) < 1e-4
    assert runner.greedy(prompt, 32) == hf_greedy(hf_model, prompt, 32)


def check_unrolled_matches_scanned(path: str, prompt: list[int]):
    """The unrolled layer loop (family.unstack_layers, the default) computes what the scan
    does: logits and 8 greedy tokens. Returns (config, unstacked params, scanned, unrolled runners)
    for family-specific checks."""
    from direct_forward import SingleSequenceRunner

    from jlight.models import get_model_family

    config, params = load_jlight(path)
    unstacked = get_model_family(config).unstack_layers(params)
    scanned, unrolled = (SingleSequenceRunner(p, config, prefill_bucket=32) for p in (params, unstacked))
    np.testing.assert_allclose(unrolled.prefill_logits(prompt), scanned.prefill_logits(prompt), rtol=1e-5, atol=1e-5)
    assert unrolled.greedy(prompt, 8) == scanned.greedy(prompt, 8)
    return config, unstacked, scanned, unrolled
