"""jlight's C++ CPU kernels (pallas_kernels/cpu_ffi.py): GGUF weights kept as the file stores them
(jlight/core/gguf_weights.py; the K-quants as their sub-blocks) and the kernel that multiplies them
(gguf_matmul_cpu), decode attention (paged_attention_cpu), each against its XLA reference; the blocks against
gguf-py's own dequantization (the float load's numbers); and the default engine, which keeps SmolLM2's
Q4_1 / Q8_0 weights and runs both kernels, against transformers.
"""
import os
import platform
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from direct_forward import hf_greedy, transformers_from_gguf
from jlight.core.gguf_weights import GGUFQ4Weight, GGUFQ8MinWeight, GGUFQ8Weight, dequantize_gguf_t
from jlight.loading.default_model import cache_dir
from jlight.loading.gguf_blocks import split_blocks
from kernel_batches import random_k_quant_blocks
from jlight.pallas_kernels import attention_reference, cpu_ffi, dispatch, gguf_matmul_cpu, matmul_reference, paged_attention_cpu

HAS_COMPILER = cpu_ffi._compiler() is not None


@pytest.fixture(scope="module")
def kernel():
    """The GGUF matmul, built into jlight's cache; on a machine with a C++ compiler it must build."""
    if not HAS_COMPILER:
        pytest.skip("no C++ compiler: the engine dequantizes GGUF weights instead (test_no_compiler_dequantizes)")
    if jax.default_backend() != "cpu":
        pytest.skip("the CPU kernels run on the CPU backend (a GPU engine dequantizes GGUF weights)")
    assert cpu_ffi.load(cache_dir()), "the CPU kernels did not build with the compiler present (see the warning)"
    return gguf_matmul_cpu.matmul


def _blocks(type_name: str, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """A [rows, k] weight quantized by gguf-py, as the file's bytes [rows, row bytes]."""
    import gguf
    w = np.random.default_rng(seed).standard_normal((rows, k)).astype(np.float32) * 0.05
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType[type_name])


def _device_weight(type_name: str, rows: int, k: int, seed: int = 0):
    """A [rows, k] weight of `type_name` kept as the engine keeps it: gguf-py's quantization of a random weight,
    or, for the K-quants (which gguf-py does not quantize), random blocks with weights of about 0.05."""
    rng = np.random.default_rng(seed)
    data = (random_k_quant_blocks(rng, type_name, rows, k, scale=2e-3) if type_name in K_QUANTS
            else _blocks(type_name, rows, k, seed))
    return split_blocks(type_name, data).to_device(lambda path, a: jax.device_put(a), "w")


# The K-quants -> the form they are kept in and its block (values a scale).
K_QUANTS = {"Q4_K": (GGUFQ4Weight, 32), "Q5_K": (GGUFQ8MinWeight, 32), "Q6_K": (GGUFQ8Weight, 16)}


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q8_0"])
def test_blocks_are_gguf_py_s_numbers(type_name):
    """The kept blocks dequantize (d * value + m, Q4_0 as Q4_1 with m = -8 d, Q5_0 as Q8_0 of value - 16) to
    exactly what gguf-py's dequantization gives for the same bytes."""
    import gguf
    data = _blocks(type_name, 40, 96)
    want = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[type_name])
    w = _device_weight(type_name, 40, 96)
    assert isinstance(w, GGUFQ8Weight if type_name in ("Q5_0", "Q8_0") else GGUFQ4Weight) and w.shape == (96, 40)
    np.testing.assert_array_equal(np.asarray(dequantize_gguf_t(w)), want)


@pytest.mark.parametrize("type_name", list(K_QUANTS))
def test_k_quant_blocks_are_gguf_py_s_numbers(type_name):
    """Random Q4_K / Q5_K / Q6_K super-blocks, with scales anywhere in float16's finite range, kept as their
    sub-blocks (float32 d and m) dequantize to exactly gguf-py's numbers for the same bytes: the float32
    weights the dequantizing load makes (gguf_loader), float32 equality, no tolerance."""
    import gguf
    kind, block = K_QUANTS[type_name]
    data = random_k_quant_blocks(np.random.default_rng(7), type_name, 24, 512)
    want = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[type_name])
    w = split_blocks(type_name, data).to_device(lambda path, a: jax.device_put(a), "w")
    assert isinstance(w, kind) and w.shape == (512, 24)
    assert w.scales.dtype == jnp.float32 and w.scales.shape == (24, 512 // block)
    np.testing.assert_array_equal(np.asarray(dequantize_gguf_t(w)), want)


def _check_kernel(kernel, type_name: str, rows: int, k: int, n: int):
    w = _device_weight(type_name, n, k, seed=rows)
    x = jnp.asarray(np.random.default_rng(rows + k).standard_normal((rows, k)), jnp.float32)
    got = jax.jit(kernel)(x, w)
    want = matmul_reference.matmul(x, w)
    assert got.shape == want.shape == (rows, n) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))


