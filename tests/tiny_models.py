"""Tiny random-weight HF model directories, built with transformers, for tests.

`make_tiny_model(tmp_dir, "LlamaForCausalLM", **overrides)` (HF config fields; `dtype="bfloat16"`
also stores the weights in bf16) writes config.json,
model.safetensors, generation_config.json and a small byte-level BPE tokenizer
(tokenizer.json + tokenizer_config.json with a ChatML chat template) and returns the path.
Weights are seeded, so the same call always gives the same model.

`TinyModelCache` builds each (architecture, overrides) once per test session; conftest.py
exposes it as the `tiny_model` fixture.
"""
from __future__ import annotations

import hashlib
import json
import os

TINY_VOCAB = 512
# Small enough to compile in seconds, big enough for GQA (4 query heads, 2 KV heads).
BASE_CONFIG = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    # Larger than HF's 0.02 so logits are spread out and greedy argmaxes are not near-ties.
    initializer_range=0.1,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# Per-architecture settings that exercise what makes each family different.
ARCH_CONFIG = {
    "LlamaForCausalLM": dict(model_type="llama"),
    "MistralForCausalLM": dict(model_type="mistral", sliding_window=None),
    "Qwen2ForCausalLM": dict(model_type="qwen2", use_sliding_window=False),  # q/k/v biases always on
    "Qwen3ForCausalLM": dict(model_type="qwen3", head_dim=32, use_sliding_window=False),  # qk-norm, head_dim != hidden/heads
    # Gemma 2: alternating local (window 8) / global layers, soft-capped attention and logits small enough to bite,
    # query_pre_attn_scalar != head_dim, tied embeddings.
    "Gemma2ForCausalLM": dict(model_type="gemma2", head_dim=16, num_hidden_layers=4, sliding_window=8,
                              query_pre_attn_scalar=24, attn_logit_softcapping=2.0, final_logit_softcapping=5.0,
                              tie_word_embeddings=True),
    # Gemma 3: 5 local : 1 global, the local layers on their own RoPE base, linear scaling on the global ones, qk-norm.
    "Gemma3ForCausalLM": dict(model_type="gemma3_text", head_dim=16, num_hidden_layers=6, sliding_window=8,
                              query_pre_attn_scalar=24, tie_word_embeddings=True,
                              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}),
    # Phi-3: fused qkv / gate_up checkpoints, LongRoPE (short factors up to 64 positions, long ones past them),
    # partial rotary (Phi-4-mini's 0.75; here half of head_dim 16).
    "Phi3ForCausalLM": dict(model_type="phi3", head_dim=16, original_max_position_embeddings=64, partial_rotary_factor=0.5,
                            rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0],
                                          "long_factor": [2.0, 4.0, 8.0, 16.0]}, sliding_window=None),
    # SmolLM3: every 4th layer without RoPE (no_rope_layers [1, 1, 1, 0]).
    "SmolLM3ForCausalLM": dict(model_type="smollm3", num_hidden_layers=4, rope_theta=10000.0),
    # gpt-oss: sinks, biases, alternating 8-token windows, 8 experts top-2 with the clamped swiglu, YaRN.
    "GptOssForCausalLM": dict(model_type="gpt_oss", head_dim=16, intermediate_size=32, num_local_experts=8,
                              num_experts_per_tok=2, sliding_window=8, swiglu_limit=0.5),  # a limit that clamps here
    # Gemma 4: two geometries (sliding 16 x 2 KV heads, full 32 x 1 KV head with keys as values), proportional RoPE
    # on the full layers (2 of 16 pairs rotated), per-layer embeddings, the last 2 layers reading layers 3's and 2's
    # K/V with 2x MLPs, the MoE block, a soft-cap that bites. Overrides switch each off (tests/test_gemma4.py).
    "Gemma4ForCausalLM": dict(model_type="gemma4_text", head_dim=16, intermediate_size=96, num_hidden_layers=6,
                              global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=8,
                              layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                           "sliding_attention", "sliding_attention", "full_attention"],
                              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                               "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                                  "rope_theta": 10000.0}},
                              vocab_size_per_layer_input=TINY_VOCAB, hidden_size_per_layer_input=8,
                              num_kv_shared_layers=2, use_double_wide_mlp=True, enable_moe_block=True, num_experts=4,
                              top_k_experts=2, moe_intermediate_size=32, final_logit_softcapping=5.0,
                              tie_word_embeddings=True),
}
# Architectures whose norm weights, biases and sink logits get noise on top of HF's init (ones, or Gemma's
# zeros, zero biases), so a norm loaded into the wrong place, a missing (1 + w) or bias changes the logits.
# Gemma 4's layer_scalar (a stored buffer) and router scales (ones at init) get the same noise.
NOISY_NORMS = ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM", "SmolLM3ForCausalLM", "GptOssForCausalLM",
               "Gemma4ForCausalLM")
