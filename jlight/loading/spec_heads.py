"""Speculative heads' checkpoints, by their published tensor names: EAGLE-1 and EAGLE-3 head directories, and
DeepSeek-V3's MTP layer inside the target's own checkpoint.

  EAGLE-1 (e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B): fc.weight [embed, 2 * embed] (and fc.bias),
    layers.0.{self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj, post_attention_layernorm}.weight; an
    embed_tokens.weight copy of the target's is not read (the head shares the target's, and its lm_head).
  EAGLE-3 (e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): fc.weight [embed, 3 * target embed],
    midlayer.{input_layernorm, hidden_norm, self_attn.{q,k,v}_proj (2 * embed inputs), self_attn.o_proj,
    post_attention_layernorm, mlp.*}.weight, norm.weight, lm_head.weight [draft vocab, embed], d2t [draft
    vocab] (draft id -> target id offset); t2d is not read; embed_tokens.weight when the head has its own.
  Names may carry a "model." prefix, and EAGLE-3's layer "layers.0." instead of "midlayer.".
config.json is a Llama config of the head's layer (EAGLE-3's architecture LlamaForCausalLMEagle3, with
draft_vocab_size, target_hidden_size and eagle_config.eagle_aux_hidden_state_layer_ids where given).
  DeepSeek MTP: model.layers.{num_hidden_layers}.{enorm, hnorm, eh_proj [embed, 2 * embed],
    shared_head.norm, shared_head.head [vocab, embed], embed_tokens}.weight and a DeepSeek decoder
    layer's tensors under the same prefix (config.json's num_nextn_predict_layers >= 1; the first is read).
"""
from __future__ import annotations

import json
import os

import jax
import numpy as np

from jlight.core.config import ModelConfig
from jlight.core.errors import ModelLoadError
from jlight.loading import safetensors_loader as st
from jlight.loading.fp8_checkpoint import Fp8HostWeight, fp8_scheme, fp8_tensors
from jlight.loading.hf_names_moe import deepseek_layer_tensor
from jlight.models import deepseek_mtp, eagle

# Tensors of the head's one layer, after its prefix: (params name, HF [out, in] linear weight).
_LAYER_TENSORS = {
    "self_attn.q_proj.weight": ("wq", True),
    "self_attn.k_proj.weight": ("wk", True),
    "self_attn.v_proj.weight": ("wv", True),
    "self_attn.o_proj.weight": ("wo", True),
    "mlp.gate_proj.weight": ("w_gate", True),
    "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True),
    "post_attention_layernorm.weight": ("mlp_norm", False),
    "input_layernorm.weight": ("attn_norm", False),  # EAGLE-3's embedding norm (EAGLE-1 has no input norm)
    "hidden_norm.weight": ("hidden_norm", False),
}
_HEAD_TENSORS = {
    "fc.weight": ("fc", True),
    "fc.bias": ("fc_bias", False),
    "norm.weight": ("final_norm", False),
    "lm_head.weight": ("lm_head", True),
    "d2t": ("d2t", False),
    "embed_tokens.weight": ("embed", False),
}
_LAYER_PREFIXES = ("midlayer.", "layers.0.")


def read_tensors(model_dir: str) -> dict[str, np.ndarray]:
    """Every tensor of a (small) head checkpoint, by name."""
    out = {}
    for name, tensor in st.stream_safetensors(st.safetensors_files(model_dir)):
        out[name.removeprefix("model.")] = np.asarray(tensor)
    return out


