"""Maps HF tensor names of the hybrid families to their params trees (models/hybrid.py): layer i of
the checkpoint goes to the group of its kind ("mamba_layers", "attn_layers", "delta_layers") at its
index among the layers of that kind.

A mapper returns (key, index, transpose) like `hf_names.map_hf_name`, or a list of them for a tensor
that fills several weights; transpose is a bool or a function of the array: conv1d weights [C, 1, K]
become [K, C]; a fused expert gate/up [experts, 2 * I, E] (transformers 5's layout) becomes
experts_gate and experts_up [experts, E, I], Granite's shared MLP input [2F, E] shared_gate and shared_up; a [experts, out, in] tensor becomes [experts, in, out].
Per-expert tensors (`experts.{j}.gate_proj.weight`, the Hub checkpoints' layout) fill one expert each.
"""
from __future__ import annotations

import re
from typing import Callable

from jlight.core.config import ModelConfig
from jlight.loading.hf_names import map_hf_name
from jlight.models import granite_hybrid, nemotron_h, qwen3_next

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^(?:mlp|block_sparse_moe|mixer)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_NAMES = {"gate_proj": "experts_gate", "up_proj": "experts_up", "down_proj": "experts_down"}


def _conv(a):
    return a[:, 0, :].T  # [C, 1, K] -> [K, C]


def _experts_t(a):
    return a.transpose(0, 2, 1)  # [experts, out, in] -> [experts, in, out]


