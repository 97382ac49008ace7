"""The block manager keys and publishes a sequence's full pages itself (the chained page hash), and a
later sequence with the same prefix finds them."""
from jlight.engine.block_manager import BlockManager


def test_published_pages_serve_the_same_prefix_and_only_it():
    bm = BlockManager(num_pages=16, page_size=4)
    tokens = list(range(100, 114))  # three full pages and two tokens
    pages = bm.allocate(bm.pages_needed(len(tokens)))
    keys: list[bytes] = []
    keys += bm.publish_full_pages(pages, keys, lambda a, b: tokens[a:b], num_full=2)  # two pages computed so far
    assert len(keys) == 2
    keys += bm.publish_full_pages(pages, keys, lambda a, b: tokens[a:b], num_full=3)
    assert len(keys) == 3 and len(set(keys)) == 3
    matched, matched_keys = bm.match_prefix(tokens[:12] + [7, 7, 7])
    assert matched == pages[:3] and matched_keys == keys
    other = tokens[:4] + [0] + tokens[5:12]  # the second page differs: only the first page matches
    assert bm.match_prefix(other + [1])[0] == pages[:1]
    off = BlockManager(num_pages=16, page_size=4, enable_prefix_caching=False)
    off_keys: list[bytes] = []
    off_keys += off.publish_full_pages(off.allocate(4), off_keys, lambda a, b: tokens[a:b], num_full=3)
    assert off_keys == [] and off.match_prefix(tokens)[0] == []
