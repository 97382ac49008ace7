"""Reads llama.cpp GGUF files: the model config from the metadata and the weights, dequantized.

Tensors are yielded one at a time under their HF names, so `assemble_params` and
`hf_names.py` serve GGUF and safetensors alike. The llama.cpp conventions undone here:
- GGUF dims are listed fastest-first; the reader's numpy arrays already come out in HF's
  [out, in] row-major order, so no transpose is needed beyond the HF one.
- llama.cpp's converter permutes the rows of Q and K of "llama" and "smollm3" models (its LlamaModel
  and subclasses) so that RoPE pairs adjacent elements (GPT-J style); jlight's RoPE is HF's rotate-half,
  so the permutation is inverted. Qwen2/Qwen3, Gemma, Phi-3 and gpt-oss GGUFs are not permuted by the
  converter and are left as they are.
- Gemma 2/3: the converter stores every RMSNorm weight plus one (llama.cpp's norm multiplies by
  the weight; Gemma's by 1 + weight), so one is taken off again. The metadata carries no
  query_pre_attn_scalar, local RoPE base or layer pattern: llama.cpp derives them from the
  architecture, and so does `gguf_config` (scale head_dim, or hidden / heads for the 27B models;
  local layers' RoPE base 10,000; Gemma 3 five local layers to one global, Gemma 2 alternating).
- Phi-3 ("phi3"): q/k/v are one attn_qkv ([q; k; v] rows) and gate/up one ffn_up ([gate; up] rows, no
  ffn_gate), not permuted; they are cut into Llama's names here (so blocks kept with keep_blocks are cut by
  rows too). The metadata has no head_dim (hidden / heads) and gives the rotated dimensions as
  rope.dimension_count (partial rotary); LongRoPE's factors are the tensors rope_factors_long /
  rope_factors_short, with rope.scaling.original_context_length and rope.scaling.attn_factor, and no
  rope.scaling.type. sliding_window 0 means none.
- SmolLM3 ("smollm3"): Llama's tensors, Q/K permuted as Llama's. No key names the layers without RoPE:
  llama.cpp leaves it out of every 4th layer (layer i uses RoPE unless (i + 1) % 4 == 0), as does
  HF's default no_rope_layer_interval; `gguf_config` writes that no_rope_layers list.
- gpt-oss ("gpt-oss"): q/k/v/o biases, attn_sinks, post_attention_norm (HF's post_attention_layernorm,
  the MLP's input norm), the router ffn_gate_inp (+ bias) and the experts ffn_gate_exps / ffn_up_exps /
  ffn_down_exps [experts, out, in] with their biases (or ffn_gate_up_exps, [gate; up] rows). The HF
  checkpoint interleaves gate and up (gate_up_proj columns 0, 2, ... gate); `_gpt_oss_experts` interleaves
  them again, so the stream carries HF's gate_up_proj (+ _bias) and down_proj. MXFP4 experts become HF's
  _blocks / _scales pair (mxfp4.from_ggml_mxfp4: ggml packs elements j and j + 16 in byte j of a block,
  HF elements 2j and 2j + 1), expanded later by mxfp4.expand_mxfp4 like an HF MXFP4 checkpoint's. Layers
  alternate sliding (even) and full (odd) windows, and the clamped SwiGLU's limit 7.0 and alpha 1.702 are
  llama.cpp's constants: no key carries them. YaRN's ramp is not truncated (HF gpt-oss's truncate=false).
- Gemma 4 ("gemma4", convert_hf_to_gguf's Gemma4Model; llama.cpp's src/models/gemma4*.cpp): norms stored as they
  are (Gemma 4's RMSNorm scales by w), Q/K not permuted (NEOX RoPE). `_gemma4_config` rebuilds the HF text config:
  attention.sliding_window_pattern is a per-layer bool array (true: sliding); key_length / key_length_swa are the
  full and sliding head_dim; head_count_kv is per layer when the kinds differ; a full layer without attn_v uses K as
  V (attention_k_eq_v); attention.shared_kv_layers; feed_forward_length per layer, doubled on the shared layers
  (use_double_wide_mlp); embedding_length_per_layer_input (PLE, 0 for none); rope.freq_base / freq_base_swa. The
  full layers' proportional RoPE is the tensor rope_freqs: ggml frequency factors over the whole head, 1 on the
  rotated pairs and 1e30 (a zero frequency) on the rest, so partial_rotary_factor = 2 * (pairs at 1) / head_dim.
  The MoE block (ffn_gate_inp present) carries router.scale as ffn_gate_inp.scale, per_expert_scale as
  ffn_down_exps.scale and HF's [gate; up] experts as ffn_gate_up_exps; layer_scalar is layer_output_scale. Both
  scales are optional in llama.cpp (then 1) and come as ones here. llama.cpp's KV-shared layers read layer
  n - 2 (sliding) or n - 1 (full), n the first shared layer; HF's read the last non-shared layer of their own kind,
  so a file where those differ is refused.
"""
from __future__ import annotations