def _gate_half(a):
    return a[:, : a.shape[1] // 2].transpose(0, 2, 1)


def _up_half(a):
    return a[:, a.shape[1] // 2:].transpose(0, 2, 1)


# The tensors any layer may have: norms and its MLP side (keys "fused_gate_up" fill two weights).
_ATTENTION = {
    "self_attn.q_proj.weight": ("wq", True), "self_attn.k_proj.weight": ("wk", True),
    "self_attn.v_proj.weight": ("wv", True), "self_attn.o_proj.weight": ("wo", True),
    "self_attn.q_proj.bias": ("bq", False), "self_attn.k_proj.bias": ("bk", False),
    "self_attn.v_proj.bias": ("bv", False), "self_attn.o_proj.bias": ("bo", False),
    "self_attn.q_norm.weight": ("q_norm", False), "self_attn.k_norm.weight": ("k_norm", False),
}
_COMMON = {
    "input_layernorm.weight": ("attn_norm", False),
    "post_attention_layernorm.weight": ("mlp_norm", False),
    "norm.weight": ("norm", False),  # Nemotron-H's one norm a layer
    # Granite: the shared MLP (one [2F, E] tensor, gate then up) and the routed experts
    "shared_mlp.input_linear.weight": ("fused_shared_gate_up", None),
    "shared_mlp.output_linear.weight": ("shared_down", True),
    "block_sparse_moe.router.layer.weight": ("router", True),
    "block_sparse_moe.router.weight": ("router", True),
    "block_sparse_moe.experts.gate_up_proj": ("fused_gate_up", None),
    "block_sparse_moe.input_linear.weight": ("fused_gate_up", None),  # the Hub checkpoints' name
    "block_sparse_moe.experts.down_proj": ("experts_down", _experts_t),
    "block_sparse_moe.output_linear.weight": ("experts_down", _experts_t),
    # Qwen3-Next: router, experts, the gated shared expert, or a dense MLP
    "mlp.gate.weight": ("router", True),
    "mlp.experts.gate_up_proj": ("fused_gate_up", None),
    "mlp.experts.down_proj": ("experts_down", _experts_t),
    "mlp.shared_expert.gate_proj.weight": ("shared_gate", True),
    "mlp.shared_expert.up_proj.weight": ("shared_up", True),
    "mlp.shared_expert.down_proj.weight": ("shared_down", True),
    "mlp.shared_expert_gate.weight": ("shared_expert_gate", True),
    "mlp.gate_proj.weight": ("w_gate", True),
    "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True),
}
_MAMBA = {
    "mamba.in_proj.weight": ("in_proj", True),
    "mamba.in_proj.bias": ("in_proj_bias", False),
    "mamba.conv1d.weight": ("conv_weight", _conv),
    "mamba.conv1d.bias": ("conv_bias", False),
    "mamba.dt_bias": ("dt_bias", False),
    "mamba.A_log": ("A_log", False),
    "mamba.D": ("D", False),
    "mamba.norm.weight": ("gate_norm", False),
    "mamba.out_proj.weight": ("out_proj", True),
    "mamba.out_proj.bias": ("out_proj_bias", False),
}
_NEMOTRON_MAMBA = {k.replace("mamba.", "mixer.", 1): v for k, v in _MAMBA.items()}
_NEMOTRON_ATTENTION = {k.replace("self_attn.", "mixer.", 1): v for k, v in _ATTENTION.items()}
_NEMOTRON_MLP = {"mixer.up_proj.weight": ("up_proj", True), "mixer.down_proj.weight": ("down_proj", True),
                 "mixer.up_proj.bias": ("up_bias", False), "mixer.down_proj.bias": ("down_bias", False)}
_NEMOTRON_MOE = {
    "mixer.gate.weight": ("router", True), "mixer.gate.e_score_correction_bias": ("router_bias", False),
    "mixer.experts.up_proj": ("experts_up", _experts_t), "mixer.experts.down_proj": ("experts_down", _experts_t),
    "mixer.shared_experts.up_proj.weight": ("shared_up", True),
    "mixer.shared_experts.down_proj.weight": ("shared_down", True),
    "mixer.fc1_latent_proj.weight": ("latent_in", True), "mixer.fc2_latent_proj.weight": ("latent_out", True),
}
_NEMOTRON_GLOBAL = {"model.embeddings.weight": ("embed", False), "model.norm_f.weight": ("final_norm", False)}
_DELTA = {
    "linear_attn.in_proj_qkvz.weight": ("in_proj_qkvz", True),
    "linear_attn.in_proj_ba.weight": ("in_proj_ba", True),
    "linear_attn.in_proj_qkv.weight": ("in_proj_qkv", True),  # Qwen3.5
    "linear_attn.in_proj_z.weight": ("in_proj_z", True),
    "linear_attn.in_proj_b.weight": ("in_proj_b", True),
    "linear_attn.in_proj_a.weight": ("in_proj_a", True),
    "linear_attn.conv1d.weight": ("conv_weight", _conv),
    "linear_attn.dt_bias": ("dt_bias", False),
    "linear_attn.A_log": ("A_log", False),
    "linear_attn.norm.weight": ("gate_norm", False),
    "linear_attn.out_proj.weight": ("out_proj", True),
}


def group_mapper(kinds: list[str], groups: dict[str, str], tables: dict[str, dict]) -> Callable:
    """A mapper over layers whose kinds are `kinds`; groups: kind -> group name; tables: kind -> its mixer's tensors."""
    index, seen = [], {}
    for kind in kinds:
        index.append(seen.get(kind, 0))
        seen[kind] = index[-1] + 1

    def mapper(name: str):
        if name.startswith("backbone."):  # Nemotron-H's Hub checkpoints
            name = "model." + name[len("backbone."):]
        m = _LAYER_RE.match(name)
        if not m:
            if name in _NEMOTRON_GLOBAL:
                key, transpose = _NEMOTRON_GLOBAL[name]
                return key, None, transpose
            return map_hf_name(name)  # embed, final norm, lm_head
        layer, suffix = int(m.group(1)), m.group(2)
        if layer >= len(kinds):
            return None  # e.g. Qwen3-Next's multi-token-prediction layers
        group, i = groups[kinds[layer]], index[layer]
        e = _EXPERT_RE.match(suffix)
        if e:
            return f"{group}.{_EXPERT_NAMES[e.group(2)]}", (i, int(e.group(1))), True
        entry = tables[kinds[layer]].get(suffix) or _COMMON.get(suffix)
        if entry is None:
            return None
        key, transpose = entry
        if key == "fused_gate_up":
            return [(f"{group}.experts_gate", i, _gate_half), (f"{group}.experts_up", i, _up_half)]
        if key == "fused_shared_gate_up":  # [2F, E]: gate rows, then up rows
            return [(f"{group}.shared_gate", i, lambda a: a[: a.shape[0] // 2].T),
                    (f"{group}.shared_up", i, lambda a: a[a.shape[0] // 2:].T)]
        return f"{group}.{key}", i, transpose

    return mapper


def hybrid_name_mapper(config: ModelConfig) -> Callable | None:
    """The name mapper of a hybrid family's config, or None for other families."""
    if config.family == "granite_hybrid":
        return group_mapper(granite_hybrid.layer_kinds(config), {"mamba": "mamba_layers", "attention": "attn_layers"},
                            {"mamba": _MAMBA, "attention": _ATTENTION})
    if config.family == "qwen3_next":
        return group_mapper(qwen3_next.layer_kinds(config), {"delta": "delta_layers", "attention": "attn_layers"},
                            {"delta": _DELTA, "attention": _ATTENTION})
    if config.family == "nemotron_h":
        return group_mapper(nemotron_h.layer_kinds(config), {"mamba": "mamba_layers", "attention": "attn_layers",
                                                             "mlp": "mlp_layers", "moe": "moe_layers"},
                            {"mamba": _NEMOTRON_MAMBA, "attention": _NEMOTRON_ATTENTION, "mlp": _NEMOTRON_MLP,
                             "moe": _NEMOTRON_MOE})
    return None
