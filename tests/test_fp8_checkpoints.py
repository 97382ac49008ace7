"""HF checkpoints stored in FP8 (jlight/loading/fp8_checkpoint.py), written by tests/fp8_hf_checkpoints.py
from a tiny random Llama with torch: compressed-tensors per-channel and the 128x128 block layout. Each
loads as Fp8Weights and gives, through the whole engine (teacher-forced prompt logprobs, float32,
weight-only fp8 matmuls so that only the weights' representation is tested), the logprobs of the
weights the checkpoint stands for, as transformers computes them: from the dequantized state dict for
compressed-tensors (transformers needs the compressed-tensors package for those, not installed here),
and by transformers' own FineGrainedFP8 loader (dequantizing on the CPU) for the block layout.
Also: the per-channel requantization of block scales, errors for layouts jlight does not read, and
`jlight convert --quantization fp8` round trips."""
from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fp8_hf_checkpoints import dequantized_state, write_fp8_checkpoint
from jlight.core.errors import UnsupportedModelError
from jlight.core.quantization import Fp8Weight, Fp8WeightT
from jlight.loading import fp8_checkpoint, load_model

# hidden 128, MLP 384: q/k/v/o and the MLP cut into several 128x128 blocks (k/v's 64 rows: one partial block)
SHAPE = dict(hidden_size=128, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2)
PROMPT_LENS = (40, 23)
WEIGHT_ONLY = dict(fp8_w8a8_min_rows=1 << 20)


@pytest.fixture(scope="module")
def source(tiny_model):
    return tiny_model("LlamaForCausalLM", **SHAPE)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    return [rng.integers(3, 500, size=n).tolist() for n in PROMPT_LENS]


def _engine_logprobs(path, prompts, **opts) -> np.ndarray:
    """The true next token's logprob at every prompt position, teacher-forced through the engine (float32)."""
    import jlight
    from jlight import SamplingParams

    llm = jlight.LLM(path, dtype="float32", max_num_seqs=2, max_num_batched_tokens=64, num_pages=16,
                     compilation_cache_dir=None, min_token_bucket=64, **opts)  # one compiled step
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    return np.array([o.prompt_logprobs[pos][p[pos]] for o, p in zip(outs, prompts) for pos in range(1, len(p))]), llm


def _hf_logprobs(model, prompts) -> np.ndarray:
    import torch

    from direct_forward import hf_logits

    out = []
    for p in prompts:
        lp = torch.log_softmax(torch.tensor(hf_logits(model, p)), -1).numpy()
        out.extend(lp[pos - 1, p[pos]] for pos in range(1, len(p)))
    return np.array(out)


def _hf_model(path, state=None):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if state is not None:
        model.load_state_dict(state, strict=False)
    return model


def _bytes(t) -> np.ndarray:
    """A torch float8 tensor's bytes as a uint8 array (numpy has no float8)."""
    import torch

    return t.view(torch.uint8).numpy()


def _fp8_leaves(params):
    return [w for w in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, (Fp8Weight, Fp8WeightT)))
            if isinstance(w, (Fp8Weight, Fp8WeightT))]


def test_compressed_tensors_channel_checkpoint(source, prompts, tmp_path):
    """Per-channel scales are kept exactly; the engine's logprobs are transformers' on the dequantized weights."""
    path = str(tmp_path / "ct")
    tensors = write_fp8_checkpoint(source, path, "compressed-tensors-channel")
    loaded = load_model(path, dtype="float32")
    wq = loaded.params["layers"]["wq"]
    assert isinstance(wq, Fp8Weight) and loaded.params["lm_head"].dtype == jnp.float32  # lm_head is in `ignore`
    stored = tensors["model.layers.1.self_attn.q_proj.weight"]
    np.testing.assert_array_equal(np.asarray(wq.values[1]).view(np.uint8), _bytes(stored).T)
    np.testing.assert_array_equal(np.asarray(wq.scales[1]), tensors["model.layers.1.self_attn.q_proj.weight_scale"].numpy()[:, 0])
    got, llm = _engine_logprobs(path, prompts, **WEIGHT_ONLY)
    assert len(_fp8_leaves(llm.engine.runner.params)) > 0  # the engine ran them as fp8
    reference = _hf_logprobs(_hf_model(source, dequantized_state(tensors)), prompts)
    np.testing.assert_allclose(got, reference, atol=2e-4)
    # And it is fp8: the unquantized model's logprobs differ by far more.
    assert np.abs(_hf_logprobs(_hf_model(source), prompts) - reference).max() > 50 * 2e-4


