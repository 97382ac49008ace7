"""Gemma 2 and Gemma 3 (text) against transformers on tiny random-weight models (float32).

Gemma 2: alternating local (8-token window) / global layers, attention and final logit
soft-capping, query_pre_attn_scalar, (1 + w) norms four per layer, scaled tied embeddings.
Gemma 3: 5 local : 1 global, local layers on their own RoPE base, linear-scaled global RoPE,
qk-norm. Logits within 1e-4 and 32 greedy tokens identical, through a lax.scan over the mixed
layers (traced kinds) and unrolled (each layer's kind static), and through the engine.
"""
import pytest

from families_common import check_direct, check_engine, hf_model
from jlight.core.config import ModelConfig
from jlight.core.errors import UnsupportedModelError
from jlight.loading import load_model
from jlight.models import get_model_family

ARCHS = ["Gemma2ForCausalLM", "Gemma3ForCausalLM"]


@pytest.fixture(scope="module")
def models(tiny_model):
    return {arch: (tiny_model(arch), hf_model(tiny_model(arch), arch)) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_matches_transformers(models, arch):
    path, hf = models[arch]
    loaded = load_model(path, dtype="float32")
    check_direct(loaded.params, loaded.config, hf)
    if arch == "Gemma3ForCausalLM":  # unrolled: each layer's kind static, as on the GPU (one family suffices)
        check_direct(get_model_family(loaded.config).unstack_layers(loaded.params), loaded.config, hf)


@pytest.mark.parametrize("layer_loop", ["auto", "scan"])
def test_engine_matches_transformers(models, layer_loop):
    """The windowed pool: Gemma 3's six layers make six KV groups of one layer (one global, five local), so
    48 pages are a third of the memory of the every-page pool's 24 six-layer pages, still small enough to
    preempt. A scanned stack of the mixed layers finds each layer's group by its traced index."""
    check_engine(*models["Gemma3ForCausalLM"], num_pages=48, layer_loop=layer_loop)


@pytest.fixture(scope="module")
def pools(models):
    """Gemma 3 engines with the windowed pool (False) and the every-page pool (True), 16-token steps."""
    import jlight

    return {disable: jlight.LLM(models["Gemma3ForCausalLM"][0], dtype="float32", max_num_batched_tokens=16,
                                min_token_bucket=16, max_num_seqs=4, page_size=8, num_pages=64,
                                compilation_cache_dir=None, warmup=False, disable_hybrid_kv_cache_manager=disable)
            for disable in (False, True)}


def test_windowed_pool_logprobs_match_every_page_pool_and_transformers(models, pools):
    """Logprobs of 24 greedy tokens through the engine (16-token steps over 8-token windows, a shared
    prefix from the prefix cache): the windowed pool's equal the every-page pool's, and transformers'
    log-softmax at the same positions within 1e-4."""
    import numpy as np
    import torch

    from jlight import SamplingParams

    hf = models["Gemma3ForCausalLM"][1]
    rng = np.random.default_rng(3)
    prefix = [int(t) for t in rng.integers(3, 500, 24)]
    prompts = [prefix + [9, 8, 7], prefix + [5, 4], [int(t) for t in rng.integers(3, 500, 37)]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
    runs = {}
    for disable, llm in pools.items():
        first = llm.generate(prompts[:1], params, use_tqdm=False)
        runs[disable] = first + llm.generate(prompts[1:], params, use_tqdm=False)
        assert (llm.engine.kv_pages is None) == disable
    assert runs[False][1].num_cached_tokens >= 16, "the windowed pool did not serve the shared prefix"
    for prompt, ours, theirs in zip(prompts, runs[False], runs[True]):
        ids = ours.outputs[0].token_ids
        assert ids == theirs.outputs[0].token_ids
        lp = np.array([d[t] for d, t in zip(ours.outputs[0].logprobs, ids)])
        lp_every = np.array([d[t] for d, t in zip(theirs.outputs[0].logprobs, ids)])
        np.testing.assert_allclose(lp, lp_every, atol=1e-5)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].double()
        ref = torch.log_softmax(logits, -1)[torch.arange(len(ids)), torch.tensor(ids)].numpy()
        np.testing.assert_allclose(lp, ref, atol=1e-4)


def test_windowed_pool_samples_n_alike(pools):
    """n = 3 seeded samples of one prompt (the later ones share the first one's prompt pages through the
    prefix cache, a window group's only near the prompt's end): the same tokens as the every-page pool's."""
    from jlight import SamplingParams

    params = SamplingParams(n=3, max_tokens=20, temperature=1.0, seed=5, ignore_eos=True)
    prompt = list(range(40, 73))  # its own tokens: no other test's prefix
    outs = {}
    for disable, llm in pools.items():
        hits = llm.engine.stats().prefix_cache_hit_tokens
        outs[disable] = [c.token_ids for c in llm.generate([prompt], params, use_tqdm=False)[0].outputs]
        assert llm.engine.block_manager.num_used_pages == 0
        # the two later samples each take the prompt's 4 full pages (32 tokens) from the first one's
        assert llm.engine.stats().prefix_cache_hit_tokens - hits == 2 * 32, "the samples did not share the prompt's pages"
    assert outs[False] == outs[True] and len({tuple(t) for t in outs[False]}) == 3


def test_long_sequence_holds_only_its_window_pages(tiny_model):
    """A 16-token window over pages of 4: while a long sequence decodes, each local group's table holds
    the pages of its window only (ceil(16 / 4) + 1 at most; the earlier entries null) while the global
    group's grows with it; the block manager's count of used pages is exactly those; and a second
    request runs beside it in a pool that the long one alone would overflow without giving pages back."""
    import jlight
    from jlight import SamplingParams
    from jlight.core.kv_layout import NULL_PAGE

    path = tiny_model("Gemma3ForCausalLM", sliding_window=16)
    llm = jlight.LLM(path, dtype="float32", max_num_batched_tokens=16, min_token_bucket=16, max_num_seqs=2,
                     page_size=4, num_pages=90, compilation_cache_dir=None, warmup=False)
    engine, bm = llm.engine, llm.engine.block_manager
    assert engine.kv_layout.windows == (None,) + (16,) * 5
    engine.add_request("long", None, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=120),
                       prompt_token_ids=list(range(3, 27)))
    seq = engine.requests["long"].seqs[0]
    checked = 0
    while seq.num_computed_tokens < 100:
        engine.step()
        start = seq.num_computed_tokens - 1  # a decode step computed this position
        if not seq.prefill_done or seq.num_computed_tokens <= 40:
            continue
        first_seen = (start - 16 + 1) // 4
        for table in seq.group_pages:
            assert table[:first_seen] == [NULL_PAGE] * first_seen and NULL_PAGE not in table[first_seen:]
            assert len(table) - first_seen <= 16 // 4 + 1
        assert NULL_PAGE not in seq.pages and len(seq.pages) == -(-seq.num_computed_tokens // 4)
        held = len(seq.pages) + sum(len(t) - first_seen for t in seq.group_pages)
        assert bm.num_used_pages == held
        checked += 1
    assert checked > 50
    assert 6 * len(seq.pages) > bm.num_pages - 1, "keeping every page, the long sequence alone would not fit"
    engine.add_request("short", None, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=12),
                       prompt_token_ids=list(range(40, 52)))
    finished, side_by_side = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        running = [s for s in engine.scheduler.running if s.pages]
        side_by_side += len(running) == 2
    assert side_by_side > 5 and engine.stats().num_preemptions == 0 and bm.num_used_pages == 0
    assert len(finished["short"].outputs[0].token_ids) == 12 and len(finished["long"].outputs[0].token_ids) == 120


