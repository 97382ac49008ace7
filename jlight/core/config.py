"""ModelConfig: the model hyper-parameters jlight needs, read from a HF `config.json`.

Handles transformers 4.x and 5.x forms (`rope_theta` vs `rope_parameters`).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from jlight.core.errors import ModelLoadError, UnsupportedModelError

# HF `architectures` names -> the model family file in jlight.models that runs them.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "mixtral",
    "DeepseekV2ForCausalLM": "deepseek",
    "DeepseekV3ForCausalLM": "deepseek",
    "GraniteMoeHybridForCausalLM": "granite_hybrid",
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5ForCausalLM": "qwen3_next",
    "Qwen3_5MoeForCausalLM": "qwen3_next",
    "NemotronHForCausalLM": "nemotron_h",
    "SmolLM3ForCausalLM": "llama",
    "Phi3ForCausalLM": "llama",
    "Gemma2ForCausalLM": "gemma",
    "Gemma3ForCausalLM": "gemma",
    "GptOssForCausalLM": "gpt_oss",
    "Gemma4ForCausalLM": "gemma4",
    "Gemma4ForConditionalGeneration": "gemma4",  # its text model; the vision and audio towers' weights are skipped
}
# Variants of supported families that jlight does not run, and what they would need.
UNSUPPORTED_VARIANTS = {
    "Gemma3ForConditionalGeneration": "Gemma 3 with its SigLIP vision tower (vision_config, multi_modal_projector); "
    "jlight runs text-only Gemma 3 checkpoints (Gemma3ForCausalLM, model_type gemma3_text, e.g. gemma-3-1b-it)",
    "Gemma3nForConditionalGeneration": "Gemma 3n (per-layer embeddings, AltUp, LAuReL, KV sharing between layers and its "
    "audio/vision towers), none of which jlight implements",
    "Gemma3nForCausalLM": "Gemma 3n (per-layer embeddings, AltUp, LAuReL, KV sharing between layers), none of which jlight implements",
}

# HF config fields of the MoE and MLA families, copied as-is into ModelConfig.extra
# (models/mixtral.py and models/deepseek.py read them with the HF defaults).
MOE_MLA_CONFIG_KEYS = (
    "model_type", "num_local_experts", "num_experts", "n_routed_experts", "num_experts_per_tok",
    "moe_intermediate_size", "norm_topk_prob", "shared_expert_intermediate_size", "decoder_sparse_step",
    "mlp_only_layers", "n_shared_experts", "first_k_dense_replace", "moe_layer_freq", "topk_method",
    "n_group", "topk_group", "routed_scaling_factor", "scoring_func", "kv_lora_rank", "q_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_interleave", "swiglu_limit", "swiglu_alpha",
)
# HF config fields of per-layer attention kinds and their families (models/attention_kinds.py,
# models/gemma.py), copied as-is into ModelConfig.extra.
ATTENTION_CONFIG_KEYS = (
    "layer_types", "sliding_window_pattern", "no_rope_layers", "attn_logit_softcapping", "final_logit_softcapping",
    "query_pre_attn_scalar", "rope_local_base_freq", "original_max_position_embeddings",
)


# HF config fields of Gemma 4's text model (models/gemma4.py), copied as-is into ModelConfig.extra for that family
# (num_experts and moe_intermediate_size are in MOE_MLA_CONFIG_KEYS).
GEMMA4_CONFIG_KEYS = (
    "global_head_dim", "num_global_key_value_heads", "per_layer_config", "attention_k_eq_v", "num_kv_shared_layers",
    "use_double_wide_mlp", "hidden_size_per_layer_input", "vocab_size_per_layer_input", "enable_moe_block",
    "top_k_experts",
)


# HF config fields of the hybrid families (models/granite_hybrid.py, nemotron_h.py, qwen3_next.py), copied into
# ModelConfig.extra for those architectures only (names such as mlp_bias or expand mean other things elsewhere).
HYBRID_FAMILIES = ("granite_hybrid", "nemotron_h", "qwen3_next")
HYBRID_CONFIG_KEYS = (
    "layer_types", "layers_block_type", "mamba_n_heads", "mamba_n_groups", "mamba_d_state", "mamba_d_head",
    "mamba_d_conv", "mamba_expand", "mamba_chunk_size", "mamba_conv_bias", "mamba_proj_bias", "time_step_limit",
    "embedding_multiplier", "logits_scaling", "residual_multiplier", "attention_multiplier",
    "shared_intermediate_size", "position_embedding_type",
    "linear_num_value_heads", "linear_num_key_heads", "linear_key_head_dim", "linear_value_head_dim",
    "linear_conv_kernel_dim", "full_attention_interval",
    "hybrid_override_pattern", "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel",
    "expand", "use_conv_bias", "use_bias", "time_step_min", "mamba_hidden_act", "mlp_hidden_act", "mlp_bias",
    "moe_shared_expert_intermediate_size", "moe_latent_size",
)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None, or a dict like HF's rope_scaling ({"rope_type": "llama3", "factor": ...}).
    # Not hashed (a dict) but compared, so configs stay usable as static jit arguments.
    rope_scaling: dict | None = dataclasses.field(default=None, hash=False)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections.
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim of q and k.
    sliding_window: int | None = None
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Extra architecture-specific fields (MoE, MLA) live here so the dataclass stays small.
    # Compared (not hashed): two configs differing only here must not share a compiled step.
    extra: dict = dataclasses.field(default_factory=dict, hash=False)

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        unsupported = next((a for a in archs if a in UNSUPPORTED_VARIANTS), None)
        if arch is None and unsupported:
            raise UnsupportedModelError(f"{unsupported} is not supported: it is {UNSUPPORTED_VARIANTS[unsupported]}")
        if arch is not None and SUPPORTED_ARCHITECTURES[arch] == "gemma4":
            cfg = _gemma4_text_config(cfg)
        if cfg.get("use_bidirectional_attention") and not (arch and SUPPORTED_ARCHITECTURES[arch] == "gemma4"
                                                           and cfg["use_bidirectional_attention"] == "vision"):
            raise UnsupportedModelError(f"{arch} with use_bidirectional_attention={cfg['use_bidirectional_attention']!r} "
                                        "(non-causal attention: an embedding model) is not supported; jlight runs causal "
                                        "language models")
        if arch is None:
            raise UnsupportedModelError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"jlight supports: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        rope_theta, rope_scaling, rope_extra = _rope_settings(cfg)
        if cfg.get("model_type") == "phi3" and rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) in ("su", "yarn"):
            rope_scaling = {**rope_scaling, "rope_type": "longrope", "type": "longrope"}  # Phi-3's older names, as HF reads them
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        model_type = cfg.get("model_type", "")
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg.get("num_hidden_layers") or _num_layers_of_types(cfg),
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            # Nemotron-H's norms read layer_norm_epsilon (its config.json carries a default rms_norm_eps too;
            # jlight convert's has rms_norm_eps alone)
            rms_norm_eps=cfg.get("layer_norm_epsilon", cfg.get("rms_norm_eps", 1e-6)) if model_type == "nemotron_h"
            else cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", cfg.get("qkv_bias", model_type in ("qwen2", "qwen2_moe")))),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text", "gemma4_text"),
            sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None,
            hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act", "silu"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            extra={**{k: cfg[k] for k in _extra_keys(arch) if k in cfg}, **rope_extra},
        )

    @classmethod
    def from_json_file(cls, path: str) -> "ModelConfig":
        try:
            with open(path) as f:
                cfg = json.load(f)
        except FileNotFoundError:
            raise ModelLoadError(f"no config.json at {path}; point --model at a HF model directory or a .gguf file") from None
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{path} is not valid JSON ({e}); re-download the model's config.json") from None
        return cls.from_hf_dict(cfg)


def _num_layers_of_types(cfg: dict) -> int:
    """Layers of a config that lists its layers' kinds instead of num_hidden_layers (Nemotron-H)."""
    types = cfg.get("layer_types") or cfg.get("layers_block_type") or cfg.get("hybrid_override_pattern")
    if not types:
        raise ModelLoadError("config.json has neither num_hidden_layers nor a list of layer types; it is incomplete")
    return len(types)


