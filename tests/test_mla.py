"""DeepSeek-V2/V3 (MLA + DeepSeekMoE) against transformers, the latent cache, and YaRN RoPE.

Tiny random-weight models with YaRN scaling (mscale), group-limited routing, shared experts, a
first dense layer, and for V3 a non-zero e_score_correction_bias (see test_moe_common.py).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from direct_forward import PAGE_SIZE, SingleSequenceRunner, hf_greedy
from test_moe_common import check_against_transformers, check_unrolled_matches_scanned, load_jlight

from jlight.models import deepseek

ARCHS = ["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"]
PROMPT = [5, 17, 99, 3, 42, 8, 200, 13, 7, 64, 31, 150, 77, 19, 23, 101, 4, 9]  # 18 tokens: spans 2 pages


@pytest.fixture(scope="module")
def models(tiny_moe_model):
    return {arch: tiny_moe_model(arch) for arch in ARCHS}  # built once per worker (conftest.py)


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_and_greedy_match_transformers(models, arch):
    check_against_transformers(*models[arch], PROMPT)


# DeepSeek-V2 with -m extended: V3 unrolls the same two stacks (its wq_a/wq_b in place of V2's single wq).
@pytest.mark.parametrize("arch", [pytest.param(ARCHS[0], marks=pytest.mark.extended), ARCHS[1]])
def test_unrolled_layers_match_scanned(models, arch):
    """layer_loop="unroll" (the default): both stacks (the first dense layer and the MoE layers)
    unrolled over per-layer weights compute what the two lax.scans do."""
    config, unstacked, scanned, unrolled = check_unrolled_matches_scanned(models[arch][0], PROMPT)
    assert isinstance(unstacked["dense_layers"], list) and isinstance(unstacked["layers"], list)
    assert len(unstacked["dense_layers"]) + len(unstacked["layers"]) == config.num_layers
    np.testing.assert_allclose(np.asarray(unrolled.k_cache), np.asarray(scanned.k_cache), rtol=1e-5, atol=1e-6)


def test_latent_cache_holds_only_latent_and_rope_key(models):
    """The K pool stores kv_lora_rank + qk_rope_head_dim values per token per layer, and they are
    exactly transformers' cached latent and RoPE key; the V pool is a placeholder."""
    path, hf_model = models["DeepseekV3ForCausalLM"]
    config, params = load_jlight(path)
    c = hf_model.config
    k_shape, v_shape = deepseek.kv_cache_shapes(config, 10, PAGE_SIZE)
    assert k_shape == (c.num_hidden_layers, 10, PAGE_SIZE, 1, c.kv_lora_rank + c.qk_rope_head_dim)
    assert int(np.prod(v_shape)) == c.num_hidden_layers
    runner = SingleSequenceRunner(params, config, prefill_bucket=32)
    runner.prefill_logits(PROMPT)
    cache = np.asarray(runner.k_cache)
    # Positions 0..17 sit in pages 1 and 2 (page 0 is scratch).
    ours = np.concatenate([cache[:, 1], cache[:, 2]], axis=1)[:, :len(PROMPT), 0]  # [layers, tokens, C + R]
    with torch.no_grad():
        hf_cache = hf_model(torch.tensor([PROMPT]), use_cache=True).past_key_values
    for layer in range(c.num_hidden_layers):
        latent, k_rope = hf_cache.layers[layer].keys[0, 0].numpy(), hf_cache.layers[layer].values[0, 0].numpy()
        np.testing.assert_allclose(ours[layer, :, :c.kv_lora_rank], latent, rtol=1e-4, atol=1e-5)
        # V3's interleaved RoPE returns the rotated pairs de-interleaved, the layout jlight caches.
        np.testing.assert_allclose(ours[layer, :, c.kv_lora_rank:], k_rope, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mscale", [(None, None), (1.0, 1.0), (0.707, 0.707), (1.0, 0.5)])
def test_yarn_frequencies_and_attention_factor_match_transformers(mscale):
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from jlight.models.rope_yarn import yarn_inv_frequencies

    rope = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
                beta_fast=32, beta_slow=1)
    if mscale[0] is not None:
        rope.update(mscale=mscale[0], mscale_all_dim=mscale[1])
    cfg = DeepseekV3Config(qk_rope_head_dim=64, max_position_embeddings=163840, rope_parameters=rope)
    ref_freq, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    freq, factor = yarn_inv_frequencies(64, 10000.0, {k: v for k, v in rope.items() if k != "rope_theta"}, 163840)
    np.testing.assert_allclose(freq, ref_freq.numpy(), rtol=1e-6)
    assert factor == pytest.approx(ref_factor, rel=1e-9)


def test_engine_chunked_prefill_batch_matches_transformers(models):
    import jlight.api
    from jlight import SamplingParams

    path, hf_model = models["DeepseekV3ForCausalLM"]
    prompts = [PROMPT + [33, 34, 35], PROMPT[:9]]
    llm = jlight.api.LLM(path, dtype="float32", max_num_batched_tokens=8, min_token_bucket=8, max_num_seqs=4, num_pages=32,
                         enable_prefix_caching=True, compilation_cache_dir=None)  # one step bucket (8 tokens) to compile
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, 24)