def _gemma3_config(**fields) -> dict:
    return dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=32, hidden_size=16,
                intermediate_size=16, num_hidden_layers=6, num_attention_heads=2, head_dim=8, **fields)


def test_older_gemma3_config_form():
    """transformers 4.x configs: rope_theta + rope_local_base_freq + sliding_window_pattern, no layer_types."""
    from jlight.models import attention_kinds

    cfg = ModelConfig.from_hf_dict(_gemma3_config(rope_theta=1e6, rope_local_base_freq=1e4, sliding_window=4,
                                                  sliding_window_pattern=6, rope_scaling={"rope_type": "linear", "factor": 8.0}))
    kinds = attention_kinds.layer_kinds(cfg)
    assert [k.sliding_window for k in kinds] == [4] * 5 + [None]
    assert [k.rope for k in kinds] == [1] * 5 + [0]
    tables = attention_kinds.rope_tables(cfg)
    assert tables[0].inv_freq[0] == pytest.approx(1 / 8) and tables[1].inv_freq[1] == pytest.approx(1e4 ** -0.25)


@pytest.mark.parametrize("arch", ARCHS)
def test_config_survives_convert_round_trip(models, arch):
    """jlight convert writes the family's fields back under their HF names."""
    from jlight.convert import model_config_to_hf_dict

    config = load_model(models[arch][0], dtype="float32").config
    assert ModelConfig.from_hf_dict(model_config_to_hf_dict(config)) == config


@pytest.mark.parametrize("arch, missing", [
    ("Gemma3ForConditionalGeneration", "vision tower"),
    ("Gemma3nForConditionalGeneration", "AltUp"),
    ("Gemma3nForCausalLM", "per-layer embeddings"),
])
def test_unsupported_variants_name_what_is_missing(arch, missing):
    with pytest.raises(UnsupportedModelError, match=missing):
        ModelConfig.from_hf_dict(dict(_gemma3_config(), architectures=[arch]))


def test_bidirectional_gemma3_is_refused():
    with pytest.raises(UnsupportedModelError, match="use_bidirectional_attention"):
        ModelConfig.from_hf_dict(_gemma3_config(use_bidirectional_attention=True))
