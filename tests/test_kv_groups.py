"""The KV pool grouped by attention kind (jlight/core/kv_layout.py, jlight/engine/kv_groups.py): the layout
rule, the page tables' invariants over one BlockManager, the prefix-cache rule for window groups."""
import pytest

from jlight.core.kv_layout import NULL_PAGE, group_layers
from jlight.engine.block_manager import BlockManager
from jlight.engine.kv_groups import KVGroupPages, pages_per_sequence, tag
from jlight.engine.sampling_params import SamplingParams
from jlight.engine.sequence import Sequence

PS, W = 4, 8  # page size, window: a window group holds at most ceil(8 / 4) + 1 = 3 pages while decoding


def test_layout_groups_layers_by_kind():
    gemma3_12b = tuple(None if (i + 1) % 6 == 0 else 1024 for i in range(48))  # 5 local : 1 global
    g = group_layers(gemma3_12b)
    assert g.windows == (None,) + (1024,) * 5 and g.num_slots == 8
    assert g.layers[0] == tuple(range(5, 48, 6))
    assert sorted(sum(g.layers[1:], ())) == [i for i in range(48) if (i + 1) % 6]
    for layer in range(48):  # each layer's (group, slot) names it back
        assert g.layers[g.group_of[layer]][g.slot_of[layer]] == layer
    gpt_oss = group_layers(tuple(128 if i % 2 == 0 else None for i in range(24)))
    assert gpt_oss.windows == (None, 128) and gpt_oss.num_slots == 12
    uneven = group_layers((8, 8, 8, None, 8))  # 4 local : 1 global: four groups of one
    assert uneven.windows == (None, 8, 8, 8, 8) and uneven.num_slots == 1
    one = group_layers((None,) * 4)
    assert one.num_groups == 1 and one.slot_of == (0, 1, 2, 3)  # slot = layer: the pool without kinds
    flat = group_layers(gemma3_12b, by_kind=False)
    assert flat.windows == (None,) and flat.num_slots == 48


def _seq(tokens):
    return Sequence("r", 0, list(tokens), SamplingParams(), 0, 0.0)


def _pages(windows=(None, W), num_pages=64, prefix_caching=True):
    return KVGroupPages(BlockManager(num_pages, PS, prefix_caching), windows)


def _run(kv, seq, upto, start):
    assert kv.ensure_pages(seq, start, upto)
    seq.num_computed_tokens = upto


def _used(kv):
    return kv.bm.num_used_pages


