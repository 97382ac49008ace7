"""Shared helpers of the hybrid-model tests (no tests here): seeded tiny random transformers models
of the hybrid families, saved with a tiny tokenizer."""
from __future__ import annotations

import os

_BASE = dict(vocab_size=256, hidden_size=64, max_position_embeddings=512, rms_norm_eps=1e-6,
             tie_word_embeddings=False, initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0)
TINY_HYBRID_CONFIGS = {
    # Mamba, attention, Mamba, Mamba; 4 experts top-2 beside the shared MLP; RoPE; Granite's multipliers.
    "GraniteMoeHybridForCausalLM": dict(
        model_type="granitemoehybrid", num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=32, shared_intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16, mamba_d_head=16, mamba_d_conv=4, mamba_expand=2,
        mamba_chunk_size=16, position_embedding_type="rope", embedding_multiplier=1.5, logits_scaling=2.0,
        residual_multiplier=0.7, attention_multiplier=0.2),
    # DeltaNet x3 then gated attention; 2 key heads serving 4 value heads; 4 experts top-2 + the shared expert;
    # RoPE over a quarter of head_dim.
    "Qwen3NextForCausalLM": dict(
        model_type="qwen3_next", num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25)),
}
# Mamba, MLP, attention, MLP, Mamba, MLP (Nemotron-H's pattern "M-*-M-"); no RoPE; relu2 MLPs.
TINY_HYBRID_CONFIGS["NemotronHForCausalLM"] = dict(
    model_type="nemotron_h", layers_block_type=["mamba", "mlp", "attention", "mlp", "mamba", "mlp"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96, mamba_num_heads=8,
    mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=16, layer_norm_epsilon=1e-5)
# Nemotron-3's MoE layers: Mamba, MoE, attention, MoE; 8 experts in 2 groups, top-2 of 1 group, a latent
# projection around the experts, the shared MLP; a random correction bias (HF starts it at zero).
TINY_HYBRID_CONFIGS["NemotronHMoE"] = dict(
    TINY_HYBRID_CONFIGS["NemotronHForCausalLM"], layers_block_type=["mamba", "moe", "attention", "moe"],
    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
    n_group=2, topk_group=1, routed_scaling_factor=1.5, moe_latent_size=24)
# Qwen3.5: its separate DeltaNet projections; the dense text model and the MoE one.
_QWEN3_5 = {k: v for k, v in TINY_HYBRID_CONFIGS["Qwen3NextForCausalLM"].items()
            if k not in ("model_type", "num_experts", "moe_intermediate_size", "shared_expert_intermediate_size",
                         "num_experts_per_tok", "norm_topk_prob")}
TINY_HYBRID_CONFIGS["Qwen3_5ForCausalLM"] = dict(_QWEN3_5, model_type="qwen3_5_text")
TINY_HYBRID_CONFIGS["Qwen3_5MoeForCausalLM"] = dict(
    _QWEN3_5, model_type="qwen3_5_moe_text", num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48,
    num_experts_per_tok=2)


PROMPT = [5, 17, 99, 3, 42, 8, 200, 13, 7, 64, 31, 150, 77, 90, 91, 92, 93, 94, 95, 96, 11]


def _centre(architecture: str, name: str) -> float:
    """Where a parameter HF initialises to a constant is spread around: Qwen3-Next's (1 + w) norms about 0."""
    one_plus = ("layernorm.weight", "q_norm.weight", "k_norm.weight", "model.norm.weight")
    return 0.0 if architecture.startswith(("Qwen3Next", "Qwen3_5")) and name.endswith(one_plus) else 1.0


def make_tiny_hybrid_model(root: str, architecture: str):
    """Save a seeded tiny `architecture` model (+ a tiny tokenizer) under root; return (path, torch model)."""
    import torch
    import transformers

    from tiny_models import write_tiny_tokenizer

    settings = {**_BASE, **TINY_HYBRID_CONFIGS[architecture]}
    config = transformers.AutoConfig.for_model(settings.pop("model_type"), **settings)
    arch = "NemotronHForCausalLM" if architecture == "NemotronHMoE" else architecture  # a config variant's class
    config.architectures = [arch]
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config).eval()
    with torch.no_grad():  # spread the Mamba parameters HF initialises to constants, so each one is checked
        for name, p in model.named_parameters():
            if name.endswith((".D", ".dt_bias", "norm.weight")):
                p.copy_(_centre(architecture, name) + 0.3 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    path = os.path.join(root, architecture)
    model.save_pretrained(path, safe_serialization=True)
    write_tiny_tokenizer(path, vocab_size=settings["vocab_size"])
    return path, model


def check_engine(path: str, hf_model) -> None:
    """Through the engine: three prompts prefilled in 16-token chunks (each chunk resumes the state the
    one before left) next to each other's decode tokens, with too few KV pages so that sequences are
    preempted and re-admitted (from a saved state where the prefix cache has one); a prefix-cache hit
    that restores a saved state; n=2 (the second sample restores the first's). Greedy tokens identical
    to transformers'; every running slot and page back at the end."""
    import numpy as np

    import jlight.api
    from direct_forward import hf_greedy
    from jlight import SamplingParams

    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, 250, n)] for n in (40, 23, 9)]
    llm = jlight.api.LLM(path, dtype="float32", max_num_batched_tokens=16, max_num_seqs=4, num_pages=9,
                         compilation_cache_dir=None, min_token_bucket=16)  # one compiled step
    engine = llm.engine
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    # 3 sequences of up to 72 tokens need 12 pages of 16; 8 usable pages force preemption and recompute.
    assert engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, 32)
    # A shared 32-token prefix: the first prompt's state is saved at 32 (its last page boundary), the
    # second restores it and computes its own 5 tokens only.
    prefix = [int(t) for t in rng.integers(3, 250, 32)]
    first, second = prefix + [11, 12, 13], prefix + [21, 22, 23, 24, 25]
    a = llm.generate([first], greedy, use_tqdm=False)[0]
    b = llm.generate([second], greedy, use_tqdm=False)[0]
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 32
    assert a.outputs[0].token_ids == hf_greedy(hf_model, first, 32)
    assert b.outputs[0].token_ids == hf_greedy(hf_model, second, 32)
    two = llm.generate([prompts[1]], SamplingParams(n=2, max_tokens=32, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in two[0].outputs] == [outs[1].outputs[0].token_ids] * 2
    assert engine.state_pool.num_free_slots == engine.state_pool.num_slots - 1  # every running slot back
    assert engine.block_manager.num_used_pages == 0