NOISY_SCALES = ("layer_scalar", "router.scale", "router.per_expert_scale")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "def add(a, b):\n    return a + b\n",
    "Once upon a time there was a small model that answered questions.",
    "1 2 3 4 5 6 7 8 9 10, numbers and letters: abc xyz.",
]


def make_tiny_model(tmp_dir: str, architecture: str, **config_overrides) -> str:
    """Write a tiny random `architecture` model (+ tokenizer) under tmp_dir; return its path."""
    import torch
    import transformers

    if architecture not in ARCH_CONFIG:
        raise ValueError(f"make_tiny_model: architecture {architecture!r} not one of {', '.join(ARCH_CONFIG)}")
    settings = {**BASE_CONFIG, **ARCH_CONFIG[architecture], **config_overrides}
    model_type = settings.pop("model_type")
    config = transformers.AutoConfig.for_model(model_type, **settings)
    config.architectures = [architecture]
    torch.manual_seed(0)
    model = getattr(transformers, architecture)(config).eval()
    _config_as_computed(model, config)
    if architecture in NOISY_NORMS:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name or "bias" in name or "sinks" in name or name.endswith(NOISY_SCALES):
                    param.add_(torch.randn_like(param) * 0.3)
            for name, buffer in model.named_buffers():
                if name.endswith(NOISY_SCALES):
                    buffer.add_(torch.randn_like(buffer) * 0.3)
    if settings.get("dtype"):  # e.g. dtype="bfloat16": store the weights in that dtype
        model = model.to(getattr(torch, settings["dtype"]))
    path = os.path.join(tmp_dir, _dir_name(architecture, config_overrides))
    model.save_pretrained(path, safe_serialization=True)
    write_tiny_tokenizer(path, vocab_size=min(settings["vocab_size"], TINY_VOCAB))
    return path


def _config_as_computed(model, config) -> None:
    """The saved config states what the reference computes: some transformers releases (5.17 among them)
    ignore gpt-oss's swiglu_limit and swiglu_alpha (its experts hard-code 7.0 and 1.702), so there the tiny
    model's config takes the values its experts use, which jlight then reads from it."""
    for module in model.modules():
        if type(module).__name__ == "GptOssExperts":
            config.swiglu_limit, config.swiglu_alpha = float(module.limit), float(module.alpha)


def write_tiny_tokenizer(path: str, vocab_size: int = TINY_VOCAB) -> None:
    """Train a byte-level BPE on a few sentences (milliseconds) and save it HF-style."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_CORPUS, trainer)
    tok.save(os.path.join(path, "tokenizer.json"))
    cfg = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML_TEMPLATE}
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=1)


def _dir_name(architecture: str, overrides: dict) -> str:
    suffix = "_".join(f"{k}-{v}" for k, v in sorted(overrides.items()))
    if len(suffix) > 120:  # dict-valued overrides: a digest keeps the name within the file system's limit
        suffix = hashlib.sha1(suffix.encode()).hexdigest()[:16]
    return f"{architecture}_{suffix}" if suffix else architecture


class TinyModelCache:
    """Builds each distinct tiny model once; `get(arch, **overrides)` returns its directory."""

    def __init__(self, root: str):
        self.root = root
        self._paths: dict[tuple, str] = {}

    def get(self, architecture: str, **config_overrides) -> str:
        key = (architecture, json.dumps(config_overrides, sort_keys=True))  # overrides may hold dicts
        if key not in self._paths:
            self._paths[key] = make_tiny_model(self.root, architecture, **config_overrides)
        return self._paths[key]
