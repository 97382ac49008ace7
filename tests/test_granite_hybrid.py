"""Granite-4.0-H (GraniteMoeHybrid: Mamba-2 layers between attention layers, MoE beside a shared MLP)
against transformers, alone and through the engine.

A tiny random model (4 layers: Mamba, attention, Mamba, Mamba; 4 experts top-2; RoPE; Granite's
multipliers) built with transformers and loaded by jlight's own loader. Direct: float32 logits within
1e-4 and 32 greedy tokens identical. Engine: hybrid_common.check_engine (chunked prefill across the
scan, batching, preemption and recompute, n=2).
"""
from __future__ import annotations

import pytest

from hybrid_common import PROMPT, check_engine, make_tiny_hybrid_model
from test_moe_common import check_against_transformers, check_unrolled_matches_scanned

ARCH = "GraniteMoeHybridForCausalLM"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_hybrid_model(str(tmp_path_factory.mktemp("hybrid")), ARCH)


def test_logits_and_greedy_match_transformers(model):
    check_against_transformers(*model, PROMPT)


def test_unrolled_layers_match_scanned(model):
    """Per-layer weights (family.unstack_layers, the GPU default) compute what the stacked groups do."""
    config, unstacked, _, _ = check_unrolled_matches_scanned(model[0], PROMPT)
    assert [len(unstacked[g]) for g in ("mamba_layers", "attn_layers")] == [3, 1]


def test_engine_chunked_batched_preempted_prefix_cached_matches_transformers(model):
    check_engine(*model)


def test_hybrid_engine_refuses_speculative_decoding_and_sequence_parallelism(model):
    import jlight.api

    with pytest.raises(ValueError, match="speculative_config"):
        jlight.api.LLM(model[0], dtype="float32", compilation_cache_dir=None, warmup=False,
                       speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="collective_matmul"):
        jlight.api.LLM(model[0], dtype="float32", compilation_cache_dir=None, warmup=False, mesh="tp=1",
                       collective_matmul=True)
