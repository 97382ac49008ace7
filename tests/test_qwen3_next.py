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


def test_the_step_never_slices_or_copies_a_state_pool(model):
    """The recurrent kernels read and write a layer's rows in the pool of all the layers of a kind: no compiled step
    holds a layer's whole slice of a state pool ([slots, ...], or [1, slots, ...]; the models took the slice out and
    set it back), nor a copy of a whole pool (XLA copied the convolution's pool once a layer where it could write
    the pool before the conv's output had read the old rows: 54 ms a token at 2,048 slots against 1 ms)."""
    import re

    import jlight

    llm = jlight.LLM(model[0], dtype="float32", max_num_seqs=37, max_num_batched_tokens=64, min_token_bucket=1,
                     page_size=8, num_pages=64, compilation_cache_dir=None, enable_prefix_caching=False)
    runner = llm.engine.runner
    pools = runner.k_cache.state
    assert all(a.shape[0] > 1 for a in pools.values())  # several layers of each kind
    shape = lambda dims: str(list(dims)).replace(" ", "")  # noqa: E731
    slices = {shape(dims) for a in pools.values() for dims in (a.shape[1:], (1,) + a.shape[1:])}
    whole = {shape(a.shape) for a in pools.values()}
    for executable in runner._executables.values():
        text = executable.as_text()
        entry = text[text.index("\nENTRY"):]
        held = [s for s in re.findall(r"= f32(\[[\d,]+\])", entry) if s in slices]
        assert not held, f"the step holds a layer's slice of a state pool: {sorted(set(held))}"
        copied = [s for s in re.findall(r"= f32(\[[\d,]+\])\S* copy\(", text) if s in whole]
        assert not copied, f"the step copies a whole state pool: {sorted(set(copied))}"
