"""Qwen3-Next (gated DeltaNet three layers in four, gated-output attention, MoE with a gated shared
expert) against transformers, alone and through the engine.

A tiny random model (DeltaNet x3 then attention; 2 key heads for 4 value heads; 4 experts top-2;
RoPE over a quarter of head_dim) built with transformers and loaded by jlight's own loader. Direct:
float32 logits within 1e-4 and 32 greedy tokens identical. Engine: hybrid_common.check_engine
(chunked prefill across the delta rule's chunks, batching, preemption and re-admission, a
prefix-cache hit that restores a saved state, n=2). The
unrolled layer loop is models/hybrid.py's, checked on Granite (test_granite_hybrid.py).
"""
from __future__ import annotations

import pytest

from hybrid_common import PROMPT, check_engine, make_tiny_hybrid_model
from test_moe_common import check_against_transformers

ARCH = "Qwen3NextForCausalLM"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_hybrid_model(str(tmp_path_factory.mktemp("hybrid")), ARCH)


def test_logits_and_greedy_match_transformers(model):
    check_against_transformers(*model, PROMPT)


def test_engine_chunked_batched_preempted_prefix_cached_matches_transformers(model):
    check_engine(*model)