@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 9, 11, 16, 45])
@pytest.mark.parametrize("k,n", [(64, 33), (96, 70), (576, 200)])
def test_kernel_matches_reference(kernel, type_name, rows, k, n):
    _check_kernel(kernel, type_name, rows, k, n)


@pytest.mark.parametrize("type_name", list(K_QUANTS))
@pytest.mark.parametrize("rows", [1, 3, 8, 9])
@pytest.mark.parametrize("k,n", [(256, 33), (768, 70)])
def test_k_quant_kernel_matches_reference(kernel, type_name, rows, k, n):
    """The kernel's float32-scale instances: Q4_K as Q4 blocks, Q5_K as Q8 values with minimums, Q6_K as Q8
    values with a scale a 16; one row, a row group and its remainders."""
    _check_kernel(kernel, type_name, rows, k, n)


# Run in a process of its own (XLA registers a target once a process): the GGUF kernel built with extra compiler
# flags (argv[2:]) into the cache argv[1], against the reference on every kept form.
_CHECK_BUILD = """
import sys
from jlight.pallas_kernels import cpu_ffi, gguf_matmul_cpu
from test_cpu_kernels import K_QUANTS, _check_kernel
cpu_ffi.FLAGS = cpu_ffi.FLAGS + tuple(sys.argv[2:])
assert cpu_ffi.load(sys.argv[1])
for type_name in ("Q4_1", "Q8_0", *K_QUANTS):
    for rows in (1, 3, 8, 9):
        _check_kernel(gguf_matmul_cpu.matmul, type_name, rows, 512, 40)
"""


@pytest.mark.extended
@pytest.mark.parametrize("flags", [("-mno-avx512f",), ("-mno-avx512f", "-mno-avx2", "-mno-fma", "-mno-f16c")],
                         ids=["avx2", "portable"])
