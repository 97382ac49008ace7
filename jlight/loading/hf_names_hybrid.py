"""Maps HF tensor names of the hybrid families to their params trees (models/hybrid.py): layer i of
the checkpoint goes to the group of its kind ("mamba_layers", "attn_layers", ...) at its index
among the layers of that kind.

A mapper returns (key, index, transpose) like `hf_names.map_hf_name`; transpose is True ([out, in]
-> [in, out]) or a tuple of axes (3-D expert weights [experts, out, in] -> [experts, in, out]).
"""
from __future__ import annotations

import re
from typing import Callable

from jlight.core.config import ModelConfig
from jlight.loading.hf_names import map_hf_name
from jlight.models import granite_hybrid

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERTS_T = (0, 2, 1)

# GraniteMoeHybrid: tensors of every layer, of its Mamba mixer, of its attention.
_GRANITE_COMMON = {
    "input_layernorm.weight": ("attn_norm", False),
    "post_attention_layernorm.weight": ("mlp_norm", False),
    "shared_mlp.input_linear.weight": ("shared_in", True),
    "shared_mlp.output_linear.weight": ("shared_out", True),
    "block_sparse_moe.router.layer.weight": ("router", True),
    "block_sparse_moe.router.weight": ("router", True),
    "block_sparse_moe.experts.gate_up_proj": ("experts_gate_up", _EXPERTS_T),
    "block_sparse_moe.experts.down_proj": ("experts_down", _EXPERTS_T),
    "block_sparse_moe.input_linear.weight": ("experts_gate_up", _EXPERTS_T),  # older checkpoints' names
    "block_sparse_moe.output_linear.weight": ("experts_down", _EXPERTS_T),
}
_GRANITE_MAMBA = {
    "mamba.in_proj.weight": ("in_proj", True),
    "mamba.in_proj.bias": ("in_proj_bias", False),
    "mamba.conv1d.weight": ("conv_weight", "conv"),
    "mamba.conv1d.bias": ("conv_bias", False),
    "mamba.dt_bias": ("dt_bias", False),
    "mamba.A_log": ("A_log", False),
    "mamba.D": ("D", False),
    "mamba.norm.weight": ("gate_norm", False),
    "mamba.out_proj.weight": ("out_proj", True),
    "mamba.out_proj.bias": ("out_proj_bias", False),
}
_GRANITE_ATTENTION = {
    "self_attn.q_proj.weight": ("wq", True), "self_attn.k_proj.weight": ("wk", True),
    "self_attn.v_proj.weight": ("wv", True), "self_attn.o_proj.weight": ("wo", True),
    "self_attn.q_proj.bias": ("bq", False), "self_attn.k_proj.bias": ("bk", False),
    "self_attn.v_proj.bias": ("bv", False), "self_attn.o_proj.bias": ("bo", False),
}
CONV = (2, 1, 0)  # HF conv1d.weight [channels, 1, K] -> [K, 1, channels]; assemble drops the 1-sized axis


def group_mapper(kinds: list[str], groups: dict[str, str], tables: dict[str, dict], common: dict) -> Callable:
    """A mapper over layers whose kinds are `kinds`; groups: kind -> group name; tables: kind -> its tensors."""
    index = []
    seen: dict[str, int] = {}
    for kind in kinds:
        index.append(seen.get(kind, 0))
        seen[kind] = index[-1] + 1

    def mapper(name: str):
        m = _LAYER_RE.match(name)
        if not m:
            return map_hf_name(name)  # embed, final norm, lm_head
        layer, suffix = int(m.group(1)), m.group(2)
        if layer >= len(kinds):
            return None
        kind = kinds[layer]
        entry = tables[kind].get(suffix) or common.get(suffix)
        if entry is None:
            return None
        key, transpose = entry
        return f"{groups[kind]}.{key}", index[layer], CONV if transpose == "conv" else transpose

    return mapper


def hybrid_name_mapper(config: ModelConfig) -> Callable | None:
    """The name mapper of a hybrid family's config, or None for other families."""
    if config.family == "granite_hybrid":
        from_kind = {"mamba": "mamba_layers", "attention": "attn_layers"}
        return group_mapper(granite_hybrid.layer_kinds(config), from_kind, {"mamba": _GRANITE_MAMBA, "attention": _GRANITE_ATTENTION},
                            _GRANITE_COMMON)
    return None
