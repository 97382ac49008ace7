"""Qwen3.5's text models (dense and MoE; models/qwen3_next.py with its separate DeltaNet projections)
against transformers: float32 logits within 1e-4 and 32 greedy tokens identical, and the dense one
through the engine (hybrid_common.check_engine)."""
from __future__ import annotations

import pytest

from hybrid_common import PROMPT, check_engine, make_tiny_hybrid_model
from test_moe_common import check_against_transformers

ARCHS = ["Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hybrid"))
    return {arch: make_tiny_hybrid_model(root, arch) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_and_greedy_match_transformers(models, arch):
    check_against_transformers(*models[arch], PROMPT)


def test_engine_chunked_batched_preempted_prefix_cached_matches_transformers(models):
    check_engine(*models["Qwen3_5ForCausalLM"])
