"""GGUF files of the phi3, smollm3, gpt-oss and gemma4 architectures, written from tiny HF models the way llama.cpp's
convert_hf_to_gguf.py writes them (Phi3MiniModel, SmolLM3Model, GptOssModel, Gemma4Model; gguf-py's own tensor-name map),
load into the model of the HF directory: float32 logits within 1e-4 of transformers' and 32 greedy tokens
identical, with the same attention kinds and RoPE tables.

What the writer does as the converter does: Phi-3's fused qkv_proj -> attn_qkv and gate_up_proj -> ffn_up, no
head_dim key, rope.dimension_count for the partial rotary, LongRoPE as rope_factors_long / rope_factors_short
tensors with rope.scaling.original_context_length and rope.scaling.attn_factor, sliding_window 0 for none;
SmolLM3's Q/K rows permuted (LlamaModel.permute) and no key for its no-RoPE layers; gpt-oss's sinks, biases,
post_attention_norm, router, experts split from HF's interleaved gate_up_proj (even rows gate, odd up; or fused
as ffn_gate_up_exps, [gate; up]) and transposed to [experts, out, in], MXFP4 experts repacked into ggml's blocks
(the converter's transform_nibble_layout: the scale byte, then elements j and j + 16 in byte j). The vocabulary
is the tiny model's byte-level BPE written GPT-2 style (the Phi-3 converter's SentencePiece path needs a
tokenizer.model the tiny models have none of).

Gemma 4 (`write_gemma4_gguf`, Gemma4Model over Gemma3Model and TextModel): norms unshifted, per-layer bool
sliding_window_pattern, key_length(_swa) the full / sliding head_dim, head_count_kv per layer, feed_forward_length
per layer with double-wide MLPs, shared_kv_layers, embedding_length_per_layer_input, rope.dimension_count(_swa) the
whole heads and rope_freqs ([1] * rotated pairs + [1e30] * the rest), router.scale -> ffn_gate_inp.scale,
per_expert_scale -> ffn_down_exps.scale, layer_scalar -> layer_output_scale, experts as HF stores them. Two
departures, both for the tiny model: its byte-level BPE is written GPT-2 style (the converter writes the "gemma4"
tokenizer, which jlight's GGUF tokenizer does not read), and token_embd keeps all vocab_size rows (the converter
cuts it to the tokenizer's size, a no-op for Gemma 4's own 262,144-token tokenizer but not for the tiny one's).
"""
import json
import os
import re

import numpy as np
import pytest

from families_common import PROMPTS, check_direct, hf_model
from jlight.loading import load_model
from jlight.models import attention_kinds
from test_loading import add_text_model_header, add_tiny_vocab, hf_state_dict

# Phi-3: a 50-token prompt whose continuation crosses original_max_position_embeddings = 64 (short -> long
# LongRoPE factors) and a 70-token one (long factors from the start).
PHI3_PROMPTS = [[int(t) for t in np.random.default_rng(n).integers(3, 500, n)] for n in (50, 70)] + PROMPTS
# gpt-oss's tiny model with llama.cpp's SwiGLU limit (its graph's constant 7.0: no GGUF key carries another).
GPT_OSS = dict(swiglu_limit=7.0)


def _llama_permute(w, n_head):
    """convert_hf_to_gguf.py's LlamaModel.permute (SmolLM3Model inherits it)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _transform_nibble_layout(blocks):
    """convert_hf_to_gguf.py's GptOssModel.transform_nibble_layout, in numpy: HF's MXFP4 bytes (elements 2j low,
    2j + 1 high) -> ggml's (elements j low, j + 16 high)."""
    t = (blocks & 0x0F) << 4 | (blocks & 0xF0) >> 4
    a, b = t[..., :8], t[..., 8:]
    a = np.stack([a & 0xF0, (a << 4) & 0xF0], axis=-1).reshape(t.shape)
    b = np.stack([b >> 4, b & 0x0F], axis=-1).reshape(t.shape)
    out = a | b
    return ((out & 0xF0) >> 4 | (out & 0x0F) << 4).astype(np.uint8)