import collections
import concurrent.futures
import functools
import os
from typing import Iterator

import numpy as np

from jlight.core.config import ModelConfig
from jlight.core.errors import ModelLoadError, UnsupportedModelError
from jlight.loading.gguf_blocks import KEPT_TYPES, GGUFHostWeight, split_blocks
from jlight.loading.gguf_file import GGUFFile
from jlight.loading.mxfp4 import Mxfp4HostWeight, from_ggml_mxfp4

# GGUF `general.architecture` -> HF architecture name jlight runs it as.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
                      "smollm3": "SmolLM3ForCausalLM", "gpt-oss": "GptOssForCausalLM", "gemma4": "Gemma4ForCausalLM"}
# The types gguf-py's numpy dequantization reads (gguf.quants), K-quants included.
SUPPORTED_QUANT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                         "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# MXFP4 is read on expert tensors (gpt-oss's, the ones llama.cpp writes in it), kept as HF's MXFP4 layout.
EXPERT_QUANT_TYPES = ("MXFP4",)
_EXPERT_SUFFIXES = ("_exps.weight",)
_GEMMA = ("gemma2", "gemma3")
# The architectures whose Q/K rows llama.cpp's converter permutes (its LlamaModel and subclasses).
_PERMUTED = ("llama", "smollm3")
# HF model_type of a GGUF architecture, where the names differ.
_MODEL_TYPES = {"gemma3": "gemma3_text", "gpt-oss": "gpt_oss", "gemma4": "gemma4_text"}
# SmolLM3: llama.cpp's n_no_rope_layer_step, a constant of the architecture (no metadata key).
_SMOLLM3_NO_ROPE_INTERVAL = 4
# gpt-oss: llama.cpp's clamped SwiGLU constants (no metadata key), HF's defaults.
_GPT_OSS_SWIGLU = {"swiglu_limit": 7.0, "swiglu_alpha": 1.702}
# Gemma's 27B models scale scores by (hidden / heads)^-0.5 instead of head_dim^-0.5 (llama.cpp
# tells them by their layer count).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}

# llama.cpp per-layer tensor name -> HF per-layer suffix.
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma's four norms a layer under HF's names (HF's post_attention_layernorm follows the attention).
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# Phi-3's fused tensors under the HF names split_fused_tensors knows (ffn_up holds [gate; up]).
_PHI3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
}
# gpt-oss: HF's names, and for the experts the names `_gpt_oss_experts` takes ([experts, out, in] weights,
# or Mxfp4HostWeights) and turns into HF's gate_up_proj / down_proj.
_GPT_OSS_LAYER_NAMES = {
    **_LAYER_NAMES,
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_sinks.weight": "self_attn.sinks",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate_inp.weight": "mlp.router.weight",
    "ffn_gate_inp.bias": "mlp.router.bias",
    **{f"ffn_{part}_exps.{kind}": f"mlp.experts.{part}_proj{'_bias' if kind == 'bias' else ''}"
       for part in ("gate", "up", "down", "gate_up") for kind in ("weight", "bias")},
}
# Gemma 4: HF's names (hf_names_gemma4.py reads them); the experts keep HF's layout ([X, 2I, E] gate rows first,
# [X, E, I]), which the converter writes unchanged.
_GEMMA4_LAYER_NAMES = {
    **_GEMMA_LAYER_NAMES,
    "layer_output_scale.weight": "layer_scalar",
    "inp_gate.weight": "per_layer_input_gate.weight",
    "proj.weight": "per_layer_projection.weight",
    "post_norm.weight": "post_per_layer_input_norm.weight",
    "ffn_gate_inp.weight": "router.proj.weight",
    "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "ffn_gate_up_exps.weight": "experts.gate_up_proj",
    "ffn_down_exps.weight": "experts.down_proj",
    "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
    "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
    "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
}
_GEMMA4_GLOBAL_NAMES = {
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
}
_ARCH_LAYER_NAMES = {"gemma2": _GEMMA_LAYER_NAMES, "gemma3": _GEMMA_LAYER_NAMES, "phi3": _PHI3_LAYER_NAMES,
                     "gpt-oss": _GPT_OSS_LAYER_NAMES, "gemma4": _GEMMA4_LAYER_NAMES}