def _extra_keys(arch: str) -> tuple[str, ...]:
    """The HF config fields ModelConfig.extra keeps for an architecture (HYBRID_CONFIG_KEYS for a hybrid family)."""
    family = SUPPORTED_ARCHITECTURES[arch]
    return (MOE_MLA_CONFIG_KEYS + ATTENTION_CONFIG_KEYS + (HYBRID_CONFIG_KEYS if family in HYBRID_FAMILIES else ())
            + (GEMMA4_CONFIG_KEYS if family == "gemma4" else ()))


def _gemma4_text_config(cfg: dict) -> dict:
    """Gemma 4's text model's fields at the top level: Gemma4ForConditionalGeneration nests them in `text_config`
    (its own fields, e.g. eos_token_id and tie_word_embeddings, win where both have one); a flat config as it is."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        return cfg
    outer = {k: v for k, v in cfg.items() if k in ("architectures", "eos_token_id", "bos_token_id", "pad_token_id",
                                                    "tie_word_embeddings") and v is not None}
    return {**text, **outer}


def _rope_settings(cfg: dict) -> tuple[float, dict | None, dict]:
    """Return (rope_theta, rope_scaling, extra) from either transformers 4.x or 5.x config forms.

    extra holds what goes to ModelConfig.extra: partial_rotary_factor (top level in 4.x, in
    rope_parameters in 5.x), and, for configs with a RoPE per layer type (Gemma 3 in 5.x:
    {"full_attention": {...}, "sliding_attention": {...}}), the local layers' rope_local_base_freq
    and rope_local_scaling (4.x: rope_local_base_freq at the top level)."""
    params = cfg.get("rope_parameters")
    extra = {}
    partial = cfg.get("partial_rotary_factor") or (params or {}).get("partial_rotary_factor")
    if partial and partial != 1.0:
        extra["partial_rotary_factor"] = float(partial)
    if isinstance(params, dict) and "full_attention" in params:
        local = params.get("sliding_attention") or {}
        if "rope_theta" in local:
            extra["rope_local_base_freq"] = float(local["rope_theta"])
            if _scaling(local):
                extra["rope_local_scaling"] = _scaling(local)
        params = params["full_attention"]
    elif cfg.get("rope_local_scaling"):  # jlight convert's config.json
        extra["rope_local_scaling"] = cfg["rope_local_scaling"]
    theta, scaling = _theta_and_scaling(cfg, params)
    return theta, scaling, extra


def _scaling(params: dict) -> dict | None:
    """The scaling dict of a RoPE's parameters (None: unscaled). Gemma 4's "proportional" RoPE keeps its
    partial_rotary_factor: it shapes that table alone (models/gemma4.py)."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    kept = ("rope_theta",) if rope_type == "proportional" else ("rope_theta", "partial_rotary_factor")
    return None if rope_type == "default" else {k: v for k, v in params.items() if k not in kept}


def _theta_and_scaling(cfg: dict, params) -> tuple[float, dict | None]:
    if isinstance(params, dict) and params:
        return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0))), _scaling(params)
    scaling = cfg.get("rope_scaling")
    return float(cfg.get("rope_theta", 10000.0)), _scaling(scaling) if scaling else None


def read_hf_config_dict(model_dir: str) -> dict:
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        return json.load(f)