def _mxfp4_repack(*parts):
    """GptOssModel.repack_mxfp4_parts: (blocks [X, out, G, 16], scales [X, out, G]) parts -> [X, out, G * 17]."""
    packed = [np.concatenate([s[..., None], _transform_nibble_layout(b)], axis=-1) for b, s in parts]
    data = np.concatenate(packed, axis=1)
    return data.reshape(*data.shape[:2], -1)


def write_family_gguf(path, hf_dir, arch, fuse_gate_up_exps=False, linear_qtype="F32", leave_out=()):
    """hf_dir's model as convert_hf_to_gguf.py writes it for `arch` ("phi3", "smollm3" or "gpt-oss"), its
    non-expert matrices in linear_qtype (F32: --outtype f32), without the tensors named in leave_out."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    rope = cfg.get("rope_parameters") or {}
    n_layers, n_head, n_kv, hidden = (cfg[k] for k in ("num_hidden_layers", "num_attention_heads",
                                                       "num_key_value_heads", "hidden_size"))
    w = gguf.GGUFWriter(str(path), arch)
    model_arch = gguf.MODEL_ARCH[{"gpt-oss": "GPT_OSS"}.get(arch, arch.upper())]
    names = gguf.get_tensor_name_map(model_arch, n_layers)
    qtype = gguf.GGMLQuantizationType[linear_qtype]
    # llama.cpp's tensors of the architecture (gguf-py's MODEL_TENSORS; ffn_gate_up_exps is newer than it for gpt-oss)
    known = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[model_arch]} | {"blk.{bid}.ffn_gate_up_exps"}

    def add_tensor(name, arr, raw_dtype=None):
        assert re.sub(r"^blk\.\d+\.", "blk.{bid}.", name.rsplit(".", 1)[0]) in known, name
        if name not in leave_out:
            w.add_tensor(name, np.ascontiguousarray(arr), raw_dtype=raw_dtype)

    def add(hf_name, arr):
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if arr.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            add_tensor(name, gguf.quants.quantize(np.asarray(arr, np.float32), qtype), raw_dtype=qtype)
        else:
            add_tensor(name, np.asarray(arr, np.float32))

    add_text_model_header(w, cfg)
    w.add_rope_freq_base(rope.get("rope_theta") or cfg["rope_theta"])
    if arch == "phi3":  # Phi3MiniModel.set_gguf_parameters and generate_extra_tensors
        rope_dims = int(rope.get("partial_rotary_factor", 1.0) * hidden) // n_head
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_dimension_count(rope_dims)
        w.add_sliding_window(cfg.get("sliding_window") or 0)
        scale = cfg["max_position_embeddings"] / rope["original_max_position_embeddings"]
        w.add_rope_scaling_attn_factors(np.sqrt(1 + np.log(scale) / np.log(rope["original_max_position_embeddings"])))
        add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
        add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))
    elif arch == "smollm3":  # LlamaModel.set_gguf_parameters
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(cfg.get("head_dim") or hidden // n_head)
    else:  # TextModel.set_gguf_parameters (YaRN, experts, head_dim) and GptOssModel's additions
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        w.add_expert_count(cfg["num_local_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
        w.add_sliding_window(cfg["sliding_window"])
        w.add_expert_feed_forward_length(cfg["intermediate_size"])
    add_tiny_vocab(w, hf_dir, cfg["vocab_size"])

    if arch == "gpt-oss" and cfg.get("quantization_config"):  # MXFP4 experts (the bf16/f32 rest read by transformers)
        tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
        sd = {k: v for k, v in tensors.items() if not k.endswith(("_blocks", "_scales"))}
        for layer in range(n_layers):
            prefix, blk = f"model.layers.{layer}.mlp.experts.", f"blk.{layer}."
            blocks, scales = tensors[prefix + "gate_up_proj_blocks"], tensors[prefix + "gate_up_proj_scales"]
            gate, up = (blocks[:, ::2], scales[:, ::2]), (blocks[:, 1::2], scales[:, 1::2])
            raw = gguf.GGMLQuantizationType.MXFP4
            if fuse_gate_up_exps:
                add_tensor(blk + "ffn_gate_up_exps.weight", _mxfp4_repack(gate, up), raw_dtype=raw)
            else:
                add_tensor(blk + "ffn_gate_exps.weight", _mxfp4_repack(gate), raw_dtype=raw)
                add_tensor(blk + "ffn_up_exps.weight", _mxfp4_repack(up), raw_dtype=raw)
            down = (tensors[prefix + "down_proj_blocks"], tensors[prefix + "down_proj_scales"])
            add_tensor(blk + "ffn_down_exps.weight", _mxfp4_repack(down), raw_dtype=raw)
    else:
        sd = hf_state_dict(hf_dir)
    for name, arr in sd.items():
        if arch == "smollm3" and name.endswith("q_proj.weight"):
            arr = _llama_permute(arr, n_head)
        elif arch == "smollm3" and name.endswith("k_proj.weight"):
            arr = _llama_permute(arr, n_kv)
        if name.endswith("self_attn.sinks"):
            name += ".weight"  # GptOssModel.filter_tensors
        if ".mlp.experts." not in name:
            add(name, arr)
            continue
        layer = name.split(".")[2]
        blk = f"blk.{layer}."
        if name.endswith("down_proj"):
            add_tensor(blk + "ffn_down_exps.weight", np.swapaxes(arr, -1, -2))
        elif name.endswith("down_proj_bias"):
            add_tensor(blk + "ffn_down_exps.bias", arr)
        else:  # gate_up_proj [X, in, 2F] (transposed first) or gate_up_proj_bias [X, 2F]: gate even, up odd
            is_bias = name.endswith("_bias")
            if not is_bias:
                arr = np.swapaxes(arr, -1, -2)  # [X, 2F, in]
            gate, up = arr[:, ::2], arr[:, 1::2]
            kind = "bias" if is_bias else "weight"
            if fuse_gate_up_exps:
                add_tensor(f"{blk}ffn_gate_up_exps.{kind}", np.concatenate([gate, up], axis=1))
            else:
                add_tensor(f"{blk}ffn_gate_exps.{kind}", gate)
                add_tensor(f"{blk}ffn_up_exps.{kind}", up)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def write_gemma4_gguf(path, hf_dir):
    """hf_dir's Gemma 4 text model as convert_hf_to_gguf.py's Gemma4Model writes it (F32 weights). Its hparams in
    the hub's form: global_head_dim / num_global_key_value_heads from the per_layer_config transformers saves."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    full_override = next(iter((cfg.get("per_layer_config") or {}).values()), {})
    global_head_dim = full_override.get("head_dim", cfg.get("global_head_dim"))
    global_kv = full_override.get("num_key_value_heads") if cfg.get("attention_k_eq_v") else None
    n_layers, hd = cfg["num_hidden_layers"], cfg["head_dim"]
    types, rope = cfg["layer_types"], cfg["rope_parameters"]
    w = gguf.GGUFWriter(str(path), "gemma4")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, n_layers)
    known = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.GEMMA4]}

    def add_tensor(name, arr):
        assert re.sub(r"^blk\.\d+\.", "blk.{bid}.", name.rsplit(".", 1)[0]) in known, name
        w.add_tensor(name, np.ascontiguousarray(arr, np.float32))

    # TextModel.set_gguf_parameters, then Gemma3Model's and Gemma4Model's (the last value of a key is the one kept)
    w.add_block_count(n_layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if cfg.get("num_experts") is not None:
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["top_k_experts"])
    if cfg.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    w.add_sliding_window(cfg["sliding_window"])
    n_shared = cfg["num_kv_shared_layers"]
    w.add_shared_kv_layers(n_shared)
    w.add_embedding_length_per_layer_input(cfg.get("hidden_size_per_layer_input") or 0)
    swa = [t == "sliding_attention" for t in types]
    w.add_sliding_window_pattern(swa)
    w.add_key_length(global_head_dim)
    w.add_value_length(global_head_dim)
    w.add_key_length_swa(hd)
    w.add_value_length_swa(hd)
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    n_ff = cfg["intermediate_size"]
    w.add_feed_forward_length([n_ff if i < n_layers - n_shared else 2 * n_ff for i in range(n_layers)]
                              if cfg.get("use_double_wide_mlp") else n_ff)
    w.add_head_count_kv([cfg["num_key_value_heads"] if s else global_kv for s in swa] if global_kv is not None
                        else cfg["num_key_value_heads"])
    w.add_rope_dimension_count(global_head_dim)
    w.add_rope_dimension_count_swa(int(hd * cfg.get("partial_rotary_factor", 1.0)))
    add_tiny_vocab(w, hf_dir, cfg["vocab_size"])

    rotated = int(global_head_dim * rope["full_attention"]["partial_rotary_factor"] / 2)  # generate_extra_tensors
    add_tensor("rope_freqs.weight", [1.0] * rotated + [1e30] * (global_head_dim // 2 - rotated))
    for name, arr in load_file(os.path.join(hf_dir, "model.safetensors")).items():
        if name.endswith("router.scale"):  # Gemma4Model.modify_tensors
            add_tensor(f"blk.{name.split('.')[2]}.ffn_gate_inp.scale", arr)
        elif name.endswith("per_expert_scale"):
            add_tensor(f"blk.{name.split('.')[2]}.ffn_down_exps.scale", arr)
        else:  # filter_tensors' ".weight" on layer_scalar and the experts, then gguf-py's map
            suffix = "" if name.endswith(".weight") else ".weight"
            add_tensor(names.get_name(name + suffix, try_suffixes=(".weight",)), arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


# Gemma 4 with every text feature (tiny_models.py), its layers ordered so that the KV-shared layers' producers are
# llama.cpp's (first shared layer n: sliding layers read n - 2, full ones n - 1) as well as HF's.
GEMMA4_LAYERS = ["sliding_attention"] * 3 + ["full_attention", "sliding_attention", "full_attention"]


# The dense core alone: no PLE, KV sharing, MoE or keys as values (one KV head count for both kinds, attn_v everywhere).
GEMMA4_DENSE = dict(hidden_size_per_layer_input=0, num_kv_shared_layers=0, use_double_wide_mlp=False,
                    enable_moe_block=False, attention_k_eq_v=False)


@pytest.mark.parametrize("variant", ["full", "dense"])
def test_gguf_gemma4_matches_transformers(tiny_model, tmp_path, variant):
    from jlight.models import gemma4

    path = tiny_model("Gemma4ForCausalLM", layer_types=GEMMA4_LAYERS, **(GEMMA4_DENSE if variant == "dense" else {}))
    got = load_model(write_gemma4_gguf(tmp_path / "gemma4.gguf", path), dtype="float32")
    ref = load_model(path, dtype="float32")
    assert gemma4.plan(got.config) == gemma4.plan(ref.config)
    assert gemma4.plan(got.config).producer[4:] == ((2, 3) if variant == "full" else (4, 5))
    moe = ("num_experts", "top_k_experts", "moe_intermediate_size") if variant == "full" else ()
    for key in ("attention_k_eq_v", "num_kv_shared_layers", "use_double_wide_mlp", "hidden_size_per_layer_input",
                "enable_moe_block") + moe:
        assert got.config.extra.get(key) == ref.config.extra.get(key), key
    for kind, table in gemma4.rope_tables(ref.config).items():
        np.testing.assert_allclose(gemma4.rope_tables(got.config)[kind].inv_freq, table.inv_freq, rtol=1e-6)
    check_direct(got.params, got.config, hf_model(path, "Gemma4ForCausalLM"), prompts=PROMPTS[:2])


def test_gguf_gemma4_refuses_kv_sharing_llama_cpp_reads_otherwise(tiny_model, tmp_path):
    """The tiny model's own order (.., full, sliding | shared sliding, shared full): llama.cpp's shared sliding layer
    reads layer 2 (full), HF's layer 3."""
    from jlight.core.errors import UnsupportedModelError

    gguf_path = write_gemma4_gguf(tmp_path / "gemma4.gguf", tiny_model("Gemma4ForCausalLM"))
    with pytest.raises(UnsupportedModelError, match=r"layer 4 \(sliding_attention\) reads the K/V of layer 2 in "
                                                    r"llama.cpp and of layer 3 in HF's Gemma 4"):
        load_model(gguf_path)


def _same_model_shape(got, ref):
    """The GGUF's config runs the model of the HF directory's: attention kinds, RoPE tables, sizes."""
    c, r = got.config, ref.config
    assert (c.architecture, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.attention_bias) == \
        (r.architecture, r.num_heads, r.num_kv_heads, r.head_dim, r.intermediate_size, r.attention_bias)
    assert attention_kinds.layer_kinds(c) == attention_kinds.layer_kinds(r)
    for a, b in zip(attention_kinds.rope_tables(c), attention_kinds.rope_tables(r), strict=True):
        np.testing.assert_allclose(a.inv_freq, b.inv_freq, rtol=1e-6)
        assert a.factor == pytest.approx(b.factor, rel=1e-6) and a.original_max == b.original_max
        if b.long_inv_freq is not None:
            np.testing.assert_allclose(a.long_inv_freq, b.long_inv_freq, rtol=1e-6)


def test_gguf_phi3_matches_transformers(tiny_model, tmp_path):
    path = tiny_model("Phi3ForCausalLM")
    got = load_model(write_family_gguf(tmp_path / "phi3.gguf", path, "phi3"), dtype="float32")
    _same_model_shape(got, load_model(path, dtype="float32"))
    assert got.config.extra["partial_rotary_factor"] == 0.5 and got.config.rope_scaling["rope_type"] == "longrope"
    check_direct(got.params, got.config, hf_model(path, "Phi3ForCausalLM"), prompts=PHI3_PROMPTS)


def test_gguf_phi3_fused_blocks_cut_by_rows(tiny_model, tmp_path):
    """keep_gguf_blocks on a Q8_0 Phi-3: attn_qkv's and ffn_up's blocks cut into q/k/v and gate/up by rows,
    each dequantizing to exactly the weight the float load of the same file makes."""
    from jlight.core.gguf_weights import GGUFQ8Weight, dequantize_gguf_t

    path = tiny_model("Phi3ForCausalLM")
    write_family_gguf(tmp_path / "phi3-q8.gguf", path, "phi3", linear_qtype="Q8_0")
    kept = load_model(str(tmp_path / "phi3-q8.gguf"), unstacked=True, keep_gguf_blocks=True).params["layers"]
    dense = load_model(str(tmp_path / "phi3-q8.gguf"), unstacked=True).params["layers"]
    for layer in range(2):
        for name in ("wq", "wk", "wv", "w_gate", "w_up"):
            assert isinstance(kept[layer][name], GGUFQ8Weight), name
            np.testing.assert_array_equal(np.asarray(dequantize_gguf_t(kept[layer][name])).T, np.asarray(dense[layer][name]))


def test_gguf_smollm3_matches_transformers(tiny_model, tmp_path):
    path = tiny_model("SmolLM3ForCausalLM")
    got = load_model(write_family_gguf(tmp_path / "smollm3.gguf", path, "smollm3"), dtype="float32")
    _same_model_shape(got, load_model(path, dtype="float32"))
    assert got.config.extra["no_rope_layers"] == [1, 1, 1, 0]
    check_direct(got.params, got.config, hf_model(path, "SmolLM3ForCausalLM"))


@pytest.mark.parametrize("experts, fused", [("f32", False), ("mxfp4", False), ("mxfp4", True)])
def test_gguf_gpt_oss_matches_transformers(tiny_model, tmp_path, experts, fused):
    """Float experts (the converter's path for a bf16 checkpoint) and MXFP4 ones (gpt-oss's release format,
    transformers reading the HF file dequantized), gate and up split or fused."""
    import torch
    import transformers

    from models.gpt_oss import moe_settings
    from test_gpt_oss import _mxfp4_copy

    path = tiny_model("GptOssForCausalLM", **GPT_OSS)
    if experts == "mxfp4":
        path = _mxfp4_copy(path, str(tmp_path / "mxfp4"))
        hf = transformers.GptOssForCausalLM.from_pretrained(
            path, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32).eval()
    else:
        hf = hf_model(path, "GptOssForCausalLM")
    gguf_path = write_family_gguf(tmp_path / "gpt-oss.gguf", path, "gpt-oss", fused)
    got = load_model(gguf_path, dtype="float32")
    ref = load_model(path, dtype="float32")
    _same_model_shape(got, ref)
    assert moe_settings(got.config) == moe_settings(ref.config)
    check_direct(got.params, got.config, hf)
    if experts == "mxfp4":  # kept as stored (quantization="mxfp4"): the same numbers, the experts still 4-bit
        from jlight.core.quantization import Mxfp4Weight, dequantize_mxfp4

        kept = load_model(gguf_path, dtype="float32", keep_mxfp4=True)
        for name in ("experts_gate", "experts_up", "experts_down"):
            w = kept.params["layers"][name]
            assert isinstance(w, Mxfp4Weight) and w.blocks.dtype == np.uint8
            np.testing.assert_array_equal(np.asarray(dequantize_mxfp4(w, np.float32)), np.asarray(got.params["layers"][name]))


def test_gguf_mxfp4_blocks_match_gguf_py():
    """from_ggml_mxfp4 on random ggml MXFP4 blocks gives gguf-py's dequantization (gguf.quants), and undoes the
    converter's repacking of HF blocks."""
    import gguf

    from jlight.loading.mxfp4 import Mxfp4HostWeight, from_ggml_mxfp4

    rng = np.random.default_rng(5)
    raw = rng.integers(0, 256, (3, 6, 4 * 17)).astype(np.uint8)  # [X, out, G * 17]
    raw[..., ::17] = rng.integers(100, 150, (3, 6, 4))
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.MXFP4)  # [X, out, in]
    np.testing.assert_array_equal(np.swapaxes(from_ggml_mxfp4(raw).dequantize(), -1, -2), ref)
    blocks, scales = rng.integers(0, 256, (2, 5, 3, 16)).astype(np.uint8), rng.integers(110, 140, (2, 5, 3)).astype(np.uint8)
    back = from_ggml_mxfp4(_mxfp4_repack((blocks, scales)))
    np.testing.assert_array_equal(back.blocks, blocks)
    np.testing.assert_array_equal(back.scales, scales)
    np.testing.assert_array_equal(back.dequantize(), Mxfp4HostWeight(blocks, scales).dequantize())


def test_gguf_gpt_oss_without_expert_biases_names_them(tiny_model, tmp_path):
    from jlight.core.errors import ModelLoadError

    path = tiny_model("GptOssForCausalLM", **GPT_OSS)
    gguf_path = write_family_gguf(tmp_path / "nobias.gguf", path, "gpt-oss", leave_out=("blk.1.ffn_up_exps.bias",))
    with pytest.raises(ModelLoadError, match=r"model.layers.1.mlp.experts lacks the expert tensors' up_proj_bias"):
        load_model(gguf_path)
