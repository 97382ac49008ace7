"""`jlight convert` and the orbax loader: a converted checkpoint restores to the same weights
and the same logits, on one device and (8 simulated CPU devices) into a tp=4 mesh."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jlight.core.config import ModelConfig
from jlight.core.parallel_ops import ParallelOps
from jlight.convert import model_config_to_hf_dict, write_converted
from jlight.core.errors import ModelLoadError
from jlight.loading import orbax_loader
from jlight.core.quantization import QuantizedWeight, quantize_int8
from simulated_devices import simulated_env

PROMPT = [3, 17, 250, 9, 9, 41, 128, 7, 64, 1, 200, 33, 5, 90, 11, 2, 77, 19]


def build_tiny_hf_model(path: str) -> str:
    """A random 2-layer Llama with GQA saved by transformers (float32 safetensors)."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, head_dim=8, max_position_embeddings=256,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def load_hf_params(model_dir: str, dtype=jnp.float32):
    """Params straight from the safetensors file (the path `jlight convert` starts from)."""
    from safetensors.numpy import load_file

    from jlight.loading.assemble import assemble_params

    config = ModelConfig.from_json_file(os.path.join(model_dir, "config.json"))
    tensors = load_file(os.path.join(model_dir, "model.safetensors"))
    return config, assemble_params(config, tensors.items(), dtype)