def test_kernel_paths_below_avx512(kernel, tmp_path, flags):
    """The kernel's AVX2 and portable C++ paths, which an AVX-512 host's -march=native build never takes: built
    without those instruction sets, each against the reference on every kept form (about 30 s a build)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 instruction-set flags")
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([sys.executable, "-c", _CHECK_BUILD, str(tmp_path), *flags], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def test_fusing_takes_only_one_form(kernel):
    """Projections kept in one form (type, scale dtype and block) fuse on their rows; a group that mixes forms
    (Q4_K q beside Q6_K v; Q8_0 beside Q6_K, both int8 values) keeps its parts, each as loaded."""
    from jlight.models.layers import FusedWeight, fuse_projections
    parts = {"wq": _device_weight("Q4_K", 64, 256), "wk": _device_weight("Q4_K", 32, 256),
             "wv": _device_weight("Q6_K", 32, 256), "w_gate": _device_weight("Q6_K", 48, 256, seed=1),
             "w_up": _device_weight("Q6_K", 40, 256, seed=2)}
    fused = fuse_projections(parts)
    assert set(fused) == {"wq", "wk", "wv", "w_gate_up"} and all(fused[n] is parts[n] for n in ("wq", "wk", "wv"))
    gate_up = fused["w_gate_up"]
    assert isinstance(gate_up, FusedWeight) and gate_up.widths == (48, 40) and isinstance(gate_up.weight, GGUFQ8Weight)
    want = jnp.concatenate([dequantize_gguf_t(parts["w_gate"]), dequantize_gguf_t(parts["w_up"])])
    np.testing.assert_array_equal(np.asarray(dequantize_gguf_t(gate_up.weight)), np.asarray(want))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 256)), jnp.float32)
    np.testing.assert_allclose(np.asarray(kernel(x, gate_up.weight)), np.asarray(x @ want.T), rtol=1e-5, atol=1e-5)
    mixed = {"wq": _device_weight("Q8_0", 64, 256), "wk": _device_weight("Q6_K", 32, 256), "wv": _device_weight("Q8_0", 32, 256)}
    unfused = fuse_projections(mixed)
    assert set(unfused) == set(mixed) and all(unfused[n] is mixed[n] for n in mixed)


def test_kernel_takes_leading_dims_and_out_dtype(kernel):
    w = _device_weight("Q4_1", 48, 64)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 3, 64)), jnp.bfloat16)
    got = jax.jit(lambda x, w: kernel(x, w, jnp.float32))(x, w)
    want = matmul_reference.matmul(x, w, jnp.float32)
    assert got.shape == (2, 3, 48) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_dispatch_sends_small_steps_to_the_kernel(kernel, monkeypatch):
    """Up to gguf_kernel_max_rows rows the kernel, beyond it the reference; plain weights never see either."""
    calls = []
    monkeypatch.setattr(gguf_matmul_cpu, "matmul", lambda x, w, out_dtype=None: calls.append(x.shape) or kernel(x, w, out_dtype))
    matmul = dispatch.get_kernels(gguf_kernel_max_rows=4).matmul
    w = _device_weight("Q8_0", 40, 64)
    for rows in (1, 4, 5):
        matmul(jnp.ones((rows, 64), jnp.float32), w)
    matmul(jnp.ones((1, 64), jnp.float32), jnp.ones((64, 40), jnp.float32))
    assert calls == [(1, 64), (4, 64)]


def test_smollm2_keeps_its_q4_1_and_q8_0_weights(smollm2_gguf):
    """Every linear weight of the default model stays in its blocks (the tied LM head as the embedding's
    Q8_0 blocks), and each dequantizes to exactly the float32 weight the dequantizing load makes."""
    from jlight.loading import load_model
    kept = load_model(smollm2_gguf, unstacked=True, keep_gguf_blocks=True).params
    dense = load_model(smollm2_gguf, unstacked=True).params
    assert isinstance(kept["lm_head"], GGUFQ8Weight)
    np.testing.assert_array_equal(np.asarray(dequantize_gguf_t(kept["lm_head"])).T, np.asarray(dense["lm_head"]))
    np.testing.assert_array_equal(np.asarray(kept["embed"]), np.asarray(dense["embed"]))
    for layer in (0, len(kept["layers"]) - 1):
        for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):  # wq/wk: llama.cpp's row order undone
            w = kept["layers"][layer][name]
            assert isinstance(w, GGUFQ4Weight), name
            np.testing.assert_array_equal(np.asarray(dequantize_gguf_t(w)).T, np.asarray(dense["layers"][layer][name]))


def test_default_engine_on_kept_weights_matches_transformers(kernel, smollm2_gguf):
    """jlight.LLM() with default options keeps the GGUF's blocks, fuses them and runs its decode steps in
    the CPU kernels (matmuls and attention); its greedy tokens are transformers' on the same file."""
    import jlight
    from jlight.engine import startup
    from jlight.engine.engine_config import EngineConfig
    llm = jlight.LLM(max_model_len=128, max_num_seqs=2, max_num_batched_tokens=32)
    layer = llm.engine.runner.params["layers"][0]
    assert isinstance(layer["wqkv"].weight, GGUFQ4Weight) and isinstance(llm.engine.runner.params["lm_head"], GGUFQ8Weight)
    matmul = llm.engine.runner.kernels.matmul  # dispatch.gguf_or with the rows it sends to the kernel
    assert matmul.func is dispatch.gguf_or and matmul.args[1] == EngineConfig.gguf_kernel_max_rows > 1
    assert llm.engine.runner.kernels.paged_attention.func is dispatch.cpu_or_reference_attention
    runner = llm.engine.runner
    plan = startup.memory_plan(runner.params, runner.k_cache, runner.v_cache, 8, 16)
    assert "(121 linear weights in the GGUF's own blocks)" in plan  # 30 layers x (q/k/v, o, gate/up, down), LM head
    hf_tok, hf = transformers_from_gguf(smollm2_gguf)
    prompts = ["The three primary colors are", "def fibonacci(n):\n"]
    ids = [hf_tok(p)["input_ids"] for p in prompts]
    outs = llm.generate(ids, jlight.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(ids, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(hf, prompt, 12)


def test_no_compiler_dequantizes(tmp_path, monkeypatch, caplog):
    """Without a C++ compiler the kernels say why, and the engine loads GGUF weights dequantized."""
    from jlight.engine.engine_config import EngineConfig
    from jlight.engine.weights import keeps_gguf_blocks
    monkeypatch.setattr(cpu_ffi, "_compiler", lambda: None)
    monkeypatch.setattr(cpu_ffi, "_registered", [])  # as in a process that has not loaded it
    monkeypatch.setenv("JLIGHT_CACHE", str(tmp_path))  # a cache without the built kernel
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        cpu_ffi.build(str(tmp_path))
    assert not cpu_ffi.load(str(tmp_path))
    assert "no C++ compiler" in caplog.text
    assert not keeps_gguf_blocks(EngineConfig(), None, gpu=False)
    assert not keeps_gguf_blocks(EngineConfig(gguf_weights="dequantize"), None, gpu=False)


def test_options_that_need_dense_weights_dequantize(kernel):
    from jlight.engine.engine_config import EngineConfig
    from jlight.engine.weights import keeps_gguf_blocks
    assert keeps_gguf_blocks(EngineConfig(), None, gpu=False)
    assert not keeps_gguf_blocks(EngineConfig(quantization="int8"), None, gpu=False)
    assert not keeps_gguf_blocks(EngineConfig(), None, gpu=True)
    assert not keeps_gguf_blocks(EngineConfig(model="org/name"), None, gpu=False)
    with pytest.raises(ValueError, match="gguf_weights"):
        EngineConfig(gguf_weights="keep").validate()


def test_kernel_library_name_follows_what_it_is_built_from(tmp_path, monkeypatch):
    """A cache shared between machines never loads a library built for another CPU or compiler."""
    if not HAS_COMPILER:
        pytest.skip("no C++ compiler")
    compiler = cpu_ffi._compiler()
    here = cpu_ffi.library_path(str(tmp_path), compiler)
    monkeypatch.setattr(cpu_ffi, "_cpu_features", lambda: "flags : sse2")
    assert cpu_ffi.library_path(str(tmp_path), compiler) != here
    assert shutil.which(compiler)


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4)])
@pytest.mark.parametrize("q_lens,context_lens,num_tokens", [
    ([1], [1], 1),  # a first decode token
    ([1, 1, 1], [37, 5, 64], 4),  # decode rows and a padding token
    ([3, 1, 5], [40, 9, 5], 16),  # speculative verify rows (several new tokens a row), a prompt, padding
])
def test_attention_matches_reference(kernel, page_size, heads, kv_heads, q_lens, context_lens, num_tokens):
    from kernel_batches import check_attention_output, random_batch, reference_attention
    rng = np.random.default_rng(page_size + heads)
    layers, num_pages, dim = 3, 48, 64
    md = random_batch(rng, q_lens, context_lens, page_size=page_size, num_pages=num_pages, num_tokens=num_tokens,
                      max_pages=-(-80 // page_size))
    k_cache, v_cache = (jnp.asarray(rng.standard_normal((layers, num_pages, page_size, kv_heads, dim)), jnp.float32)
                        for _ in range(2))
    q = jnp.asarray(rng.standard_normal((num_tokens, heads, dim)), jnp.float32)
    for layer in (0, 2):
        got = jax.jit(paged_attention_cpu.paged_attention, static_argnames="scale")(
            q, k_cache, v_cache, jnp.int32(layer), md, scale=dim ** -0.5)
        check_attention_output(got, reference_attention(q, k_cache, v_cache, layer, md, scale=dim ** -0.5), md, jnp.float32)


def test_attention_dispatch_keeps_the_reference_for_what_the_kernel_does_not_take(kernel, monkeypatch):
    """Steps above cpu_kernel_max_rows, sliding windows, soft caps, sinks and quantized pools go to the reference."""
    calls = []
    monkeypatch.setattr(paged_attention_cpu, "paged_attention", lambda *a, **kw: calls.append("kernel"))
    monkeypatch.setattr(attention_reference, "paged_attention", lambda *a, **kw: calls.append("reference"))
    attention = dispatch.get_kernels(cpu_kernel_max_rows=4).paged_attention
    pool = jnp.zeros((1, 2, 4, 1, 8), jnp.float32)
    for tokens, kw in ((4, {}), (5, {}), (1, {"sliding_window": 8}), (1, {"soft_cap": 30.0}),
                       (1, {"sinks": jnp.zeros(2)})):
        attention(jnp.zeros((tokens, 2, 8)), pool, pool, 0, None, scale=1.0, **kw)
    attention(jnp.zeros((1, 2, 8)), pool.astype(jnp.bfloat16), pool, 0, None, scale=1.0)
    assert calls == ["kernel"] + ["reference"] * 5
