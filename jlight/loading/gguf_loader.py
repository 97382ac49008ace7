"""Reads llama.cpp GGUF files: the model config from the metadata and the weights, dequantized.

Tensors are yielded one at a time under their HF names, so `assemble_params` and
`hf_names.py` serve GGUF and safetensors alike. The llama.cpp conventions undone here:
- GGUF dims are listed fastest-first; the reader's numpy arrays already come out in HF's
  [out, in] row-major order, so no transpose is needed beyond the HF one.
- llama.cpp's converter permutes the rows of Q and K of "llama" models so that RoPE pairs
  adjacent elements (GPT-J style); jlight's RoPE is HF's rotate-half, so the permutation is
  inverted. Qwen2/Qwen3 and Gemma GGUFs are not permuted by the converter and are left as they are.
- Gemma 2/3: the converter stores every RMSNorm weight plus one (llama.cpp's norm multiplies by
  the weight; Gemma's by 1 + weight), so one is taken off again. The metadata carries no
  query_pre_attn_scalar, local RoPE base or layer pattern: llama.cpp derives them from the
  architecture, and so does `gguf_config` (scale head_dim, or hidden / heads for the 27B models;
  local layers' RoPE base 10,000; Gemma 3 five local layers to one global, Gemma 2 alternating).
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

# GGUF `general.architecture` -> HF architecture name jlight runs it as.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
# The types gguf-py's numpy dequantization reads (gguf.quants), K-quants included.
SUPPORTED_QUANT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                         "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
_GEMMA = ("gemma2", "gemma3")
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
# The HF names of the linear weights kept as blocks (keep_blocks).
_BLOCK_WEIGHTS = tuple(f"{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj", "lm_head"))
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
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        # Llama 3.1+ GGUFs store per-frequency RoPE factors as a tensor, not as rope_scaling metadata.
        raise UnsupportedModelError(f"GGUF file {path} uses per-frequency RoPE factors (rope_freqs); load the HF safetensors checkpoint instead")

    def meta(key, default=None):
        return field_value(reader, f"{arch}.{key}", default)

    num_heads = int(meta("attention.head_count"))
    hidden = int(meta("embedding_length"))
    num_layers = int(meta("block_count"))
    scaling_type = meta("rope.scaling.type")
    rope_scaling = None
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(meta("rope.scaling.factor"))}
    elif scaling_type not in (None, "none"):
        raise UnsupportedModelError(f"GGUF file {path} uses rope scaling {scaling_type!r}; jlight supports linear scaling in GGUF files")
    eos = field_value(reader, "tokenizer.ggml.eos_token_id")
    eot = field_value(reader, "tokenizer.ggml.eot_token_id")
    eos_ids = tuple(dict.fromkeys(int(t) for t in (eos, eot) if t is not None))
    hf = dict(
        architectures=[GGUF_ARCHITECTURES[arch]],
        model_type={"gemma3": "gemma3_text"}.get(arch, arch),
        vocab_size=int(meta("vocab_size") or len(field_value(reader, "tokenizer.ggml.tokens", []))),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=int(meta("attention.head_count_kv", num_heads)),
        head_dim=int(meta("attention.key_length", hidden // num_heads)),
        max_position_embeddings=int(meta("context_length", 4096)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in names,
        attention_bias=arch == "qwen2",
        bos_token_id=field_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=list(eos_ids),
    )
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
    else:
        hf.update(sliding_window=None, use_sliding_window=False)
    return ModelConfig.from_hf_dict(hf)


def check_quant_types(reader, path: str) -> None:
    """Fail before loading anything if a tensor uses a quantization jlight cannot dequantize."""
    for t in reader.tensors:
        if t.tensor_type.name not in SUPPORTED_QUANT_TYPES:
            raise UnsupportedModelError(
                f"GGUF file {path}: tensor {t.name} uses quantization type {t.tensor_type.name}, which jlight does not "
                f"dequantize; supported: {', '.join(SUPPORTED_QUANT_TYPES)}. Use a GGUF file quantized with one of them"
            )


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """llama.cpp tensor name -> HF name, or None for tensors jlight does not use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    layer_names = _GEMMA_LAYER_NAMES if arch in _GEMMA else _LAYER_NAMES
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
    The dequantization (numpy, which releases Python's lock) runs on one thread per core, at most that
    many tensors ahead of the one yielded, so the host holds a few dequantized tensors at a time."""
    # gguf loads only for GGUF checkpoints.
    from gguf.quants import dequantize

    def convert(t, name):
        arr = None
        if keep_blocks and name.endswith(_BLOCK_WEIGHTS) and t.tensor_type.name in KEPT_TYPES:
            arr = split_blocks(t.tensor_type.name, t.data)
        if arr is None:
            # dequantize returns float32 [rows, cols] = HF's [out, in] (or [n] for vectors).
            arr = dequantize(t.data, t.tensor_type)
            arr = arr.reshape(tuple(int(d) for d in reversed(t.shape)))
        heads = (config.num_heads if name.endswith(("q_proj.weight", "q_proj.bias"))
                 else config.num_kv_heads if name.endswith(("k_proj.weight", "k_proj.bias")) else None)
        if arch == "llama" and heads is not None:
            permute = functools.partial(unpermute_rows, num_heads=heads)
            arr = arr.map_rows(permute) if isinstance(arr, GGUFHostWeight) else permute(arr)
        elif arch in _GEMMA and name.endswith("norm.weight"):
            arr = arr - np.float32(1.0)  # the converter stored 1 + w
        return name, arr

    wanted = [(t, name) for t in reader.tensors if (name := hf_tensor_name(t.name, arch)) is not None]
    if keep_blocks and not any(name == "lm_head.weight" for _, name in wanted):
        wanted += [(t, "lm_head.weight") for t, name in wanted if name == "model.embed_tokens.weight"
                   and t.tensor_type.name in KEPT_TYPES]
    workers = os.cpu_count() or 1
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="jlight-gguf") as pool:
        ahead = collections.deque(pool.submit(convert, t, name) for t, name in wanted[:workers])
        for t, name in wanted[workers:]:
            yield ahead.popleft().result()
            ahead.append(pool.submit(convert, t, name))
        while ahead:
            yield ahead.popleft().result()


def load_gguf_model(path: str):
    """Return (reader, config, architecture string) after validating the file's quant types."""
    if not os.path.isfile(path):
        raise ModelLoadError(f"GGUF file {path} does not exist; check the path")
    reader = open_gguf(path)
    config = gguf_config(reader, path)
    check_quant_types(reader, path)
    return reader, config, field_value(reader, "general.architecture")
