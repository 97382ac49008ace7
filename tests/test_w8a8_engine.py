"""The engine's W8A8 path on the Pallas kernel (interpret mode on CPU): weights made K-major at
load (quantization.transpose_to_kmajor), the kernel called for the model's matmuls, and the same greedy
tokens as XLA's int8 dot on the [in, out] weights (both sum exactly in int32)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jlight
from jlight import SamplingParams
from jlight.models.layers import FusedWeight
from jlight.pallas_kernels import matmul_pallas
from jlight.core.quantization import W8A8WeightT

PROMPT = [5, 17, 99, 3, 42, 8, 200, 13, 7, 64, 31, 150, 77]


@pytest.mark.parametrize("layer_loop", ["unroll", "scan"])
def test_w8a8_kmajor_engine_matches_xla_int8(tiny_model, monkeypatch, layer_loop):
    path = tiny_model("LlamaForCausalLM")
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    kernel_rows = []
    real = matmul_pallas.w8a8_matmul
    monkeypatch.setattr(matmul_pallas, "w8a8_matmul", lambda x, *a, **k: kernel_rows.append(x.shape[0]) or real(x, *a, **k))
    assert matmul_pallas.W8A8_PALLAS_MIN_ROWS == 64
    outputs = {}
    for impl in ("pallas", "reference"):
        llm = jlight.LLM(path, dtype="float32", quantization="w8a8", matmul_impl=impl, layer_loop=layer_loop, max_num_seqs=2,
                         max_num_batched_tokens=64, num_pages=16, compilation_cache_dir=None,
                         min_token_bucket=64)  # one compiled step, of the kernel's 64 rows (W8A8_PALLAS_MIN_ROWS)
        params = llm.engine.runner.params
        kmajor = [leaf for leaf in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, W8A8WeightT))
                  if isinstance(leaf, W8A8WeightT)]
        assert bool(kmajor) == (impl == "pallas")
        if impl == "pallas":
            first = params["layers"][0] if layer_loop == "unroll" else params["layers"]
            assert isinstance(first["wqkv"], FusedWeight) and isinstance(first["wqkv"].weight, W8A8WeightT)
            assert isinstance(params["lm_head"], W8A8WeightT)
            assert params["lm_head"].values_t.dtype == jnp.int8
        outputs[impl] = llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0].token_ids
        if impl == "pallas":
            assert 64 in kernel_rows, "the Pallas W8A8 kernel was never called"
    assert outputs["pallas"] == outputs["reference"]


def test_int8_weights_kmajor_for_xla_on_gpu(tiny_model, monkeypatch):
    """On GPU with matmul_impl "auto", weight-only int8 linear weights are stored [out, in]
    (QuantizedWeightT) for XLA's dequantize-dot: same greedy tokens as matmul_impl "reference" on the
    [in, out] weights. The GPU is simulated by dispatch.on_gpu (attention stays on the reference, the
    weights on the CPU)."""
    from jlight.pallas_kernels import dispatch
    from jlight.core.quantization import QuantizedWeightT

    path = tiny_model("LlamaForCausalLM")
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for kmajor in (True, False):
        monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
        llm = jlight.LLM(path, dtype="float32", quantization="int8", matmul_impl="auto" if kmajor else "reference",
                         attention_impl="reference",
                         layer_loop="unroll", max_num_seqs=2, max_num_batched_tokens=16, num_pages=16, compilation_cache_dir=None,
                         min_token_bucket=16)  # one compiled step
        monkeypatch.undo()
        params = llm.engine.runner.params
        first = params["layers"][0]
        assert isinstance(first["wo"], QuantizedWeightT) == kmajor and isinstance(params["lm_head"], QuantizedWeightT) == kmajor
        assert isinstance(first["w_gate_up"].weight, QuantizedWeightT) == kmajor
        outputs[kmajor] = llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert outputs[True] == outputs[False]
