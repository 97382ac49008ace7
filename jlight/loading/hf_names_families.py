"""HF tensor names of the Llama-shaped families whose checkpoints differ from Llama's.

  * Gemma 2/3: four norms per layer. HF's post_attention_layernorm is the norm *after* the
    attention (before the residual add), not the MLP's input norm as in Llama; the MLP's are
    pre_feedforward_layernorm and post_feedforward_layernorm.
  * Phi-3: q/k/v are one qkv_proj ([q; k; v] rows) and gate/up one gate_up_proj ([gate; up]
    rows); `split_fused_tensors` cuts them into Llama's names before mapping, so the params tree,
    quantization and the sharding rules see the separate weights (the engine may fuse them
    again on one device, models/layers.fuse_projections).
"""
from __future__ import annotations

import re
from typing import Callable, Iterable

import numpy as np

from jlight.core.config import ModelConfig
from jlight.loading.hf_names import map_hf_name

_LAYER_RE = re.compile(r"^(model\.layers\.\d+\.)(.+)$")
_GEMMA_NORMS = {
    "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "post_attn_norm",
    "pre_feedforward_layernorm.weight": "mlp_norm",
    "post_feedforward_layernorm.weight": "post_mlp_norm",
}


def map_gemma_name(name: str):
    m = _LAYER_RE.match(name)
    if m and m.group(2) in _GEMMA_NORMS:
        return _GEMMA_NORMS[m.group(2)], int(m.group(1).split(".")[2]), False
    return map_hf_name(name)


def family_name_mapper(config: ModelConfig) -> Callable | None:
    """The name mapper of a family whose names differ from Llama's, else None."""
    return map_gemma_name if config.family == "gemma" else None


def split_fused_tensors(config: ModelConfig, tensors: Iterable[tuple[str, np.ndarray]]):
    """(name, array) pairs with Phi-3's fused qkv_proj / gate_up_proj cut into Llama's names."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    splits = {
        "self_attn.qkv_proj.weight": (("self_attn.q_proj.weight", q), ("self_attn.k_proj.weight", kv),
                                      ("self_attn.v_proj.weight", kv)),
        "mlp.gate_up_proj.weight": (("mlp.gate_proj.weight", config.intermediate_size),
                                    ("mlp.up_proj.weight", config.intermediate_size)),
    }
    for name, tensor in tensors:
        m = _LAYER_RE.match(name)
        parts = splits.get(m.group(2)) if m else None
        if parts is None:
            yield name, tensor
            continue
        rows = sum(n for _, n in parts)
        if tensor.shape[0] != rows:
            raise ValueError(f"tensor {name} has {tensor.shape[0]} rows but the config implies {rows} "
                             f"({' + '.join(str(n) for _, n in parts)}); config.json does not match the weights")
        start = 0
        for part_name, n in parts:  # HF linear weights are [out, in]: the parts are row blocks
            yield m.group(1) + part_name, tensor[start:start + n]
            start += n