def eagle_aux_layers(hf: dict, target_layers: int) -> tuple[int, ...]:
    """EAGLE-3's tapped target layers: the config's eagle_aux_hidden_state_layer_ids, else vLLM's default
    (2, L // 2, L - 3) of a target of L layers."""
    ids = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or hf.get("eagle_aux_hidden_state_layer_ids")
    ids = tuple(int(i) for i in ids) if ids else (2, target_layers // 2, target_layers - 3)
    if len(ids) != 3 or any(not 0 <= i <= target_layers for i in ids):
        raise ValueError(f"the EAGLE-3 head's eagle_aux_hidden_state_layer_ids {list(ids)} must be three layers of the "
                         f"target's {target_layers} (0..{target_layers}); fix the head's config.json")
    return ids


def load_eagle_head(model_dir: str, eagle3: bool, target_config: ModelConfig, dtype):
    """(the head layer's ModelConfig, models.eagle.EagleHead, tapped target layers or (), params tree) of the
    head at model_dir. The tree lacks what the head shares with the target (its embedding, EAGLE-1's lm_head)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        hf = json.load(f)
    config = ModelConfig.from_hf_dict({**hf, "architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    tensors = read_tensors(model_dir)
    if config.num_layers != 1:
        raise ValueError(f"the EAGLE head at {model_dir} has {config.num_layers} layers; jlight runs one-layer heads")
    layer, top = {}, {}
    for name, array in tensors.items():
        prefix = next((p for p in _LAYER_PREFIXES if name.startswith(p)), None)
        if prefix is not None and name[len(prefix):] in _LAYER_TENSORS:
            key, linear = _LAYER_TENSORS[name[len(prefix):]]
            layer[key] = array.T if linear else array
        elif name in _HEAD_TENSORS:
            key, linear = _HEAD_TENSORS[name]
            top[key] = array.T if linear else array
    draft_vocab = top["lm_head"].shape[1] if eagle3 and "lm_head" in top else config.vocab_size
    head = eagle.EagleHead(eagle3=eagle3, target_hidden_size=int(hf.get("target_hidden_size") or config.hidden_size),
                           draft_vocab_size=int(hf.get("draft_vocab_size") or draft_vocab), fc_bias="fc_bias" in top and not eagle3,
                           norm_before_residual=bool(hf.get("norm_before_residual", False)))
    if config.vocab_size != target_config.vocab_size or head.target_hidden_size != target_config.hidden_size or (
            not eagle3 and config.hidden_size != target_config.hidden_size):
        raise ValueError(f"it is a head for another target: vocabulary {config.vocab_size}, hidden size "
                         f"{head.target_hidden_size}; the target's are {target_config.vocab_size} and "
                         f"{target_config.hidden_size}; use the head trained for this model")
    if not eagle3:
        layer.pop("attn_norm", None)
        top.pop("embed", None)
        top.pop("lm_head", None)
    elif "d2t" not in top and head.draft_vocab_size == config.vocab_size:
        top["d2t"] = np.zeros(config.vocab_size, np.int64)  # the whole vocabulary: draft ids are target ids
    shapes = eagle.head_param_shapes(config, head)
    shared = {"embed"} | (set() if eagle3 else {"lm_head"})
    params = {}
    for key, want in shapes.items():
        if key == "layer":
            missing = sorted(set(want) - set(layer))
            if missing:
                raise ModelLoadError(f"the EAGLE head at {model_dir} is missing its layer's {missing}; expected "
                                     f"{'midlayer' if eagle3 else 'layers.0'}.* tensors")
            params["layer"] = {k: _put(layer[k], want[k], f"layer.{k}", dtype) for k in want}
        elif key in top:
            params[key] = _put(top[key], want, key, np.int32 if key == "d2t" else dtype)
        elif key not in shared:
            raise ModelLoadError(f"the EAGLE head at {model_dir} has no {key} tensor "
                                 f"({[n for n, (k, _) in _HEAD_TENSORS.items() if k == key][0]})")
    taps = eagle_aux_layers(hf, target_config.num_layers) if eagle3 else ()
    return config, head, taps, params


def _put(array: np.ndarray, shape: tuple, name: str, dtype):
    if tuple(array.shape) != tuple(shape):
        raise ModelLoadError(f"speculative head tensor {name} has shape {tuple(array.shape)}, its config implies "
                             f"{tuple(shape)}; the config.json does not match the weights")
    return jax.device_put(array.astype(dtype))


_MTP_TENSORS = {
    "enorm.weight": ("enorm", False),
    "hnorm.weight": ("hnorm", False),
    "eh_proj.weight": ("eh_proj", True),
    "shared_head.norm.weight": ("head_norm", False),
    "shared_head.head.weight": ("lm_head", True),
    "embed_tokens.weight": ("embed", False),
}


def load_mtp_layer(model_dir: str, config: ModelConfig, dtype) -> dict:
    """The params tree (models/deepseek_mtp.py) of the first MTP layer in a DeepSeek checkpoint of `config`;
    without `embed` when the layer holds no embed_tokens copy (it then shares the target's)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        hf = json.load(f)
    if not hf.get("num_nextn_predict_layers"):
        raise ValueError(f"{model_dir} has no MTP layer (config.json's num_nextn_predict_layers is "
                         f"{hf.get('num_nextn_predict_layers', 'absent')}); use a checkpoint that keeps it (DeepSeek-V3/R1)")
    prefix = f"model.layers.{config.num_layers}."
    tensors = st.stream_safetensors(st.safetensors_files(model_dir), keep=lambda name: name.startswith(prefix))
    scheme = fp8_scheme(hf)
    if scheme is not None:
        tensors = fp8_tensors(tensors, scheme)
    top, layer, experts = {}, {}, {}
    for name, tensor in tensors:
        array = tensor.dequantize() if isinstance(tensor, Fp8HostWeight) else np.asarray(tensor)
        suffix = name[len(prefix):]
        if suffix in _MTP_TENSORS:
            key, linear = _MTP_TENSORS[suffix]
            top[key] = array.T if linear else array
            continue
        found = deepseek_layer_tensor(suffix)
        if found is None:
            continue
        key, expert, linear = found
        array = array.T if linear else array
        if expert is None:
            layer[key] = array
        else:
            experts.setdefault(key, {})[expert] = array
    if not (top or layer or experts):
        raise ValueError(f"{model_dir} has no MTP layer tensors ({prefix}*) although config.json's num_nextn_predict_layers "
                         f"is {hf['num_nextn_predict_layers']} (transformers' save_pretrained drops them); use the "
                         "checkpoint as DeepSeek publishes it")
    shapes = deepseek_mtp.mtp_param_shapes(config)
    for key, parts in experts.items():
        missing = [e for e in range(shapes["layer"][key][0]) if e not in parts]
        if missing:
            raise ModelLoadError(f"{model_dir} is missing {prefix}mlp.experts.{missing[:5]} ({key}); the checkpoint is incomplete")
        layer[key] = np.stack([parts[e] for e in range(len(parts))])
    missing = sorted(set(shapes["layer"]) - set(layer)) + sorted(k for k in set(shapes) - set(top) - {"layer", "embed"})
    if missing:
        raise ModelLoadError(f"{model_dir} is missing the MTP layer's {missing} (tensors {prefix}*); the checkpoint is incomplete")
    params = {"layer": {k: _put(layer[k], want, f"layer.{k}", dtype) for k, want in shapes["layer"].items()}}
    params.update({k: _put(top[k], shapes[k], k, dtype) for k in top})
    return params
