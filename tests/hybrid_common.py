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
}


def make_tiny_hybrid_model(root: str, architecture: str):
    """Save a seeded tiny `architecture` model (+ a tiny tokenizer) under root; return (path, torch model)."""
    import torch
    import transformers

    from tiny_models import write_tiny_tokenizer

    settings = {**_BASE, **TINY_HYBRID_CONFIGS[architecture]}
    config = transformers.AutoConfig.for_model(settings.pop("model_type"), **settings)
    config.architectures = [architecture]
    torch.manual_seed(0)
    model = getattr(transformers, architecture)(config).eval()
    with torch.no_grad():  # spread the Mamba parameters HF initialises to constants, so each one is checked
        for name, p in model.named_parameters():
            if name.endswith((".D", ".dt_bias", "norm.weight")):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    path = os.path.join(root, architecture)
    model.save_pretrained(path, safe_serialization=True)
    write_tiny_tokenizer(path, vocab_size=settings["vocab_size"])
    return path, model
