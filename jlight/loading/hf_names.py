"""Maps HF Llama-family tensor names to jlight's params tree.

HF linear weights are [out, in]; jlight stores [in, out]. Per-layer tensors go to a
stacked array's slot `layer` (see models/llama.py).
"""
from __future__ import annotations

import re

# HF suffix within a layer -> (jlight name, is_linear_weight)
_LAYER_TENSORS = {
    "input_layernorm.weight": ("attn_norm", False),
    "self_attn.q_proj.weight": ("wq", True),
    "self_attn.k_proj.weight": ("wk", True),
    "self_attn.v_proj.weight": ("wv", True),
    "self_attn.o_proj.weight": ("wo", True),
    "self_attn.q_proj.bias": ("bq", False),
    "self_attn.k_proj.bias": ("bk", False),
    "self_attn.v_proj.bias": ("bv", False),
    "self_attn.q_norm.weight": ("q_norm", False),
    "self_attn.k_norm.weight": ("k_norm", False),
    "post_attention_layernorm.weight": ("mlp_norm", False),
    "mlp.gate_proj.weight": ("w_gate", True),
    "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True),
}
_GLOBAL_TENSORS = {
    "model.embed_tokens.weight": ("embed", False),
    "model.norm.weight": ("final_norm", False),
    "lm_head.weight": ("lm_head", True),
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def map_hf_name(name: str) -> tuple[str, int | None, bool] | None:
    """Return (jlight name, layer index or None, transpose?) or None for tensors jlight ignores
    (e.g. rotary_emb.inv_freq buffers)."""
    if name in _GLOBAL_TENSORS:
        key, linear = _GLOBAL_TENSORS[name]
        return key, None, linear
    m = _LAYER_RE.match(name)
    if m and m.group(2) in _LAYER_TENSORS:
        key, linear = _LAYER_TENSORS[m.group(2)]
        return key, int(m.group(1)), linear
    return None