def test_block_checkpoint_matches_transformers_fineGrainedFP8(source, prompts, tmp_path):
    """The 128x128 block layout with power-of-two block scales: the per-channel requantization is exact,
    so the engine's logprobs are those of transformers' own FineGrainedFP8 loader (dequantized on the CPU)."""
    path = str(tmp_path / "block")
    tensors = write_fp8_checkpoint(source, path, "fp8-block-pow2")
    scale = tensors["model.layers.0.mlp.gate_proj.weight_scale_inv"]
    assert scale.shape == (3, 1) and len(set(scale.flatten().tolist())) > 1  # several blocks, several scales
    got, llm = _engine_logprobs(path, prompts, **WEIGHT_ONLY)
    assert len(_fp8_leaves(llm.engine.runner.params)) == 2 * 4  # qkv (fused), o, gate/up (fused), down; 2 layers
    reference = _hf_logprobs(_hf_model(path), prompts)
    np.testing.assert_allclose(got, reference, atol=2e-4)
    # The default (W8A8 at these 64-row steps): within the activations' e4m3 error of it.
    w8a8, _ = _engine_logprobs(path, prompts)
    assert 2e-4 < np.abs(w8a8 - reference).mean() < 0.1


def test_block_checkpoint_with_float_scales(source, prompts, tmp_path):
    """Arbitrary float32 block scales: each value is rounded to e4m3 a second time when the blocks become
    channels. The engine's logprobs differ from transformers' FineGrainedFP8 by a fraction of what fp8
    itself moves them from the unquantized model: mean |d logprob| 0.027 against 0.108, measured here
    (2026-12-03; a value already on the e4m3 grid of its block moves only where the channel's scale puts
    it between grid points); the bound allows half the fp8 error."""
    path = str(tmp_path / "block-f32")
    write_fp8_checkpoint(source, path, "fp8-block")
    got, _ = _engine_logprobs(path, prompts, **WEIGHT_ONLY)
    fp8_reference = _hf_logprobs(_hf_model(path), prompts)
    fp8_error = np.abs(fp8_reference - _hf_logprobs(_hf_model(source), prompts)).mean()
    requant_error = np.abs(got - fp8_reference).mean()
    assert 0 < requant_error <= 0.5 * fp8_error, (requant_error, fp8_error)


def test_blocks_to_channels_error_bound():
    """The requantization itself, on a weight whose blocks (the last ones partial) have very different scales:
    every value within e4m3's rounding (2^-4 relative, 2^-10 of the channel scale below the normal range) of
    the block-dequantized weight, and exact where a row's block scales differ by powers of two (for every
    value that stays in e4m3's normal range once rescaled: the subnormals keep fewer bits)."""
    rng = np.random.default_rng(0)
    n, k, block = 200, 300, (128, 128)  # 2 x 3 blocks, the last row and column of blocks partial
    values = np.clip(rng.standard_normal((n, k)) * 100, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    scale = rng.uniform(0.001, 0.1, (2, 3)).astype(np.float32)
    dense = fp8_checkpoint.dequantize_blocks(values, scale, block)
    by_loop = np.zeros((n, k), np.float32)  # the block layout's definition, block by block
    for i in range(2):
        for j in range(3):
            rows, cols = slice(i * 128, (i + 1) * 128), slice(j * 128, (j + 1) * 128)
            by_loop[rows, cols] = values[rows, cols].astype(np.float32) * scale[i, j]
    np.testing.assert_array_equal(dense, by_loop)
    channels = fp8_checkpoint.blocks_to_channels(values, scale, block)
    err = np.abs(channels.dequantize() - dense)
    assert (err <= 2.0 ** -4 * np.abs(dense) + 2.0 ** -10 * channels.scales[:, None]).all()
    assert 0.01 < np.linalg.norm(err) / np.linalg.norm(dense) < 0.04  # it did round a second time
    pow2 = (2.0 ** rng.integers(-12, -3, (2, 3))).astype(np.float32)
    exact = fp8_checkpoint.blocks_to_channels(values, pow2, block)
    dense = fp8_checkpoint.dequantize_blocks(values, pow2, block)
    normal = np.abs(dense) >= 2.0 ** -6 * exact.scales[:, None]
    assert normal.mean() > 0.9
    np.testing.assert_array_equal(exact.dequantize()[normal], dense[normal])
    assert (np.abs(exact.dequantize() - dense) <= 2.0 ** -10 * exact.scales[:, None]).all()
    with pytest.raises(ValueError, match="block scales of shape"):
        fp8_checkpoint.dequantize_blocks(values, scale[:, :2], block)


@pytest.mark.parametrize("qc, match", [
    ({"quant_method": "gptq", "bits": 4}, "quant_method='gptq' is not supported"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}},
     "num_bits=4, type='int'"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "token"}}}},
     "strategy='token'"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt='e5m2'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
])
def test_unsupported_quantization_configs_name_the_field(qc, match):
    with pytest.raises(UnsupportedModelError, match=match):
        fp8_checkpoint.fp8_scheme({"quantization_config": qc})


