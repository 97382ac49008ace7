"""gpt-oss against transformers on a tiny random-weight model (float32): attention sinks, q/k/v/o
biases, alternating 8-token windows, YaRN RoPE, 8 experts top-2 with the clamped swiglu and
their biases (noise added to every bias and sink so they count). Logits within 1e-4 and 32
greedy tokens identical, scanned and unrolled, through the engine, and from an MXFP4 checkpoint."""
import os

import numpy as np
import pytest

from families_common import check_direct, check_engine, hf_model
from jlight.core.config import ModelConfig
from jlight.loading import load_model
from jlight.loading.hf_names_families import split_fused_tensors
from jlight.models import get_model_family

ARCH = "GptOssForCausalLM"


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model(ARCH), hf_model(tiny_model(ARCH), ARCH)


def test_scanned_and_unrolled_match_transformers(model):
    path, hf = model
    loaded = load_model(path, dtype="float32")
    check_direct(loaded.params, loaded.config, hf)
    check_direct(get_model_family(loaded.config).unstack_layers(loaded.params), loaded.config, hf)


def test_engine_matches_transformers(model):
    check_engine(*model)


def test_engine_with_the_pallas_grouped_matmul_matches_transformers(model):
    """The experts through the Pallas grouped matmul (interpret mode here), their gate and up biases added by expert
    after it: transformers' greedy tokens."""
    check_engine(*model, moe_impl="pallas")


def _config(**fields):
    return dict(architectures=[ARCH], model_type="gpt_oss", vocab_size=32, hidden_size=16, intermediate_size=8,
                num_hidden_layers=2, num_attention_heads=2, num_local_experts=4, num_experts_per_tok=2, **fields)


def test_expert_weights_split_from_their_biases():
    """gate_up_proj's interleaved columns and its bias become gate and up [X, E, F] (the shapes the grouped
    matmul's tiles take) and their biases [X, F]."""
    cfg = ModelConfig.from_hf_dict(_config())
    gate_up = np.arange(4 * 16 * 16, dtype=np.float32).reshape(4, 16, 16)  # [X, E, 2F], gate/up interleaved
    bias = -np.arange(4 * 16, dtype=np.float32).reshape(4, 16)
    out = dict(split_fused_tensors(cfg, [("model.layers.1.mlp.experts.gate_up_proj_bias", bias),
                                         ("model.layers.1.mlp.experts.gate_up_proj", gate_up)]))
    prefix = "model.layers.1.mlp.experts."
    gate, up = out[prefix + "gate_proj"], out[prefix + "up_proj"]
    assert gate.shape == up.shape == (4, 16, 8)
    np.testing.assert_array_equal(gate, gate_up[..., 0::2])
    np.testing.assert_array_equal(up, gate_up[..., 1::2])
    np.testing.assert_array_equal(out[prefix + "gate_proj_bias"], bias[:, 0::2])
    np.testing.assert_array_equal(out[prefix + "up_proj_bias"], bias[:, 1::2])
    with pytest.raises(ValueError, match="gate_up_proj without its bias"):
        list(split_fused_tensors(cfg, [("model.layers.0.mlp.experts.gate_up_proj", gate_up)]))


def test_mxfp4_dequantization_matches_transformers():
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from jlight.loading import mxfp4

    rng = np.random.default_rng(3)
    blocks = rng.integers(0, 256, (3, 24, 2, 16)).astype(np.uint8)  # [X, out, in / 32, 16]
    scales = rng.integers(100, 150, (3, 24, 2)).astype(np.uint8)
    ours = mxfp4.dequantize(blocks, scales)
    ref = convert_moe_packed_tensors(torch.tensor(blocks), torch.tensor(scales), dtype=torch.float32).numpy()
    assert ours.shape == ref.shape == (3, 64, 24)
    np.testing.assert_array_equal(ours, ref)
    with pytest.raises(ValueError, match="gate_up_proj_blocks without its scales"):
        list(mxfp4.expand_mxfp4([("model.layers.0.mlp.experts.gate_up_proj_blocks", blocks)]))


