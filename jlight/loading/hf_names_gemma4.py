"""HF tensor names of Gemma 4's text model (models/gemma4.py): layer i goes to its group ("sliding_layers",
"full_layers", "shared_sliding_layers", "shared_full_layers") at its index in that group.

Gemma4ForConditionalGeneration stores the text model under `model.language_model.*` (read as `model.*`) and
its vision and audio towers under `model.vision_tower`, `model.embed_vision`, `model.audio_tower`,
`model.embed_audio` (skipped). The norms are Gemma's four (hf_names_families._GEMMA_NORMS), `layer_scalar` a
stored [1] buffer; the experts' gate_up_proj [experts, 2 * I, E] (gate rows first) splits into experts_gate
and experts_up [experts, E, I], down_proj [experts, E, I] becomes experts_down [experts, I, E]. A KV-shared
layer's k/v projections, if a file holds them, fill nothing (its group has none). The LM head is tied.
"""
from __future__ import annotations

import re
from typing import Callable

from jlight.core.config import ModelConfig
from jlight.loading.hf_names import map_hf_name
from jlight.loading.hf_names_hybrid import _experts_t, _gate_half, _up_half
from jlight.models import gemma4

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_TOWERS = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.",
           "model.multi_modal_projector.")
# suffix within a layer -> (jlight name, transpose: bool or a function of the array)
_LAYER_TENSORS = {
    "input_layernorm.weight": ("attn_norm", False),
    "post_attention_layernorm.weight": ("post_attn_norm", False),
    "pre_feedforward_layernorm.weight": ("mlp_norm", False),
    "post_feedforward_layernorm.weight": ("post_mlp_norm", False),
    "self_attn.q_proj.weight": ("wq", True),
    "self_attn.k_proj.weight": ("wk", True),
    "self_attn.v_proj.weight": ("wv", True),
    "self_attn.o_proj.weight": ("wo", True),
    "self_attn.q_norm.weight": ("q_norm", False),
    "self_attn.k_norm.weight": ("k_norm", False),
    "mlp.gate_proj.weight": ("w_gate", True),
    "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True),
    "layer_scalar": ("layer_scalar", False),
    "per_layer_input_gate.weight": ("ple_gate", True),
    "per_layer_projection.weight": ("ple_out", True),
    "post_per_layer_input_norm.weight": ("ple_post_norm", False),
    "router.proj.weight": ("router", True),
    "router.scale": ("router_scale", False),
    "router.per_expert_scale": ("expert_scale", False),
    "experts.down_proj": ("experts_down", _experts_t),
    "post_feedforward_layernorm_1.weight": ("post_mlp_norm_1", False),
    "pre_feedforward_layernorm_2.weight": ("moe_norm", False),
    "post_feedforward_layernorm_2.weight": ("post_moe_norm", False),
}
_GLOBAL_TENSORS = {
    "model.embed_tokens_per_layer.weight": ("ple_embed", False),
    "model.per_layer_model_projection.weight": ("ple_proj", True),
    "model.per_layer_projection_norm.weight": ("ple_norm", False),
}


def name_mapper(config: ModelConfig) -> Callable:
    plan = gemma4.plan(config)

    def mapper(name: str):
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model."):]
        if name.startswith(_TOWERS):
            return None
        if name in _GLOBAL_TENSORS:
            key, transpose = _GLOBAL_TENSORS[name]
            return key, None, transpose
        m = _LAYER_RE.match(name)
        if not m:
            return map_hf_name(name)  # embed, final norm, lm_head
        layer, suffix = int(m.group(1)), m.group(2)
        if layer >= len(plan.types):
            return None
        group = gemma4.GROUPS[(plan.types[layer], layer >= plan.num_pool_layers)]
        i = plan.group_index[layer]
        if suffix == "experts.gate_up_proj":
            return [(f"{group}.experts_gate", i, _gate_half), (f"{group}.experts_up", i, _up_half)]
        if suffix not in _LAYER_TENSORS:
            return None
        key, transpose = _LAYER_TENSORS[suffix]
        return f"{group}.{key}", i, transpose

    return mapper