def test_scheme_of_each_layout():
    ct = lambda s, **w: {"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {
        "g": {"weights": {"num_bits": 8, "type": "float", "strategy": s, **w}}}}}
    assert fp8_checkpoint.fp8_scheme(ct("channel")).strategy == "channel"
    assert fp8_checkpoint.fp8_scheme(ct("tensor")).strategy == "tensor"
    assert fp8_checkpoint.fp8_scheme(ct("block", block_structure=[128, 128])).block == (128, 128)
    assert fp8_checkpoint.fp8_scheme({"quantization_config": {"quant_method": "fp8"}}).strategy == "tensor"
    assert fp8_checkpoint.fp8_scheme({}) is None
    assert fp8_checkpoint.fp8_scheme({"quantization_config": {"quant_method": "mxfp4"}}) is None  # loading/mxfp4.py
    # A per-tensor scale is the same scale on every channel.
    values = np.ones((3, 4), np.float32).astype(ml_dtypes.float8_e4m3fn)
    w = fp8_checkpoint.channel_weight("x.weight", values, np.float32(0.5), fp8_checkpoint.fp8_scheme(ct("tensor")))
    np.testing.assert_array_equal(w.scales, [0.5, 0.5, 0.5])


def test_missing_scale_is_an_error(source, tmp_path):
    from safetensors.torch import load_file, save_file

    path = str(tmp_path / "broken")
    write_fp8_checkpoint(source, path, "compressed-tensors-channel")
    tensors = load_file(os.path.join(path, "model.safetensors"))
    del tensors["model.layers.0.mlp.up_proj.weight_scale"]
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.0.mlp.up_proj.weight without its scale"):
        load_model(path, dtype="float32")


def test_convert_fp8_round_trip(source, tmp_path):
    """`jlight convert --quantization fp8` stores Fp8Weights that load back bit for bit, which the engine takes
    as stored (no second quantization); an FP8 checkpoint converts with its own values; asking for int8
    on it is an error naming the option."""
    import jlight
    from jlight.convert import convert
    from jlight.quantization.rtn import quantize_params

    out = str(tmp_path / "converted")
    convert(source, out, dtype="bfloat16", quantization="fp8")
    restored = load_model(out)
    expected = quantize_params(load_model(source, dtype="bfloat16").params, "fp8")
    for got, want in zip(jax.tree.leaves(restored.params), jax.tree.leaves(expected)):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))
    assert isinstance(restored.params["layers"]["w_down"], Fp8Weight)
    with open(os.path.join(out, "jlight_checkpoint.json")) as f:
        assert json.load(f)["quantization"] == "fp8"
    llm = jlight.LLM(out, quantization="fp8", warmup=False, num_pages=8, max_num_seqs=2, max_num_batched_tokens=16,
                     compilation_cache_dir=None, fuse_projections=False)
    wo = llm.engine.runner.params["layers"][0]["wo"]
    assert isinstance(wo, Fp8WeightT)
    np.testing.assert_array_equal(np.asarray(wo.values_t).view(np.uint8),
                                  np.asarray(restored.params["layers"]["wo"].values[0]).T.view(np.uint8))
    # An HF FP8 checkpoint through convert keeps its values.
    hf = str(tmp_path / "ct")
    tensors = write_fp8_checkpoint(source, hf, "compressed-tensors-channel")
    convert(hf, str(tmp_path / "ct-converted"), dtype="bfloat16", quantization="fp8")
    wv = load_model(str(tmp_path / "ct-converted")).params["layers"]["wv"]
    np.testing.assert_array_equal(np.asarray(wv.values[0]).view(np.uint8),
                                  _bytes(tensors["model.layers.0.self_attn.v_proj.weight"]).T)
    with pytest.raises(ValueError, match="--quantization='int8': the checkpoint's weights are already quantized as 'fp8'"):
        convert(hf, str(tmp_path / "ct-int8"), dtype="bfloat16", quantization="int8")
    shutil.rmtree(out)