def _mxfp4_copy(path: str, out: str) -> str:
    """The tiny model with its expert weights replaced by random MXFP4 blocks and scales, as gpt-oss's
    checkpoints store them (config.json's quantization_config names mxfp4)."""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(path, out)
    tensors, rng = load_file(os.path.join(path, "model.safetensors")), np.random.default_rng(4)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, d_in, d_out = tensors.pop(name).shape
        tensors[name + "_blocks"] = rng.integers(0, 256, (experts, d_out, d_in // 32, 16)).astype(np.uint8)
        tensors[name + "_scales"] = rng.integers(120, 126, (experts, d_out, d_in // 32)).astype(np.uint8)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    return out


def _hf_mxfp4(path: str):
    """transformers' model of an MXFP4 checkpoint, its experts dequantized, in float32. Some releases (5.17
    among them) dequantize to bfloat16 whatever the dtype asked for; MXFP4's values (two significant bits
    times a power of two) are exact in bfloat16, so the model cast to float32 holds the file's values and
    computes in float32 as jlight's float32 load does."""
    import torch
    import transformers

    return transformers.GptOssForCausalLM.from_pretrained(
        path, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32).float().eval()


def test_mxfp4_checkpoint_matches_transformers(model, tmp_path):
    """jlight expands an MXFP4 checkpoint's experts at load; transformers loads the same file
    dequantized (Mxfp4Config(dequantize=True)): logits within 1e-4, 32 greedy tokens identical."""
    path = _mxfp4_copy(model[0], str(tmp_path / "mxfp4"))
    hf = _hf_mxfp4(path)
    loaded = load_model(path, dtype="float32")
    check_direct(loaded.params, loaded.config, hf)


def test_converted_checkpoint_gives_transformers_tokens(model, tmp_path):
    """jlight convert's orbax checkpoint of gpt-oss (experts with their biases) restores to the same model."""
    import jlight
    from direct_forward import hf_greedy
    from jlight import SamplingParams
    from jlight.convert import convert

    path, hf = model
    out = str(tmp_path / "converted")
    convert(path, out, dtype="float32")
    llm = jlight.LLM(out, dtype="float32", max_num_batched_tokens=16, min_token_bucket=16, max_num_seqs=2, num_pages=32,
                     warmup=False, compilation_cache_dir=None)
    prompt = list(range(3, 40))
    got = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)
    assert got[0].outputs[0].token_ids == hf_greedy(hf, prompt, 16)


def test_mxfp4_weights_kept_as_stored_expand_to_the_files_values():
    """Mxfp4HostWeight.to_device's layout (two values a byte along `in`, a scale a 32-row block) expands
    (dequantize_mxfp4) to what the host's dequantization gives, column splits included."""
    import jax.numpy as jnp

    from jlight.core.quantization import dequantize_mxfp4
    from jlight.loading.mxfp4 import Mxfp4HostWeight

    rng = np.random.default_rng(5)
    host = Mxfp4HostWeight(rng.integers(0, 256, (3, 24, 2, 16)).astype(np.uint8),
                           rng.integers(110, 140, (3, 24, 2)).astype(np.uint8))
    for w in (host, host.columns(slice(1, None, 2))):
        kept = w.to_device()
        assert kept.blocks.dtype == kept.scales.dtype == np.uint8 and kept.shape == w.shape
        np.testing.assert_array_equal(np.asarray(dequantize_mxfp4(kept, jnp.float32)), w.dequantize())


@pytest.mark.parametrize("layer_loop", ["scan", "unroll"])
def test_mxfp4_kept_as_stored_gives_transformers_tokens(model, tmp_path, layer_loop):
    """quantization="mxfp4" keeps the MXFP4 checkpoint's experts as stored (uint8 blocks and scales, biases in
    the model dtype) and the engine gives transformers' greedy tokens of the same file, through check_engine's
    batch (preemption, chunked prefill across windows, the prefix cache); a model without MXFP4 weights is refused."""
    from jlight.core.quantization import Mxfp4Weight

    path = _mxfp4_copy(model[0], str(tmp_path / "mxfp4"))
    hf = _hf_mxfp4(path)
    check_engine(path, hf, quantization="mxfp4", layer_loop=layer_loop)
    loaded = load_model(path, dtype="float32", keep_mxfp4=True)
    kept = [w for w in jax_leaves_of(loaded.params, Mxfp4Weight)]
    assert len(kept) == 3 and all(w.blocks.dtype == np.uint8 and w.shape[0] == 2 for w in kept)  # gate, up, down
    import jlight

    llm = jlight.LLM(path, dtype="float32", quantization="mxfp4", layer_loop=layer_loop, num_pages=16, warmup=False,
                     compilation_cache_dir=None)
    ran = jax_leaves_of(llm.engine.runner.params, Mxfp4Weight)  # the step's own weights, as stored
    assert len(ran) == (3 if layer_loop == "scan" else 3 * 2) and all(w.blocks.dtype == np.uint8 for w in ran)
    with pytest.raises(ValueError, match="'mxfp4' keeps an MXFP4 checkpoint's experts"):
        jlight.LLM(model[0], dtype="float32", quantization="mxfp4", num_pages=16, warmup=False,
                   compilation_cache_dir=None)


def test_mxfp4_through_the_pallas_grouped_matmul_gives_transformers_tokens(model, tmp_path):
    """MXFP4 experts kept as stored and expanded in the Pallas grouped matmul's registers (interpret mode here; on a
    GPU "auto" takes this path at every batch size): transformers' greedy tokens of the same file."""
    path = _mxfp4_copy(model[0], str(tmp_path / "mxfp4"))
    hf = _hf_mxfp4(path)
    check_engine(path, hf, quantization="mxfp4", moe_impl="pallas")


def jax_leaves_of(tree, kind):
    import jax

    return [w for w in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, kind)) if isinstance(w, kind)]


@pytest.mark.parametrize("tokens", [1, 64, 2048])
def test_gpt_oss_20b_experts_take_the_pallas_grouped_matmul(tokens):
    """gpt-oss-20b's expert weights keep the shapes the Pallas grouped matmul's tiles take (K and N multiples of
    16), so on a GPU every step runs its experts there. With the gate and up biases riding as an extra input row
    (K = 2881) no step could: steps fell to ragged_dot's dense FLOPs, a decode step's 8-token bucket too (an H100
    gave 1,670 output tokens/s on the nano-vllm workload against vLLM's 11,530)."""
    import sys

    import jax
    import jax.numpy as jnp

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import family_shapes

    from jlight.models import moe
    from jlight.pallas_kernels import dispatch, grouped_matmul_pallas

    cfg = ModelConfig.from_hf_dict(family_shapes.shape("gpt-oss-20b"))
    shapes = get_model_family(cfg).param_shapes(cfg)["layers"]
    w = {n: jax.ShapeDtypeStruct(shapes[n][1:], jnp.bfloat16) for n in shapes if n.startswith("experts")}  # one layer
    gate = moe.BiasedExperts(w["experts_gate"], w["experts_gate_bias"])
    grouped = dispatch.GroupedMatmul(grouped_matmul_pallas.grouped_matmul, grouped_matmul_pallas.fits)
    assert moe.resolve_expert_impl("auto", tokens * 4, gate, w["experts_down"], grouped) == "pallas"