def prefill_logits(params, config: ModelConfig, tokens: list[int], page_size: int = 8) -> np.ndarray:
    """float32 logits [len(tokens), vocab] of one sequence prefilled in one step."""
    from jlight.models import get_model_family
    from jlight.core.batch_metadata import BatchMetadata
    from jlight.pallas_kernels.dispatch import get_kernels

    family = get_model_family(config)
    kernels = get_kernels("reference", "reference")
    num_tokens = len(tokens)
    num_seq_pages = -(-num_tokens // page_size)
    k_shape, v_shape = family.kv_cache_shapes(config, num_seq_pages + 1, page_size)  # +1: scratch page 0
    positions = np.arange(num_tokens, dtype=np.int32)  # [T]
    page_table = np.arange(1, num_seq_pages + 1, dtype=np.int32)[None, :]  # [1, pages]
    md = BatchMetadata(
        positions=jnp.asarray(positions),
        slot_mapping=jnp.asarray(page_table[0, positions // page_size] * page_size + positions % page_size),
        token_seq=jnp.zeros(num_tokens, jnp.int32),
        page_table=jnp.asarray(page_table),
        context_lens=jnp.asarray([num_tokens], jnp.int32),
        query_start=jnp.asarray([0, num_tokens], jnp.int32),
        logits_indices=jnp.asarray([num_tokens - 1], jnp.int32),
    )
    dtype = params["final_norm"].dtype

    @jax.jit
    def run(params, tokens, md):
        k_cache, v_cache = jnp.zeros(k_shape, dtype), jnp.zeros(v_shape, dtype)  # [layers, pages, page_size, kv_heads, head_dim]
        hidden, _, _ = family.forward(params, config, tokens, k_cache, v_cache, md, kernels, ParallelOps())
        return family.compute_logits(params, config, hidden, kernels, ParallelOps())

    return np.asarray(run(params, jnp.asarray(tokens, jnp.int32), md))


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return build_tiny_hf_model(str(tmp_path_factory.mktemp("tiny_llama")))


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_hf_params(tiny_model_dir)


def test_config_survives_hf_dict_round_trip(loaded):
    config, _ = loaded
    assert ModelConfig.from_hf_dict(model_config_to_hf_dict(config)) == config
    qwen = ModelConfig.from_hf_dict({**model_config_to_hf_dict(config), "architectures": ["Qwen3ForCausalLM"]})
    qwen = ModelConfig.from_hf_dict(model_config_to_hf_dict(qwen))
    assert qwen.qk_norm and qwen.architecture == "Qwen3ForCausalLM"


def test_convert_round_trip_gives_identical_logits(tiny_model_dir, loaded, tmp_path):
    config, params = loaded
    out = str(tmp_path / "converted")
    write_converted(out, config, params, tokenizer_dir=tiny_model_dir, dtype="float32", quantization=None, source=tiny_model_dir)
    assert orbax_loader.is_orbax_model_dir(out)
    assert os.path.isfile(os.path.join(out, "generation_config.json"))  # copied beside the weights
    config2, params2 = orbax_loader.load_orbax_model(out)
    assert config2 == config
    assert jax.tree.structure(params2) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
    want = prefill_logits(params, config, PROMPT)
    np.testing.assert_array_equal(prefill_logits(params2, config2, PROMPT), want)

    # And the jlight forward itself agrees with transformers on these weights.
    import torch
    import transformers

    hf = transformers.LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        hf_logits = hf(torch.tensor([PROMPT])).logits[0].numpy()
    np.testing.assert_allclose(want, hf_logits, atol=2e-4, rtol=1e-4)


def test_quantized_weights_restore_as_quantized(loaded, tmp_path):
    """int8 QuantizedWeight nodes come back as QuantizedWeight (no re-quantization, same bytes)."""
    config, params = loaded
    layers = dict(params["layers"])
    for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
        layers[name] = quantize_int8(layers[name])
    qparams = {**params, "layers": layers}
    out = str(tmp_path / "int8")
    write_converted(out, config, qparams, dtype="float32", quantization="int8", source="test")
    manifest = orbax_loader.read_manifest(out)
    assert manifest["quantization"] == "int8"
    _, restored = orbax_loader.load_orbax_model(out)
    assert isinstance(restored["layers"]["wq"], QuantizedWeight)
    assert restored["layers"]["wq"].values.dtype == jnp.int8
    np.testing.assert_array_equal(np.asarray(restored["layers"]["w_down"].values), np.asarray(layers["w_down"].values))
    np.testing.assert_array_equal(prefill_logits(restored, config, PROMPT), prefill_logits(qparams, config, PROMPT))


def test_bad_inputs_raise_value_errors(tmp_path, loaded):
    from jlight.convert import convert, quantize

    with pytest.raises(ValueError, match="--dtype"):
        convert(None, str(tmp_path / "x"), dtype="float8")
    with pytest.raises(ValueError, match="--quantization"):
        quantize({}, "int3")
    (tmp_path / "notempty").mkdir()
    (tmp_path / "notempty" / "file.txt").write_text("x")
    with pytest.raises(ValueError, match="-o"):
        convert(None, str(tmp_path / "notempty"))
    with pytest.raises(ValueError, match="-o .*file.txt"):  # was a NotADirectoryError traceback
        convert(None, str(tmp_path / "notempty" / "file.txt"))
    # A checkpoint from an unknown format version is refused with a message naming the fix.
    config, params = loaded
    out = str(tmp_path / "old")
    write_converted(out, config, {"final_norm": params["final_norm"]}, dtype="float32", quantization=None, source="t")
    manifest_path = os.path.join(out, orbax_loader.MANIFEST_NAME)
    manifest = json.load(open(manifest_path))
    manifest["format_version"] = 999
    json.dump(manifest, open(manifest_path, "w"))
    with pytest.raises(ModelLoadError, match="jlight convert"):
        orbax_loader.load_orbax_model(out)


_TP_SCRIPT = r"""
import sys
import jax, numpy as np
sys.path.insert(0, sys.argv[3])
from test_convert import load_hf_params, prefill_logits
from jlight.loading import orbax_loader
from jlight.sharding.mesh import make_mesh
from jax.sharding import PartitionSpec as P

assert len(jax.devices()) == 8
ckpt, model_dir = sys.argv[1], sys.argv[2]
mesh = make_mesh("tp=4", jax.devices()[:4])
config, params = orbax_loader.load_orbax_model(ckpt, mesh=mesh)
wq = params["layers"]["wq"]
assert wq.sharding.spec == P(None, None, "tp"), wq.sharding
assert len(wq.addressable_shards) == 4 and wq.addressable_shards[0].data.shape == (2, 64, 16)
assert params["layers"]["wo"].sharding.spec == P(None, "tp", None)
_, reference = load_hf_params(model_dir)
sharded_logits = prefill_logits(params, config, [3, 17, 250, 9, 9, 41, 128, 7, 64, 1, 200, 33])
want = prefill_logits(reference, config, [3, 17, 250, 9, 9, 41, 128, 7, 64, 1, 200, 33])
# XLA partitions the row-parallel matmuls, so sums run in another order: equal to float32 rounding.
np.testing.assert_allclose(sharded_logits, want, atol=1e-5, rtol=1e-5)
print("max abs diff", float(np.abs(sharded_logits - want).max()))
"""


def test_unsharded_checkpoint_restores_into_tp4_mesh(tiny_model_dir, loaded, tmp_path):
    config, params = loaded
    out = str(tmp_path / "tp")
    write_converted(out, config, params, dtype="float32", quantization=None, source=tiny_model_dir)
    env = simulated_env(8)
    proc = subprocess.run(
        [sys.executable, "-c", _TP_SCRIPT, out, tiny_model_dir, os.path.dirname(__file__)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "max abs diff" in proc.stdout


def test_jlight_convert_dir_loads_like_any_model(tiny_model, tmp_path):
    """convert() from a HF dir -> jlight.LLM(converted dir): same greedy text as the HF dir.
    (int8 checkpoints are covered by test_quantized_weights_restore_as_quantized, which is cheaper.)"""
    quantization = None
    import jlight.api
    from jlight.convert import convert

    model_dir = tiny_model("LlamaForCausalLM")
    out = str(tmp_path / "converted")
    convert(model_dir, out, dtype="float32", quantization=quantization)
    assert os.path.isfile(os.path.join(out, "tokenizer.json"))
    kwargs = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, min_token_bucket=64)  # one compiled step
    params = jlight.SamplingParams(max_tokens=8, temperature=0.0)
    prompts = ["the quick brown fox", "Paris is the capital of", "1 2 3"]
    converted = jlight.api.LLM(out, **kwargs)
    layers = converted.engine.runner.params["layers"][0]  # the first layer's weights (q/k/v fused on one device)
    leaf = layers["wqkv"].weight if "wqkv" in layers else layers["wq"]
    assert (leaf.values.dtype == jnp.int8) if quantization else (leaf.dtype == jnp.float32)
    got = [o.outputs[0].text for o in converted.generate(prompts, params, use_tqdm=False)]
    original = jlight.api.LLM(model_dir, quantization=quantization, **kwargs)
    want = [o.outputs[0].text for o in original.generate(prompts, params, use_tqdm=False)]
    assert got == want and any(got)


def _calibrated_convert(tiny_model, tmp_path, quantization):
    """convert() the tiny Llama with --calibration on a small text: (model_dir, text, out, manifest)."""
    from jlight.convert import convert

    model_dir = tiny_model("LlamaForCausalLM")
    text = tmp_path / "calibration.txt"
    text.write_text(" ".join(f"Sentence {i} talks about rivers, prime numbers, bread and the weather in spring." for i in range(40)))
    out = str(tmp_path / quantization)
    convert(model_dir, out, dtype="float32", quantization=quantization, calibration=str(text))
    return model_dir, text, out, json.load(open(os.path.join(out, orbax_loader.MANIFEST_NAME)))


def test_gptq_calibrated_convert_keeps_the_int8_format(tiny_model, tmp_path):
    """convert(..., quantization="int8", calibration=text): GPTQ int8 layers with round-to-nearest's
    scales, the lm_head left unquantized, and a checkpoint that loads and generates."""
    import jlight.api
    from jlight.convert import convert

    model_dir, text, out, manifest = _calibrated_convert(tiny_model, tmp_path, "int8")
    assert manifest["quantization"] == "int8" and manifest["calibration"].startswith("GPTQ on calibration.txt")

    _, params = orbax_loader.load_orbax_model(out)
    _, original = load_hf_params(model_dir)
    assert not isinstance(params["lm_head"], QuantizedWeight)  # kept in the model dtype
    np.testing.assert_array_equal(np.asarray(params["lm_head"]), np.asarray(original["lm_head"]))
    changed = 0
    for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
        q, rtn = params["layers"][name], quantize_int8(original["layers"][name])
        assert isinstance(q, QuantizedWeight) and q.values.dtype == jnp.int8
        np.testing.assert_array_equal(np.asarray(q.scales), np.asarray(rtn.scales))  # same scales as round-to-nearest
        changed += int(np.sum(np.asarray(q.values) != np.asarray(rtn.values)))
    assert changed > 0  # GPTQ chose other values than round-to-nearest somewhere

    llm = jlight.api.LLM(out, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=128,
                         min_token_bucket=64)  # one compiled step
    greedy = jlight.SamplingParams(max_tokens=6, temperature=0.0)
    got = llm.generate(["the quick brown fox"], greedy, use_tqdm=False)
    assert len(got[0].outputs[0].token_ids) == 6
    # Asking for the mode the checkpoint already has runs it as stored; another mode is refused by name.
    again = jlight.api.LLM(out, quantization="int8", max_num_seqs=2, max_num_batched_tokens=64, max_model_len=128,
                           min_token_bucket=64)  # one compiled step
    assert again.generate(["the quick brown fox"], greedy, use_tqdm=False)[0].outputs[0].token_ids == got[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="quantization='w8a8': the checkpoint's weights are already quantized as 'int8'"):
        jlight.api.LLM(out, quantization="w8a8", max_num_seqs=2, max_num_batched_tokens=64, max_model_len=128)

    with pytest.raises(ValueError, match="--calibration needs --quantization int8 \\(GPTQ\\) or w8a8"):
        convert(model_dir, str(tmp_path / "x"), dtype="float32", calibration=str(text))
    with pytest.raises(ValueError, match="no such file"):
        convert(model_dir, str(tmp_path / "y"), dtype="float32", quantization="int8", calibration=str(tmp_path / "missing.txt"))


def test_smoothquant_calibrated_w8a8_convert(tiny_model, tmp_path):
    """convert(..., quantization="w8a8", calibration=text): SmoothQuant then round-to-nearest W8A8,
    the lm_head left unquantized; the checkpoint loads, and its float model (before rounding) is the
    original's function, so its W8A8 logits stay close to the float ones."""
    import jlight.api
    from jlight.core.quantization import W8A8Weight, dequantize

    model_dir, _, out, manifest = _calibrated_convert(tiny_model, tmp_path, "w8a8")
    assert manifest["quantization"] == "w8a8" and manifest["calibration"].startswith("SmoothQuant")
    config, params = orbax_loader.load_orbax_model(out)
    _, original = load_hf_params(model_dir)
    assert not isinstance(params["lm_head"], W8A8Weight) and isinstance(params["layers"]["wq"], W8A8Weight)
    assert not np.allclose(np.asarray(params["layers"]["attn_norm"]), np.asarray(original["layers"]["attn_norm"]))  # smoothed
    float_params = dict(params, layers={k: dequantize(v) if isinstance(v, W8A8Weight) else v for k, v in params["layers"].items()})
    want = prefill_logits(original, config, PROMPT)
    np.testing.assert_allclose(prefill_logits(float_params, config, PROMPT), want, atol=0.05 * np.abs(want).max())
    llm = jlight.api.LLM(out, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=128,
                         min_token_bucket=64)  # one compiled step
    greedy = jlight.SamplingParams(max_tokens=6, temperature=0.0)
    got = llm.generate(["the quick brown fox"], greedy, use_tqdm=False)
    assert len(got[0].outputs[0].token_ids) == 6
    # Asking for the mode the checkpoint already has runs it as stored; another mode is refused by name.
    again = jlight.api.LLM(out, quantization="w8a8", max_num_seqs=2, max_num_batched_tokens=64, max_model_len=128,
                           min_token_bucket=64)  # one compiled step
    assert again.generate(["the quick brown fox"], greedy, use_tqdm=False)[0].outputs[0].token_ids == got[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="quantization='int8': the checkpoint's weights are already quantized as 'w8a8'"):
        jlight.api.LLM(out, quantization="int8", max_num_seqs=2, max_num_batched_tokens=64, max_model_len=128)


def test_a_dtype_other_than_the_checkpoints_is_refused(loaded, tmp_path):
    """A converted checkpoint's dtype is fixed at conversion. --dtype bfloat16 on a float32 one was
    silently ignored (the model ran in float32); now it is refused, naming both fixes."""
    from jlight.loading import load_model

    config, params = loaded
    out = str(tmp_path / "f32")
    write_converted(out, config, params, dtype="float32", quantization=None, source="t")
    with pytest.raises(ModelLoadError, match="float32.*--dtype bfloat16"):
        load_model(out, dtype="bfloat16")
    for dtype in ("auto", "float32"):
        assert load_model(out, dtype=dtype).params["final_norm"].dtype == jnp.float32


def test_a_corrupt_checkpoint_is_one_line_from_the_cli(loaded, tmp_path):
    """A converted checkpoint with a data file cut short (an interrupted copy) made `jlight generate` exit 1
    with orbax/TensorStore's 160-line traceback, and later (on a slower machine) with tracebacks from
    orbax's abandoned reads at exit. The manifest's file sizes now refuse it before orbax reads anything:
    one line naming the file and the fix."""
    config, params = loaded
    out = tmp_path / "cut"
    write_converted(str(out), config, params, dtype="float32", quantization=None, source="t")
    data = max((p for p in (out / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    size = data.stat().st_size
    data.write_bytes(data.read_bytes()[: size // 3])
    proc = subprocess.run([sys.executable, "-m", "jlight.cli", "generate", "hi", "--model", str(out), "--no-chat"],
                          capture_output=True, text=True, timeout=300)
    # The start-up's phase line ("jlight: loading PATH") comes before the error; nothing else may.
    lines = [l for l in proc.stderr.splitlines() if l.strip() and not l.startswith(("loading", "jlight: loading"))]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    rel = data.relative_to(out)
    assert lines[0] == (f"jlight: error: {out}: the checkpoint's file {rel} has {size // 3} bytes, the conversion "
                        f"wrote {size}; it is damaged or incomplete, copy it again or run `jlight convert` again")


def test_a_missing_checkpoint_file_is_named(loaded, tmp_path):
    from jlight.loading import load_model

    config, params = loaded
    out = tmp_path / "missing"
    write_converted(str(out), config, params, dtype="float32", quantization=None, source="t")
    victim = next(p for p in sorted((out / "params").rglob("*")) if p.is_file())
    victim.unlink()
    with pytest.raises(ModelLoadError, match=f"file {re.escape(str(victim.relative_to(out)))} is missing"):
        load_model(str(out))
