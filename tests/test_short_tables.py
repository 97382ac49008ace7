"""Narrow page tables for short-context steps (ModelRunner.short_tables, Kernels.short_table_span).

Where the attention runs a cheaper path over a narrow page table (the Mosaic GPU kernel skips
flash-decoding's work items and their combine when the table spans at most split_kv.SHORT_SPAN
positions), the runner compiles those buckets a second time with that table and runs every step whose
rows fit it there. The CPU runs the XLA reference, which offers no such path, so the engine test hands
the reference a made-up span: the tokens must not change, and the narrow variant must be the one that
short steps run.
"""
import numpy as np
import pytest

from jlight.engine.engine_config import EngineConfig
from jlight.engine.llm_engine import LLMEngine
from jlight.engine.sampling_params import SamplingParams
from jlight.pallas_kernels import dispatch, paged_attention_mosaic, split_kv
from families_common import engine_greedy_tokens

SPAN = 32  # positions: 4 pages of 8


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("LlamaForCausalLM", max_position_embeddings=1024)


def _engine(model_dir, monkeypatch, span):
    real = dispatch.get_kernels
    if span is not None:
        monkeypatch.setattr(dispatch, "get_kernels", lambda *a, **k: real(*a, **k)._replace(
            short_table_span=lambda T, B, kv_heads: span if T <= 8 else 0))
    config = EngineConfig(model=model_dir, dtype="float32", max_num_seqs=8, max_num_batched_tokens=32, page_size=8,
                          num_pages=120, max_model_len=256, compilation_cache_dir=None)
    engine = LLMEngine(config)
    monkeypatch.setattr(dispatch, "get_kernels", real)
    return engine


def _run(engine, prompts, max_tokens, widths=None):
    if widths is not None:
        real_prepare = engine.runner.prepare

        def prepare(plan, *a, **k):
            inp = real_prepare(plan, *a, **k)
            T = engine.runner.bucket_for(max(plan.num_tokens, 1))
            widths.append((T, max(len(r.seq.pages) for r in plan.rows), inp[0].md.page_table.shape[1]))
            return inp

        engine.runner.prepare = prepare
    return engine_greedy_tokens(engine, prompts, max_tokens)


def test_short_steps_run_the_narrow_variant_with_the_same_tokens(model_dir, monkeypatch):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 200, n).tolist() for n in (5, 9, 20)]  # contexts grow past 32 positions while decoding
    plain = _run(_engine(model_dir, monkeypatch, None), prompts, 20)
    engine = _engine(model_dir, monkeypatch, SPAN)
    runner = engine.runner
    small = [T for T in runner.buckets if T <= 8]  # the CPU's 1-token bucket and the 8-token one
    assert runner.short_tables == {T: SPAN // 8 for T in small}  # 4 pages wide
    assert len(runner._executables) == len(runner.buckets) + len(small)  # warm-up compiled the variants too
    widths = []
    assert _run(engine, prompts, 20, widths) == plain
    full = runner.max_pages_per_seq
    assert {w for _, pages, w in widths} == {SPAN // 8, full}  # both variants ran
    for T, pages, w in widths:
        assert w == (SPAN // 8 if pages <= SPAN // 8 and T <= 8 else full)


def test_the_mosaic_kernel_offers_its_short_path_to_decode_steps_that_split():
    assert paged_attention_mosaic.short_table_span(8, 8, 8) == split_kv.SHORT_SPAN  # batch-1 decode, 8 KV heads
    assert paged_attention_mosaic.short_table_span(64, 64, 8) == 0  # fills the GPU without work items
    assert paged_attention_mosaic.short_table_span(512, 4, 8) == 0  # prefill blocks never split
    assert not split_kv.use_work_items(8, 8, split_kv.SHORT_SPAN)
    assert split_kv.use_work_items(8, 8, split_kv.SHORT_SPAN + 16)
    assert dispatch.get_kernels("mosaic").short_table_span is paged_attention_mosaic.short_table_span
    assert dispatch.get_kernels("reference").short_table_span is None


@pytest.mark.extended
def test_a_draft_model_drafts_over_narrow_tables(model_dir, monkeypatch):
    """The draft model's first pass and chain run over the step's page table, narrow or not: with a draft
    identical to the target it still keeps (nearly) every draft, and the tokens are the target's. Extended
    (24 s on two cores): the narrow tables themselves are the default run's first test."""
    import jlight

    real = dispatch.get_kernels
    opts = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, page_size=8, num_pages=64, min_token_bucket=16,
                compilation_cache_dir=None)
    prompts = [[5, 6, 7, 8] * 3, [9, 10, 11] * 4, [12, 13] * 25]  # the last one crosses the narrow table while drafting
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in jlight.LLM(model_dir, **opts).generate(prompts, params, use_tqdm=False)]
    monkeypatch.setattr(dispatch, "get_kernels", lambda *a, **k: real(*a, **k)._replace(
        short_table_span=lambda T, B, kv_heads: 2 * SPAN if T <= 16 else 0))
    spec = jlight.LLM(model_dir, **opts, speculative_config={"method": "draft_model", "model": model_dir, "num_speculative_tokens": 3})
    assert spec.engine.runner.short_tables == {16: 2 * SPAN // 8}
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    stats = spec.engine.stats()
    assert got == want
    assert stats.spec_num_draft_tokens > 20 and stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens > 0.97
