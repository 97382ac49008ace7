"""Granite-4.0-H (GraniteMoeHybrid: Mamba-2 layers between attention layers, MoE beside a shared MLP)
against transformers, alone and through the engine.

A tiny random model (4 layers: Mamba, attention, Mamba, Mamba; 4 experts top-2; RoPE; Granite's
multipliers) built with transformers and loaded by jlight's own loader. Direct: float32 logits within
1e-4 and 32 greedy tokens identical. Engine: prompts prefilled in 16-token chunks (each chunk resumes
the conv and SSM state the one before left), batched with other sequences' decode tokens, with too
few KV pages so that sequences are preempted and recomputed, and n=2.
"""
from __future__ import annotations

import logging

import numpy as np
import pytest

from direct_forward import hf_greedy
from hybrid_common import make_tiny_hybrid_model
from test_moe_common import check_against_transformers, check_unrolled_matches_scanned

ARCH = "GraniteMoeHybridForCausalLM"
PROMPT = [5, 17, 99, 3, 42, 8, 200, 13, 7, 64, 31, 150, 77, 90, 91, 92, 93, 94, 95, 96, 11]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_hybrid_model(str(tmp_path_factory.mktemp("hybrid")), ARCH)


def test_logits_and_greedy_match_transformers(model):
    check_against_transformers(*model, PROMPT)


def test_unrolled_layers_match_scanned(model):
    """Per-layer weights (family.unstack_layers, the GPU default) compute what the stacked groups do."""
    config, unstacked, _, _ = check_unrolled_matches_scanned(model[0], PROMPT)
    assert [len(unstacked[g]) for g in ("mamba_layers", "attn_layers")] == [3, 1]


def test_engine_chunked_batched_preempted_matches_transformers(model, caplog):
    import jlight.api
    from jlight import SamplingParams

    path, hf_model = model
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, 250, n)] for n in (40, 23, 9)]
    with caplog.at_level(logging.INFO, logger="jlight.engine.llm_engine"):
        llm = jlight.api.LLM(path, dtype="float32", max_num_batched_tokens=16, max_num_seqs=4, num_pages=9,
                             compilation_cache_dir=None, min_token_bucket=16)  # one compiled step
    engine = llm.engine
    assert not engine.block_manager.enable_prefix_caching
    assert any("prefix caching is off" in r.getMessage() for r in caplog.records)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    # 3 sequences of up to 72 tokens need 12 pages of 16; 8 usable pages force preemption and recompute.
    assert engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, 32)
    two = llm.generate([prompts[1]], SamplingParams(n=2, max_tokens=32, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in two[0].outputs] == [outs[1].outputs[0].token_ids] * 2
    assert engine.state_pool.num_free_slots == engine.state_pool.num_slots - 1  # every slot back
    assert engine.block_manager.num_used_pages == 0


def test_hybrid_engine_refuses_speculative_decoding(model):
    import jlight.api

    with pytest.raises(ValueError, match="speculative_config"):
        jlight.api.LLM(model[0], dtype="float32", compilation_cache_dir=None, warmup=False,
                       speculative_config={"method": "ngram", "num_speculative_tokens": 2})