def test_window_group_gives_pages_back_and_counts_stay_exact():
    kv = _pages()
    seq = _seq(range(100, 140))  # 40 tokens
    kv.admit(seq, kv.match_prefix([]), 16)
    assert len(seq.pages) == len(seq.group_pages[0]) == 4 and _used(kv) == 8
    seq.num_computed_tokens = 16
    for start in range(16, 40):  # one token a step
        free_before = kv.bm.num_free_pages
        _run(kv, seq, start + 1, start)
        window = seq.group_pages[0]
        first_seen = max(0, start - W + 1) // PS
        assert window[:first_seen] == [NULL_PAGE] * first_seen and NULL_PAGE not in window[first_seen:]
        assert NULL_PAGE not in seq.pages and len(seq.pages) == len(window) == -(-(start + 1) // PS)
        assert len(window) - first_seen <= -(-W // PS) + 1
        assert _used(kv) == len(seq.pages) + len(window) - first_seen
        assert kv.bm.num_free_pages <= free_before + 1  # at most one page leaves the window a step
    kv.release(seq)
    assert _used(kv) == 0 and all(c == 0 for c in kv.bm.ref_count)  # nulls were not released


def test_freed_window_pages_serve_another_sequence():
    kv = _pages(num_pages=12)  # 11 usable pages
    a = _seq(range(100, 132))
    kv.admit(a, kv.match_prefix([]), 4)
    a.num_computed_tokens = 4
    for start in range(4, 27):  # decoding up to 27 tokens: 7 pages, position 26 sees pages 4..6
        _run(kv, a, start + 1, start)
    assert _used(kv) == 7 + 3 and kv.bm.num_free_pages == 1
    b = _seq(range(200, 204))
    assert not kv.can_admit(kv.match_prefix(b.all_token_ids), 4)  # one page for each of its two groups
    _run(kv, a, 28, 27)  # position 27 sees from 20: page 4 goes back, no page is added
    assert _used(kv) == 7 + 2
    hit = kv.match_prefix(b.all_token_ids)
    assert kv.can_admit(hit, 4)
    kv.admit(b, hit, 4)
    assert _used(kv) == 11  # b took the page a gave back
    assert a.group_pages[0][4] == NULL_PAGE and b.pages[0] != NULL_PAGE


def test_prefix_hit_takes_only_the_window_pages_of_a_window_group():
    kv = _pages()
    prompt = list(range(100, 141))  # 41 tokens: 10 full pages before the last token
    a = _seq(prompt)
    kv.admit(a, kv.match_prefix([]), 41)
    a.num_computed_tokens = 41
    kv.publish(a, 10)
    _run(kv, a, 42, 41)  # a decode step: the window group gives back pages 0..7, published first
    assert a.group_pages[0][:8] == [NULL_PAGE] * 8
    kv.release(a)
    hit = kv.match_prefix(prompt)
    assert hit.num_pages == 10
    full, window = hit.tables
    assert NULL_PAGE not in full
    first_seen = (40 - W + 1) // PS  # position 40 sees from 33: pages 8 and 9
    assert window[:first_seen] == [NULL_PAGE] * first_seen and NULL_PAGE not in window[first_seen:]
    # Keys: group 0 untagged, the window group under its tag; the freed pages stayed cached too.
    assert all(kv.bm.cached[k] == p for k, p in zip(hit.keys, full))
    assert all(k + tag(1) in kv.bm.cached for k in hit.keys)
    b = _seq(prompt)
    kv.admit(b, hit, 41)
    assert kv.bm.ref_count[window[-1]] == 1 and kv.bm.ref_count[full[0]] == 1
    assert kv.bm.device_hit_pages == 10  # the prompt's pages, not every group's


def test_prefix_hit_shrinks_to_where_the_window_pages_are_cached():
    kv = _pages(num_pages=40)
    prompt = list(range(100, 141))
    a = _seq(prompt)
    kv.admit(a, kv.match_prefix([]), 41)
    a.num_computed_tokens = 41
    kv.publish(a, 10)
    _run(kv, a, 42, 41)  # window pages 0..7 back into the LRU, page 0 first
    kv.release(a)
    other = prompt[:20] + [7] * 21  # shares 5 pages; its window hit needs window pages 3 and 4
    assert kv.match_prefix(other).num_pages == 5
    taken = kv.bm.allocate(len(kv.bm.free_pages) + 3)  # evicts the LRU's three oldest: window pages 0, 1, 2
    assert kv.match_prefix(other).num_pages == 5  # pages 3 and 4 are all it needs
    kv.bm.release(taken)
    taken = kv.bm.allocate(len(kv.bm.free_pages) + 1)  # ... and now window page 3 too
    hit = kv.match_prefix(other)
    assert hit.num_pages == 0, "no hit length whose window pages are all cached"
    kv.bm.release(taken)
    assert kv.match_prefix(prompt).num_pages == 10  # the whole prompt's window pages (8, 9) are still there


def test_one_window_group_matches_from_the_right():
    """vLLM's example: pages of 4, a window of 8, a 4-page hit: [NULL, NULL, p, p]."""
    kv = _pages(windows=(W,))
    prompt = list(range(100, 117))
    a = _seq(prompt)
    kv.admit(a, kv.match_prefix([]), 17)
    a.num_computed_tokens = 17
    kv.publish(a, 4)
    kv.release(a)
    hit = kv.match_prefix(prompt)
    assert hit.num_pages == 4 and hit.tables[0][:2] == [NULL_PAGE] * 2 and NULL_PAGE not in hit.tables[0][2:]


def test_without_prefix_caching_nothing_is_keyed():
    kv = _pages(prefix_caching=False)
    a = _seq(range(100, 141))
    kv.admit(a, kv.match_prefix(a.all_token_ids), 41)
    a.num_computed_tokens = 41
    _run(kv, a, 42, 41)
    assert not kv.bm.cached and a.page_keys == []
    kv.release(a)
    assert kv.bm.num_free_pages == 63


@pytest.mark.parametrize("chunk, expected", [(1, 10 + 2 * 3), (16, 10 + 2 * 7)])
def test_pages_per_sequence(chunk, expected):
    assert pages_per_sequence((None, W, W), PS, 40, chunk) == expected


def test_gemma3_capacity_figure(monkeypatch):
    """benchmarks/hybrid_memory.py --model gemma3-12b (the BENCHMARKS figure): 6 groups of 8 layers, a page id
    8 layers x (K, V) x 16 tokens x 8 KV heads x 256 x bf16 = 1 MiB; a 32k sequence holds 2,048 global pages and
    ceil(1024 / 16) + 1 = 65 in each of 5 local groups, against 2,048 pages of all 48 layers."""
    import os
    import sys

    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import hybrid_memory

    windowed, chunked, every = hybrid_memory.main(["--model", "gemma3-12b", "--cache-gib", "64"])
    assert windowed["page_bytes"] == 8 * 2 * 16 * 8 * 256 * 2 == every["page_bytes"] // 6
    assert windowed["pages_per_sequence"] == 2048 + 5 * 65 and every["pages_per_sequence"] == 2048
    assert chunked["pages_per_sequence"] == 2048 + 5 * (-(-(1023 + 2048) // 16) + 1)
    for row in (windowed, chunked, every):
        assert row["concurrent_sequences"] == (64 * 2 ** 30 // row["page_bytes"] - 1) // row["pages_per_sequence"]
    assert windowed["concurrent_sequences"] > 5 * every["concurrent_sequences"]
    del sys.modules["hybrid_memory"]


def test_engine_layout_by_family():
    """One kind (Llama; a family that declares no windows, DeepSeek) takes no KVGroupPages and no group tables;
    a model whose layers all slide is one window group; Gemma 3 six groups, or one with the manager disabled."""
    from jlight.core.config import ModelConfig
    from jlight.engine.kv_groups import keeps_window, layout_for
    from jlight.models import get_model_family

    base = dict(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=6, num_attention_heads=2,
                num_key_value_heads=1, head_dim=8)
    llama = ModelConfig.from_hf_dict(dict(base, architectures=["LlamaForCausalLM"], model_type="llama"))
    mistral = ModelConfig.from_hf_dict(dict(base, architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=16))
    gemma3 = ModelConfig.from_hf_dict(dict(base, architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", sliding_window=8))
    one = layout_for(get_model_family(llama), llama)
    assert one.num_groups == 1 and not keeps_window(one)
    slides = layout_for(get_model_family(mistral), mistral)
    assert slides.windows == (16,) and keeps_window(slides)
    assert layout_for(get_model_family(gemma3), gemma3).windows == (None,) + (8,) * 5
    assert not keeps_window(layout_for(get_model_family(gemma3), gemma3, by_kind=False))
