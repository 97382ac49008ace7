"""HF tensor names of the Llama-shaped families whose checkpoints differ from Llama's.

  * Gemma 2/3: four norms per layer. HF's post_attention_layernorm is the norm *after* the
    attention (before the residual add), not the MLP's input norm as in Llama; the MLP's are
    pre_feedforward_layernorm and post_feedforward_layernorm.
  * Phi-3: q/k/v are one qkv_proj ([q; k; v] rows) and gate/up one gate_up_proj ([gate; up]
    rows); `split_fused_tensors` cuts them into Llama's names before mapping, so the params tree,
    quantization and the sharding rules see the separate weights (the engine may fuse them
    again on one device, models/layers.fuse_projections).
  * gpt-oss: the experts' gate_up_proj [experts, embed, 2 * mlp] holds gate and up interleaved
    (columns 0, 2, ... gate; 1, 3, ... up), [in, out] already, with gate_up_proj_bias beside it;
    `split_fused_tensors` turns the pair into gate and up weights whose last input row is the
    bias (models/gpt_oss.py), under the names gate_proj_with_bias / up_proj_with_bias; MXFP4
    checkpoints' experts (NAME_blocks + NAME_scales) are expanded to float32 before that.
"""
from __future__ import annotations

import re
from typing import Callable, Iterable

import numpy as np

from jlight.core.config import ModelConfig
from jlight.loading.fp8_checkpoint import Fp8HostWeight
from jlight.loading import hf_names_gemma4
from jlight.loading.hf_names import map_hf_name
from jlight.loading.mxfp4 import Mxfp4HostWeight, expand_mxfp4

_LAYER_RE = re.compile(r"^(model\.layers\.\d+\.)(.+)$")
# Per-layer tensors whose names differ from Llama's: suffix -> (jlight name, transpose)
_GEMMA_NORMS = {
    "input_layernorm.weight": ("attn_norm", False),
    "post_attention_layernorm.weight": ("post_attn_norm", False),
    "pre_feedforward_layernorm.weight": ("mlp_norm", False),
    "post_feedforward_layernorm.weight": ("post_mlp_norm", False),
}
_GPT_OSS_TENSORS = {
    "self_attn.sinks": ("sinks", False),
    "self_attn.o_proj.bias": ("bo", False),
    "mlp.router.weight": ("router", True),
    "mlp.router.bias": ("router_bias", False),
    "mlp.experts.gate_proj": ("experts_gate", False),
    "mlp.experts.gate_proj_bias": ("experts_gate_bias", False),
    "mlp.experts.up_proj": ("experts_up", False),
    "mlp.experts.up_proj_bias": ("experts_up_bias", False),
    "mlp.experts.down_proj": ("experts_down", False),
    "mlp.experts.down_proj_bias": ("experts_down_bias", False),
}


def _mapper(table: dict) -> Callable:
    """Names in `table` first, then Llama's (hf_names.map_hf_name)."""

    def map_name(name: str):
        m = _LAYER_RE.match(name)
        if m and m.group(2) in table:
            key, transpose = table[m.group(2)]
            return key, int(m.group(1).split(".")[2]), transpose
        return map_hf_name(name)

    return map_name


_MAPPERS = {"gemma": _mapper(_GEMMA_NORMS), "gpt_oss": _mapper(_GPT_OSS_TENSORS)}


def family_name_mapper(config: ModelConfig) -> Callable | None:
    """The name mapper of a family whose names differ from Llama's, else None."""
    if config.family == "gemma4":  # its layers' groups depend on the config
        return hf_names_gemma4.name_mapper(config)
    return _MAPPERS.get(config.family)


def _gpt_oss_experts(prefix: str, gate_up: np.ndarray | Mxfp4HostWeight, bias: np.ndarray):
    """gate_up [X, E, 2F] interleaved (gate columns 0, 2, ...) + bias [X, 2F] -> gate and up [X, E, F] and their
    biases [X, F]; kept MXFP4 weights stay so."""
    gate_up = gate_up if isinstance(gate_up, Mxfp4HostWeight) else np.asarray(gate_up)
    bias = np.asarray(bias)
    for name, cols in (("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2))):
        weight = gate_up.columns(cols) if isinstance(gate_up, Mxfp4HostWeight) else gate_up[..., cols]
        yield f"{prefix}mlp.experts.{name}", weight
        yield f"{prefix}mlp.experts.{name}_bias", bias[..., cols]


def split_fused_tensors(config: ModelConfig, tensors: Iterable[tuple[str, np.ndarray]], keep_mxfp4: bool = False):
    """(name, array) pairs with Phi-3's fused qkv_proj / gate_up_proj cut into Llama's names, and
    gpt-oss's gate_up_proj + gate_up_proj_bias into gate and up weights and their biases
    (MXFP4 experts expanded first, or with keep_mxfp4 kept as stored: loading/mxfp4.py)."""
    if config.family == "gpt_oss":
        tensors = expand_mxfp4(tensors, keep=keep_mxfp4)
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    splits = {
        "self_attn.qkv_proj.weight": (("self_attn.q_proj.weight", q), ("self_attn.k_proj.weight", kv),
                                      ("self_attn.v_proj.weight", kv)),
        "mlp.gate_up_proj.weight": (("mlp.gate_proj.weight", config.intermediate_size),
                                    ("mlp.up_proj.weight", config.intermediate_size)),
    }
    pending = {}  # gpt-oss: layer prefix -> {suffix: tensor} until gate_up_proj and its bias are both read
    for name, tensor in tensors:
        m = _LAYER_RE.match(name)
        if m and m.group(2) in ("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias"):
            got = pending.setdefault(m.group(1), {})
            got[m.group(2)] = tensor
            if len(got) == 2:
                yield from _gpt_oss_experts(m.group(1), got["mlp.experts.gate_up_proj"], got["mlp.experts.gate_up_proj_bias"])
                del pending[m.group(1)]
            continue
        parts = splits.get(m.group(2)) if m else None
        if parts is None:
            yield name, tensor
            continue
        rows = sum(n for _, n in parts)
        if (tensor.values if isinstance(tensor, Fp8HostWeight) else tensor).shape[0] != rows:
            raise ValueError(f"tensor {name} has {tensor.shape[0]} rows but the config implies {rows} "
                             f"({' + '.join(str(n) for _, n in parts)}); config.json does not match the weights")
        start = 0
        for part_name, n in parts:  # HF linear weights are [out, in]: the parts are row blocks
            part = tensor.rows(start, start + n) if isinstance(tensor, Fp8HostWeight) else tensor[start:start + n]
            yield m.group(1) + part_name, part
            start += n
    for prefix, got in pending.items():
        raise ValueError(f"checkpoint has {prefix}{next(iter(got))} without its "
                         f"{'bias' if 'mlp.experts.gate_up_proj' in got else 'weight'}; the file is incomplete")
