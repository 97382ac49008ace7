"""Fused projections (models/layers.fuse_projections): one matmul for q/k/v and one for gate/up
compute what the separate projections do, against transformers, in bf16/f32 and int8, stacked
(lax.scan) and per layer (unrolled), and through the engine, where they are on by default."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from direct_forward import SingleSequenceRunner, hf_greedy, hf_logits
from test_moe_common import load_jlight, relative_error

import jlight
from jlight import SamplingParams
from jlight.models import get_model_family
from jlight.models.layers import FusedWeight
from jlight.core.quantization import QuantizedWeight
from jlight.quantization.rtn import quantize_params

PROMPT = [5, 17, 99, 3, 42, 8, 200, 13, 7, 64, 31, 150, 77]


@pytest.fixture(scope="module")
def models(tiny_model, tiny_moe_model):
    from transformers import AutoModelForCausalLM

    out = {}
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM"):  # Qwen2: q/k/v biases added after the split
        path = tiny_model(arch)
        out[arch] = (path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())
    # Qwen2-MoE: fused q/k/v and the shared expert's gate/up; the routed experts stay as they are.
    out["Qwen2MoeForCausalLM"] = tiny_moe_model("Qwen2MoeForCausalLM")
    return out


FUSED_NAMES = {
    "LlamaForCausalLM": {"wqkv", "w_gate_up"},
    "Qwen2ForCausalLM": {"wqkv", "w_gate_up"},
    "Qwen2MoeForCausalLM": {"wqkv", "shared_gate_up"},
}


@pytest.mark.parametrize("arch", sorted(FUSED_NAMES))
def test_fused_model_matches_transformers(models, arch):
    path, hf_model = models[arch]
    config, params = load_jlight(path)
    family = get_model_family(config)
    fused = dict(params, layers=family.fuse_projections(params["layers"]))
    layers = fused["layers"]
    assert {k for k, v in layers.items() if isinstance(v, FusedWeight)} == FUSED_NAMES[arch]
    assert not {"wq", "wk", "wv", "w_gate", "w_up", "shared_gate", "shared_up"} & set(layers)
    q_width = config.num_heads * config.head_dim
    kv_width = config.num_kv_heads * config.head_dim
    assert layers["wqkv"].widths == (q_width, kv_width, kv_width)
    assert layers["wqkv"].weight.shape == (config.num_layers, config.hidden_size, q_width + 2 * kv_width)

    runner = SingleSequenceRunner(fused, config, prefill_bucket=32)
    assert relative_error(runner.prefill_logits(PROMPT), hf_logits(hf_model, PROMPT)) < 1e-4
    assert runner.greedy(PROMPT, 16) == hf_greedy(hf_model, PROMPT, 16)


def test_int8_fused_per_layer_matches_unfused(models):
    """Per-layer (unrolled) int8 weights: the fused QuantizedWeight concatenates values and scales,
    so logits equal the unfused int8 model's; delete_parts frees the parts."""
    path, _ = models["LlamaForCausalLM"]
    config, params = load_jlight(path)
    family = get_model_family(config)
    q = quantize_params(params, "int8")
    unfused = family.unstack_layers(q)
    per_layer = family.unstack_layers(q)
    parts = [lp["wk"].values for lp in per_layer["layers"]]
    fused = dict(per_layer, layers=family.fuse_projections(per_layer["layers"], delete_parts=True))
    assert all(p.is_deleted() for p in parts)
    first = fused["layers"][0]
    assert isinstance(first["wqkv"].weight, QuantizedWeight) and first["wqkv"].weight.values.dtype == np.int8
    a = SingleSequenceRunner(unfused, config, prefill_bucket=32).prefill_logits(PROMPT)
    b = SingleSequenceRunner(fused, config, prefill_bucket=32).prefill_logits(PROMPT)
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)


def test_group_of_different_types_stays_separate(models):
    """wq kept unquantized next to int8 wk/wv cannot share one matrix: that group is left alone."""
    path, _ = models["LlamaForCausalLM"]
    config, params = load_jlight(path)
    mixed = quantize_params(params, "int8", keep=("wq",))
    layers = get_model_family(config).fuse_projections(mixed["layers"])
    assert {"wq", "wk", "wv"} <= set(layers) and "wqkv" not in layers
    assert isinstance(layers["w_gate_up"], FusedWeight)


def test_engine_fuses_by_default_and_can_be_told_not_to(models):
    path, hf_model = models["LlamaForCausalLM"]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = {}
    for fuse in (True, False):
        llm = jlight.LLM(path, dtype="float32", layer_loop="unroll", fuse_projections=fuse, max_num_seqs=4,
                         max_num_batched_tokens=32, num_pages=32, compilation_cache_dir=None,
                         min_token_bucket=32)  # one compiled step
        first_layer = llm.engine.runner.params["layers"][0]
        assert ("wqkv" in first_layer) == fuse and ("wq" in first_layer) != fuse
        outputs[fuse] = llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert outputs[True] == outputs[False] == hf_greedy(hf_model, PROMPT, 16)