# llama.cpp's frequency factor of Gemma 4's unrotated pairs (the converter writes 1e30): any this large is a zero
# frequency in float32.
_GEMMA4_UNROTATED_FACTOR = 1e29
# The HF names of the linear weights kept as blocks (keep_blocks).
_BLOCK_WEIGHTS = tuple(f"{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj",
                                               "up_proj", "gate_up_proj", "down_proj", "lm_head"))
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def open_gguf(path: str) -> GGUFFile:
    """Open a GGUF file, turning a malformed one into a ModelLoadError that names it."""
    try:
        return GGUFFile(path)
    except FileNotFoundError:
        raise ModelLoadError(f"GGUF file {path} does not exist; check the path") from None
    except Exception as e:  # struct errors and ValueErrors on truncated or foreign files
        raise ModelLoadError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e}); re-download it") from None


def field_value(reader: GGUFFile, key: str, default=None):
    """A metadata value as a Python object (str, number or list), or `default` if absent."""
    return reader.fields.get(key, default)


def gguf_config(reader, path: str) -> ModelConfig:
    """Build a ModelConfig from the GGUF metadata (the `<arch>.*` keys)."""
    arch = field_value(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF file {path} has architecture {arch!r}; jlight runs GGUF architectures: {', '.join(GGUF_ARCHITECTURES)}"
        )
    tensors = {t.name: t for t in reader.tensors}
    if arch == "gemma4":
        return _gemma4_config(reader, path, tensors)
    if "rope_freqs.weight" in tensors:
        # Llama 3.1+ GGUFs store per-frequency RoPE factors as a tensor, not as rope_scaling metadata.
        raise UnsupportedModelError(f"GGUF file {path} uses per-frequency RoPE factors (rope_freqs); load the HF safetensors checkpoint instead")

    def meta(key, default=None):
        return field_value(reader, f"{arch}.{key}", default)

    num_heads = int(meta("attention.head_count"))
    hidden = int(meta("embedding_length"))
    num_layers = int(meta("block_count"))
    head_dim = int(meta("attention.key_length", hidden // num_heads))
    eos = field_value(reader, "tokenizer.ggml.eos_token_id")
    eot = field_value(reader, "tokenizer.ggml.eot_token_id")
    eos_ids = tuple(dict.fromkeys(int(t) for t in (eos, eot) if t is not None))
    hf = dict(
        architectures=[GGUF_ARCHITECTURES[arch]],
        model_type=_MODEL_TYPES.get(arch, arch),
        vocab_size=int(meta("vocab_size") or len(field_value(reader, "tokenizer.ggml.tokens", []))),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=int(meta("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        max_position_embeddings=int(meta("context_length", 4096)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(reader, arch, path, tensors),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias=arch in ("qwen2", "gpt-oss"),
        bos_token_id=field_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=list(eos_ids),
    )
    rope_dims = meta("rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:  # partial rotary (Phi-4-mini)
        if arch in _PERMUTED:
            # llama.cpp rotates adjacent pairs of the first rope dims of the permuted rows; un-permuting the
            # whole head does not give HF's rotate-half of its first rope dims.
            raise UnsupportedModelError(f"GGUF file {path} ({arch}) rotates {rope_dims} of {head_dim} head dimensions; "
                                        "jlight reads partial RoPE from unpermuted GGUFs only: load the HF checkpoint instead")
        hf["partial_rotary_factor"] = int(rope_dims) / head_dim
    if arch in _GEMMA:
        window = meta("attention.sliding_window")
        hf.update(
            hidden_activation="gelu_pytorch_tanh",
            sliding_window=int(window) if window is not None else None,
            query_pre_attn_scalar=hidden // num_heads if num_layers == _GEMMA_27B_LAYERS[arch] else hf["head_dim"],
            attn_logit_softcapping=meta("attn_logit_softcapping"),
            final_logit_softcapping=meta("final_logit_softcapping"),
        )
        if arch == "gemma3":
            hf.update(rope_local_base_freq=10000.0, sliding_window_pattern=int(meta("attention.sliding_window_pattern", 6)))
    elif arch == "phi3":
        window = int(meta("attention.sliding_window", 0))  # the converter writes 0 for none
        hf.update(sliding_window=window or None)
        if meta("rope.scaling.original_context_length") is not None:  # HF Phi-3 keeps it at the top level too
            hf["original_max_position_embeddings"] = int(meta("rope.scaling.original_context_length"))
    elif arch == "gpt-oss":
        hf.update(
            num_local_experts=int(_required(meta, "expert_count", path)),
            num_experts_per_tok=int(_required(meta, "expert_used_count", path)),
            intermediate_size=int(meta("expert_feed_forward_length", hf["intermediate_size"])),
            sliding_window=int(_required(meta, "attention.sliding_window", path)),
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)],
            **_GPT_OSS_SWIGLU,
        )
    else:
        hf.update(sliding_window=None, use_sliding_window=False)
        if arch == "smollm3":
            hf.update(no_rope_layers=[int((i + 1) % _SMOLLM3_NO_ROPE_INTERVAL != 0) for i in range(num_layers)])
    return ModelConfig.from_hf_dict(hf)


def _gemma4_config(reader, path: str, tensors: dict) -> ModelConfig:
    """Gemma 4's HF text config from the metadata and the tensor table (module docstring); UnsupportedModelError
    names what a file holds that HF's Gemma 4 (and so jlight) cannot express."""
    def meta(key, default=None):
        return field_value(reader, f"gemma4.{key}", default)

    def refuse(what: str):
        return UnsupportedModelError(f"GGUF file {path} (gemma4): {what}; load the HF checkpoint instead")

    n = int(_required(meta, "block_count", path))
    hidden = int(_required(meta, "embedding_length", path))

    def per_layer(key, default=None) -> list[int]:
        value = meta(key, default) if default is not None else _required(meta, key, path)
        values = [int(v) for v in value] if isinstance(value, list) else [int(value)] * n
        if len(values) != n:
            raise ModelLoadError(f"GGUF file {path}: gemma4.{key} lists {len(values)} values for {n} layers; the "
                                 "file is malformed: convert the model again with llama.cpp's convert_hf_to_gguf.py")
        return values

    pattern = _required(meta, "attention.sliding_window_pattern", path)
    if not isinstance(pattern, list) or len(pattern) != n:
        raise refuse(f"attention.sliding_window_pattern is {pattern!r}, not one flag per layer as the converter writes")
    types = ["sliding_attention" if swa else "full_attention" for swa in pattern]
    heads = per_layer("attention.head_count")
    kv = per_layer("attention.head_count_kv", heads)
    ff = per_layer("feed_forward_length")
    if len(set(heads)) != 1:
        raise refuse(f"attention.head_count differs between layers ({sorted(set(heads))})")
    head_dim = {"full_attention": int(_required(meta, "attention.key_length", path)),
                "sliding_attention": int(_required(meta, "attention.key_length_swa", path))}
    for key, kind in (("value_length", "full_attention"), ("value_length_swa", "sliding_attention")):
        if int(meta(f"attention.{key}", head_dim[kind])) != head_dim[kind]:
            raise refuse(f"attention.{key} differs from the key length {head_dim[kind]}")
    kv_heads = {}
    for i, t in enumerate(types):
        if kv_heads.setdefault(t, kv[i]) != kv[i]:
            raise refuse(f"{t} layers have more than one KV head count ({kv_heads[t]} and layer {i}'s {kv[i]})")
    shared = int(meta("attention.shared_kv_layers", 0))
    first_shared = n - shared
    if shared:
        for i in range(first_shared, n):  # llama.cpp's producer against HF's (the last of its own kind)
            llama_cpp = first_shared - (2 if types[i] == "sliding_attention" else 1)
            hf = max((j for j in range(first_shared) if types[j] == types[i]), default=None)
            if llama_cpp != hf:
                raise refuse(f"layer {i} ({types[i]}) reads the K/V of layer {llama_cpp} in llama.cpp and of layer "
                             f"{hf} in HF's Gemma 4 (shared_kv_layers={shared} over this layer pattern)")
    if ff == [ff[0]] * n:
        double_wide = False
    elif shared and ff == [ff[0] if i < first_shared else 2 * ff[0] for i in range(n)]:
        double_wide = True
    else:
        raise refuse(f"feed_forward_length {ff} is neither one width nor twice the width on the KV-shared layers")
    for kind, has_v in (("sliding_attention", True), ("full_attention", None)):
        got = {f"blk.{i}.attn_v.weight" in tensors for i in range(first_shared) if types[i] == kind}
        if len(got) > 1 or (has_v is not None and got and got != {has_v}):
            raise refuse(f"attn_v is missing from some {kind} layers" + ("" if has_v else " but not others"))
    k_eq_v = {f"blk.{i}.attn_v.weight" in tensors for i in range(first_shared) if types[i] == "full_attention"} == {False}

    rope_dims = {"full_attention": int(meta("rope.dimension_count", head_dim["full_attention"])),
                 "sliding_attention": int(meta("rope.dimension_count_swa", head_dim["sliding_attention"]))}
    if rope_dims != head_dim:
        raise refuse(f"rope.dimension_count(_swa) {rope_dims} differ from the head_dims {head_dim}; the converter "
                     "rotates whole heads and marks the full layers' unrotated pairs in rope_freqs")
    if meta("rope.scaling.type") not in (None, "none"):
        raise refuse(f"rope.scaling.type is {meta('rope.scaling.type')!r}; the converter writes none for Gemma 4")
    if "rope_freqs.weight" not in tensors:
        raise ModelLoadError(f"GGUF file {path} (gemma4) has no rope_freqs tensor, which llama.cpp requires for the "
                             "full layers' proportional RoPE; convert the model again with convert_hf_to_gguf.py")
    from gguf.quants import dequantize

    t = tensors["rope_freqs.weight"]
    factors = dequantize(t.data, t.tensor_type).reshape(-1)
    rotated = int(np.argmax(factors != 1.0)) if (factors != 1.0).any() else len(factors)
    if len(factors) != head_dim["full_attention"] // 2 or not (factors[rotated:] >= _GEMMA4_UNROTATED_FACTOR).all():
        raise refuse(f"rope_freqs ({len(factors)} factors) is not 1 on the first pairs and 1e30 on the rest of the "
                     f"full layers' {head_dim['full_attention'] // 2} pairs (HF's proportional RoPE)")
    freq_base = float(meta("rope.freq_base", 10000.0))

    moe = {f"blk.{i}.ffn_gate_inp.weight" in tensors for i in range(n)}
    if len(moe) > 1:
        raise refuse("some layers have the MoE block (ffn_gate_inp) and others not")
    separate = sorted(name for name in tensors if name.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight")))
    if separate:
        raise refuse(f"the experts' gate and up are separate tensors ({separate[0]}, ...); jlight reads Gemma 4's "
                     "fused ffn_gate_up_exps, as the converter writes them")
    ple = int(_required(meta, "embedding_length_per_layer_input", path))
    eos = field_value(reader, "tokenizer.ggml.eos_token_id")
    eot = field_value(reader, "tokenizer.ggml.eot_token_id")
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    hf = dict(
        architectures=["Gemma4ForCausalLM"], model_type="gemma4_text", hidden_activation="gelu_pytorch_tanh",
        vocab_size=int(tensors["token_embd.weight"].shape[1]), hidden_size=hidden, intermediate_size=ff[0],
        num_hidden_layers=n, num_attention_heads=heads[0], layer_types=types,
        num_key_value_heads=kv_heads.get("sliding_attention", kv[0]), head_dim=head_dim["sliding_attention"],
        per_layer_config={str(i): {"head_dim": head_dim["full_attention"], "num_key_value_heads": kv[i]} for i in full},
        attention_k_eq_v=k_eq_v, num_kv_shared_layers=shared, use_double_wide_mlp=double_wide,
        sliding_window=int(_required(meta, "attention.sliding_window", path)),
        rope_parameters={"sliding_attention": {"rope_type": "default",
                                               "rope_theta": float(meta("rope.freq_base_swa", freq_base))},
                         "full_attention": {"rope_type": "proportional", "rope_theta": freq_base,
                                            "partial_rotary_factor": 2 * rotated / head_dim["full_attention"]}},
        hidden_size_per_layer_input=ple,
        vocab_size_per_layer_input=int(tensors["per_layer_token_embd.weight"].shape[1]) if ple else None,
        enable_moe_block=moe == {True},
        final_logit_softcapping=meta("final_logit_softcapping"),
        max_position_embeddings=int(meta("context_length", 4096)),
        rms_norm_eps=float(_required(meta, "attention.layer_norm_rms_epsilon", path)),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=field_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=list(dict.fromkeys(int(t) for t in (eos, eot) if t is not None)),
    )
    if moe == {True}:
        hf.update(num_experts=int(_required(meta, "expert_count", path)),
                  top_k_experts=int(_required(meta, "expert_used_count", path)),
                  moe_intermediate_size=int(_required(meta, "expert_feed_forward_length", path)))
    return ModelConfig.from_hf_dict(hf)


def _required(meta, key: str, path: str):
    value = meta(key)
    if value is None:
        raise ModelLoadError(f"GGUF file {path} has no {key} metadata, which its architecture needs; the file is "
                             "incomplete: convert the model again with llama.cpp's convert_hf_to_gguf.py")
    return value


def _rope_scaling(reader, arch: str, path: str, tensors: dict) -> dict | None:
    """HF's rope_scaling of the metadata: linear, YaRN, or (the tensors rope_factors_long / _short) LongRoPE."""
    def meta(key, default=None):
        return field_value(reader, f"{arch}.{key}", default)

    scaling_type = meta("rope.scaling.type")
    factors = [n for n in ("rope_factors_long.weight", "rope_factors_short.weight") if n in tensors]
    if factors or scaling_type == "longrope":
        if len(factors) != 2:
            raise UnsupportedModelError(f"GGUF file {path} uses LongRoPE without both rope_factors_long and "
                                        "rope_factors_short tensors; convert the model again with llama.cpp's converter")
        from gguf.quants import dequantize

        long_f, short_f = ([float(x) for x in dequantize(tensors[n].data, tensors[n].tensor_type).reshape(-1)]
                           for n in factors)
        scaling = {"rope_type": "longrope", "long_factor": long_f, "short_factor": short_f}
        if meta("rope.scaling.original_context_length") is not None:
            scaling["original_max_position_embeddings"] = int(meta("rope.scaling.original_context_length"))
        if meta("rope.scaling.attn_factor") is not None:
            scaling["attention_factor"] = float(meta("rope.scaling.attn_factor"))
        return scaling
    if scaling_type in (None, "none"):
        return None
    if scaling_type == "linear":
        return {"rope_type": "linear", "factor": float(meta("rope.scaling.factor"))}
    if scaling_type == "yarn":
        ext = meta("rope.scaling.yarn_ext_factor")
        if ext is not None and float(ext) != 1.0:
            raise UnsupportedModelError(f"GGUF file {path} sets rope.scaling.yarn_ext_factor={ext}; jlight's YaRN "
                                        "(HF's) has no extrapolation mix factor: load the HF checkpoint instead")
        original = meta("rope.scaling.original_context_length")
        if original is None:
            raise ModelLoadError(f"GGUF file {path} uses YaRN without rope.scaling.original_context_length; "
                                 "convert the model again with llama.cpp's convert_hf_to_gguf.py")
        scaling = {"rope_type": "yarn", "factor": float(meta("rope.scaling.factor")),
                   "original_max_position_embeddings": int(original)}
        for key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                            ("yarn_attn_factor", "attention_factor")):
            if meta(f"rope.scaling.{key}") is not None:
                scaling[hf_key] = float(meta(f"rope.scaling.{key}"))
        if arch == "gpt-oss":
            scaling["truncate"] = False
        return scaling
    raise UnsupportedModelError(f"GGUF file {path} uses rope scaling {scaling_type!r}; jlight supports linear, "
                                "YaRN and LongRoPE scaling in GGUF files")


def check_quant_types(reader, path: str) -> None:
    """Fail before loading anything if a tensor uses a quantization jlight cannot dequantize."""
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind in SUPPORTED_QUANT_TYPES or (kind in EXPERT_QUANT_TYPES and t.name.endswith(_EXPERT_SUFFIXES)):
            continue
        where = " (jlight reads MXFP4 on expert tensors, *_exps.weight, only)" if kind in EXPERT_QUANT_TYPES else ""
        raise UnsupportedModelError(
            f"GGUF file {path}: tensor {t.name} uses quantization type {kind}{where}, which jlight does not "
            f"dequantize; supported: {', '.join(SUPPORTED_QUANT_TYPES)}. Use a GGUF file quantized with one of them"
        )


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """llama.cpp tensor name -> HF name, or None for tensors jlight does not use. Phi-3's attn_qkv / ffn_up
    map to HF's fused qkv_proj / gate_up_proj; gpt-oss's experts to the names `_gpt_oss_experts` takes."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if arch == "gemma4" and gguf_name in _GEMMA4_GLOBAL_NAMES:
        return _GEMMA4_GLOBAL_NAMES[gguf_name]
    layer_names = _ARCH_LAYER_NAMES.get(arch, _LAYER_NAMES)
    parts = gguf_name.split(".", 2)  # ["blk", N, suffix]
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer_names:
        return f"model.layers.{int(parts[1])}.{layer_names[parts[2]]}"
    return None


def unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Invert llama.cpp's Q/K row permutation (interleaved RoPE pairs -> HF rotate-half halves).

    w: [num_heads * head_dim, ...] (a weight [out, in] or a bias [out]).
    """
    rest = w.shape[1:]
    head_dim = w.shape[0] // num_heads
    # llama.cpp stored rows as (head, pair index, 2); HF wants (head, 2, pair index).
    return w.reshape(num_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(reader, config: ModelConfig, arch: str, keep_blocks: bool = False) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (HF name, float32 array in HF layout), one tensor at a time, in the file's order.

    keep_blocks: the linear weights stored as one of gguf_blocks.KEPT_TYPES (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K,
    Q6_K) come as GGUFHostWeights (their blocks, [out, ...] rows: gguf_blocks.py) instead, and a model whose LM
    head is its token embedding gets the embedding's blocks as lm_head.weight too (the embedding itself is dequantized: a step reads one row).
    Phi-3's fused attn_qkv / ffn_up come cut into q/k/v and gate/up (blocks or floats); gpt-oss's experts come as
    HF's gate_up_proj / down_proj (+ _bias), MXFP4 ones as their _blocks / _scales (`_gpt_oss_experts`).
    The dequantization (numpy, which releases Python's lock) runs on one thread per core, at most that
    many tensors ahead of the one yielded, so the host holds a few dequantized tensors at a time."""
    # gguf loads only for GGUF checkpoints.
    from gguf.quants import dequantize

    if arch == "gemma4" and keep_blocks:
        raise UnsupportedModelError(f"GGUF file {reader.path} (gemma4): jlight's Gemma 4 layers take float weights only; "
                                    "load it without keep_gguf_blocks (its weights are then dequantized)")

    def convert(t, name) -> list[tuple[str, object]]:
        arr = None
        if t.tensor_type.name in EXPERT_QUANT_TYPES:  # MXFP4 experts [X, out, G * 17] -> HF's blocks and scales
            return [(name, from_ggml_mxfp4(t.data))]
        if keep_blocks and name.endswith(_BLOCK_WEIGHTS) and t.tensor_type.name in KEPT_TYPES:
            arr = split_blocks(t.tensor_type.name, t.data)
        if arr is None:
            # dequantize returns float32 [rows, cols] = HF's [out, in] (or [n] for vectors).
            arr = dequantize(t.data, t.tensor_type)
            arr = arr.reshape(tuple(int(d) for d in reversed(t.shape)))
        heads = (config.num_heads if name.endswith(("q_proj.weight", "q_proj.bias"))
                 else config.num_kv_heads if name.endswith(("k_proj.weight", "k_proj.bias")) else None)
        if arch in _PERMUTED and heads is not None:
            permute = functools.partial(unpermute_rows, num_heads=heads)
            arr = arr.map_rows(permute) if isinstance(arr, GGUFHostWeight) else permute(arr)
        elif arch in _GEMMA and name.endswith("norm.weight"):
            arr = arr - np.float32(1.0)  # the converter stored 1 + w
        if arch == "phi3":
            return _split_phi3(name, arr, config)
        return [(name, arr)]

    wanted = [(t, name) for t in reader.tensors if (name := hf_tensor_name(t.name, arch)) is not None]
    if keep_blocks and not any(name == "lm_head.weight" for _, name in wanted):
        wanted += [(t, "lm_head.weight") for t, name in wanted if name == "model.embed_tokens.weight"
                   and t.tensor_type.name in KEPT_TYPES]

    def converted():
        workers = os.cpu_count() or 1
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="jlight-gguf") as pool:
            ahead = collections.deque(pool.submit(convert, t, name) for t, name in wanted[:workers])
            for t, name in wanted[workers:]:
                yield from ahead.popleft().result()
                ahead.append(pool.submit(convert, t, name))
            while ahead:
                yield from ahead.popleft().result()

    if arch == "gpt-oss":
        return _gpt_oss_experts(converted(), reader.path)
    if arch == "gemma4":
        return _gemma4_unit_scales(converted(), reader, config)
    return converted()


def _gemma4_unit_scales(tensors, reader, config: ModelConfig):
    """The tensors, then ones for the scales llama.cpp reads as optional (1 when absent): layer_scalar
    (layer_output_scale) of each layer and, on MoE layers, router.per_expert_scale (ffn_down_exps.scale)."""
    yield from tensors
    names = {t.name for t in reader.tensors}
    for i in range(config.num_layers):
        if f"blk.{i}.layer_output_scale.weight" not in names:
            yield f"model.layers.{i}.layer_scalar", np.ones(1, np.float32)
        if f"blk.{i}.ffn_gate_inp.weight" in names and f"blk.{i}.ffn_down_exps.scale" not in names:
            yield f"model.layers.{i}.router.per_expert_scale", np.ones(config.extra["num_experts"], np.float32)


def _rows(arr, start: int, stop: int):
    """Rows start:stop (output channels) of a float [out, in] array or a GGUFHostWeight."""
    return arr.map_rows(lambda f: f[start:stop]) if isinstance(arr, GGUFHostWeight) else arr[start:stop]


def _split_phi3(name: str, arr, config: ModelConfig) -> list[tuple[str, object]]:
    """Phi-3's attn_qkv ([q; k; v] rows) and ffn_up ([gate; up] rows, or up alone beside an ffn_gate) under
    Llama's names; other tensors as they are."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    rows = arr.shape[1] if isinstance(arr, GGUFHostWeight) else arr.shape[0]  # GGUFHostWeight.shape is [in, out]
    if name.endswith("qkv_proj.weight"):
        layer, kind = name[: -len("qkv_proj.weight")], "attn_qkv"
        parts = (("q_proj", q), ("k_proj", kv), ("v_proj", kv))
    elif name.endswith("gate_up_proj.weight"):
        layer, kind = name[: -len("gate_up_proj.weight")], "ffn_up"
        if rows == config.intermediate_size:  # ffn_up without its gate: an ffn_gate tensor sits beside it
            return [(layer + "up_proj.weight", arr)]
        parts = (("gate_proj", config.intermediate_size), ("up_proj", config.intermediate_size))
    else:
        return [(name, arr)]
    if rows != sum(n for _, n in parts):
        raise ModelLoadError(f"GGUF tensor {kind} of {layer.rstrip('.')} has {rows} rows, but the metadata implies "
                             f"{' + '.join(str(n) for _, n in parts)}; the file's metadata does not match its weights")
    out, start = [], 0
    for part, n in parts:
        out.append((f"{layer}{part}.weight", _rows(arr, start, start + n)))
        start += n
    return out


def _gpt_oss_experts(tensors, path: str):
    """gpt-oss's expert tensors as HF's: gate and up ([X, F, in] each, or one [X, 2F, in] of [gate; up] rows)
    interleaved into gate_up_proj [X, in, 2F] (gate at the even columns) and gate_up_proj_bias [X, 2F];
    down_proj [X, F, out] ([in, out], transposed from the file's [out, in]). MXFP4 weights (Mxfp4HostWeights,
    [X, out, G, 16]) come as HF's NAME_blocks / NAME_scales, gate and up rows interleaved the same way."""
    pending: dict[str, dict] = {}
    for name, arr in tensors:
        prefix, sep, part = name.rpartition(".mlp.experts.")
        if not sep:
            yield name, arr
            continue
        prefix += sep
        if part == "down_proj":
            if isinstance(arr, Mxfp4HostWeight):
                yield prefix + "down_proj_blocks", arr.blocks
                yield prefix + "down_proj_scales", arr.scales
            else:
                yield prefix + "down_proj", np.swapaxes(arr, -1, -2)
            continue
        if part == "down_proj_bias":
            yield name, arr
            continue
        got = pending.setdefault(prefix, {})
        if part.startswith("gate_up_proj"):  # [gate; up] rows (ffn_gate_up_exps), the bias [X, 2F]
            tail = part[len("gate_up_proj"):]
            if isinstance(arr, Mxfp4HostWeight):  # its "columns" are the file's rows (out)
                half = arr.shape[-1] // 2
                halves = arr.columns(slice(0, half)), arr.columns(slice(half, None))
            else:
                halves = np.split(arr, 2, axis=1)
            got["gate_proj" + tail], got["up_proj" + tail] = halves
        else:
            got[part] = arr
        if len(got) == 4:
            yield from _interleave_gate_up(prefix, got)
            del pending[prefix]
    for prefix, got in pending.items():
        missing = sorted({"gate_proj", "up_proj", "gate_proj_bias", "up_proj_bias"} - set(got))
        raise ModelLoadError(f"GGUF file {path}: {prefix.rstrip('.')} lacks the expert tensors' "
                             f"{', '.join(missing)} (ffn_gate_exps / ffn_up_exps and their .bias); the file is incomplete")


def _interleave_gate_up(prefix: str, got: dict):
    gate, up = got["gate_proj"], got["up_proj"]
    if isinstance(gate, Mxfp4HostWeight) and isinstance(up, Mxfp4HostWeight):
        for field in ("blocks", "scales"):
            g, u = getattr(gate, field), getattr(up, field)  # [X, F, G, 16] / [X, F, G]
            both = np.stack([g, u], axis=2)  # [X, F, 2, ...]: row 2 f gate f, row 2 f + 1 up f
            yield f"{prefix}gate_up_proj_{field}", both.reshape(g.shape[0], 2 * g.shape[1], *g.shape[2:])
    else:  # [X, F, in] floats (an MXFP4 half expanded)
        g, u = (np.swapaxes(w.dequantize(), -1, -2) if isinstance(w, Mxfp4HostWeight) else w for w in (gate, up))
        both = np.stack([g, u], axis=2).reshape(g.shape[0], 2 * g.shape[1], g.shape[2])
        yield prefix + "gate_up_proj", np.swapaxes(both, -1, -2)
    bias = np.stack([got["gate_proj_bias"], got["up_proj_bias"]], axis=-1)  # [X, F, 2]
    yield prefix + "gate_up_proj_bias", bias.reshape(bias.shape[0], -1)


def load_gguf_model(path: str):
    """Return (reader, config, architecture string) after validating the file's quant types."""
    if not os.path.isfile(path):
        raise ModelLoadError(f"GGUF file {path} does not exist; check the path")
    reader = open_gguf(path)
    config = gguf_config(reader, path)
    check_quant_types(reader, path)
    return reader, config, field_value(reader, "general.architecture")
