"""Maps HF tensor names of the MoE / MLA families to jlight's params trees.

A mapper returns (key, index, transpose) like `hf_names.map_hf_name`, where
  * key is "param" (in the stacked "layers" group) or "group.param" (DeepSeek's first dense
    layers live in their own "dense_layers" stack, since their MLP has other shapes);
  * index is None (a global tensor), the layer's index in its group, or (layer, expert) for
    one expert of a stacked [layers, experts, in, out] weight.
HF linear weights are [out, in]; jlight stores [in, out] (transpose=True).
"""
from __future__ import annotations

import re
from typing import Callable

from jlight.core.config import ModelConfig
from jlight.loading.hf_names import map_hf_name

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")

# Expert projection names (Mixtral's w1/w3/w2 and everyone else's) -> stacked expert weight.
_EXPERT_TENSORS = {
    "w1": "experts_gate", "w3": "experts_up", "w2": "experts_down",
    "gate_proj": "experts_gate", "up_proj": "experts_up", "down_proj": "experts_down",
}
# Mixtral / Qwen2-MoE / Qwen3-MoE per-layer tensors beyond the Llama attention ones.
_SPARSE_TENSORS = {
    "block_sparse_moe.gate.weight": ("router", True),
    "mlp.gate.weight": ("router", True),
    "mlp.shared_expert.gate_proj.weight": ("shared_gate", True),
    "mlp.shared_expert.up_proj.weight": ("shared_up", True),
    "mlp.shared_expert.down_proj.weight": ("shared_down", True),
    "mlp.shared_expert_gate.weight": ("shared_expert_gate", True),
}
# DeepSeek-V2/V3 per-layer tensors (MLA attention and both MLP kinds).
_DEEPSEEK_TENSORS = {
    "input_layernorm.weight": ("attn_norm", False),
    "post_attention_layernorm.weight": ("mlp_norm", False),
    "self_attn.q_proj.weight": ("wq", True),
    "self_attn.q_a_proj.weight": ("wq_a", True),
    "self_attn.q_a_layernorm.weight": ("q_a_norm", False),
    "self_attn.q_b_proj.weight": ("wq_b", True),
    "self_attn.kv_a_proj_with_mqa.weight": ("wkv_a", True),
    "self_attn.kv_a_layernorm.weight": ("kv_a_norm", False),
    "self_attn.kv_b_proj.weight": ("wkv_b", True),
    "self_attn.o_proj.weight": ("wo", True),
    "mlp.gate_proj.weight": ("w_gate", True),
    "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True),
    "mlp.gate.weight": ("router", True),
    "mlp.gate.e_score_correction_bias": ("router_bias", False),
    "mlp.shared_experts.gate_proj.weight": ("shared_gate", True),
    "mlp.shared_experts.up_proj.weight": ("shared_up", True),
    "mlp.shared_experts.down_proj.weight": ("shared_down", True),
}


def map_sparse_moe_name(name: str):
    """Mixtral, Qwen2-MoE and Qwen3-MoE names (attention and norms as in the Llama family)."""
    m = _LAYER_RE.match(name)
    if m:
        layer, suffix = int(m.group(1)), m.group(2)
        e = _EXPERT_RE.match(suffix)
        if e and e.group(2) in _EXPERT_TENSORS:
            return _EXPERT_TENSORS[e.group(2)], (layer, int(e.group(1))), True
        if suffix in _SPARSE_TENSORS:
            key, linear = _SPARSE_TENSORS[suffix]
            return key, layer, linear
    return map_hf_name(name)


def deepseek_layer_tensor(suffix: str):
    """A DeepSeek layer's tensor by its name within the layer -> (params key, expert index or None, transpose),
    or None for one jlight does not read."""
    e = _EXPERT_RE.match(suffix)
    if e and e.group(2) in _EXPERT_TENSORS:
        return _EXPERT_TENSORS[e.group(2)], int(e.group(1)), True
    if suffix in _DEEPSEEK_TENSORS:
        key, linear = _DEEPSEEK_TENSORS[suffix]
        return key, None, linear
    return None


def deepseek_name_mapper(config: ModelConfig) -> Callable:
    """DeepSeek names; layers below first_k_dense_replace go to the "dense_layers" stack."""
    num_dense = config.extra.get("first_k_dense_replace", 0) or 0

    def mapper(name: str):
        m = _LAYER_RE.match(name)
        if not m:
            return map_hf_name(name)  # embed, final norm, lm_head
        layer, suffix = int(m.group(1)), m.group(2)
        if layer >= config.num_layers:
            return None  # e.g. DeepSeek-V3's multi-token-prediction layer 61
        group, index = ("dense_layers", layer) if layer < num_dense else ("layers", layer - num_dense)
        found = deepseek_layer_tensor(suffix)
        if found is None:
            return None
        key, expert, linear = found
        return f"{group}.{key}", index if expert is None else (index, expert), linear

    return mapper


def moe_name_mapper(config: ModelConfig) -> Callable | None:
    """The name mapper for the config's family, or None when it is not an MoE / MLA family."""
    family = config.family
    if family == "mixtral":
        return map_sparse_moe_name
    if family == "deepseek":
        return deepseek_name_mapper(config)
    return None
