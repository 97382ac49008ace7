"""Page tables per KV group: a sliding-window group keeps only the pages its window can still see.

A model whose layers differ in attention kind has its pool laid out by jlight/core/kv_layout.py:
groups of layers of one kind, one page table per group and sequence (`seq.pages` is group 0's,
`seq.group_pages` the others'). `KVGroupPages` keeps those tables over one `BlockManager`: every
group takes its page ids from the same pool (one page id is `num_slots` layers of memory whatever
the group holds it), so the mix of groups follows the running sequences instead of a split fixed at
start-up. (Per-group pools would have to guess the split: at 32k tokens Gemma 3's local groups need
65 pages to the global group's 2,048, but a batch of short prompts needs as many in every group.)

Invariants:
  * every table of a sequence has the same length: pages_needed(tokens allocated so far);
  * in a group of window w, an entry is `NULL_PAGE` (the scratch page) exactly when its page lies
    wholly before position (start - w + 1), `start` being the oldest token a step scheduled for the
    sequence computes (its first query): no query of that step or a later one sees it. Those entries
    are a leading run of the table; a full-attention group has none. A decoding sequence therefore
    holds at most ceil(w / page_size) + 1 pages in a window group; a prefill chunk of n tokens, up to
    ceil((w - 1 + n) / page_size) + 1 while it runs;
  * a page given back out of a window is first published to the prefix cache (when it is on), so it
    stays cached and evictable, like any page of a finished sequence;
  * group g's pages are cached under the prefix key + `tag(g)` (group 0: the key itself), so a key
    names one page per group and a model with one group caches exactly as without groups;
  * a prefix hit of L pages holds in every full-attention group all pages [0, L) and in every window
    group the pages covering the window of position L * page_size (vLLM's rule), their earlier
    entries null; L is the longest prefix for which both hold;
  * releasing a sequence (finish, abort, preemption) drops one reference on every non-null entry of
    every table.
The scheduler counts each group's needs against the shared free count; admission needs the pages
of every group for the first chunk.
"""
from __future__ import annotations

from jlight.core.kv_layout import NULL_PAGE, group_layers
from jlight.engine.block_manager import BlockManager


def tag(group: int) -> bytes:
    """What group g's prefix keys carry after the page's key."""
    return bytes([group]) if group else b""


class PrefixHit:
    """A prefix-cache hit over every group: num_pages pages of each table, their keys."""

    def __init__(self, tables: list[list[int]], keys: list[bytes]):
        self.tables, self.keys = tables, keys

    @property
    def num_pages(self) -> int:
        return len(self.keys)

    def pages(self) -> list[int]:
        return [p for table in self.tables for p in table if p != NULL_PAGE]


class KVGroupPages:
    def __init__(self, block_manager: BlockManager, windows: tuple):
        """windows: each group's sliding window (None: full attention), from kv_layout.KVGroups."""
        self.bm = block_manager
        self.page_size = block_manager.page_size
        self.windows = tuple(windows)
        self.num_groups = len(self.windows)
        self.full = [g for g, w in enumerate(self.windows) if w is None]
        self.windowed = [(g, w) for g, w in enumerate(self.windows) if w is not None]
        self.tags = [tag(g) for g in range(self.num_groups)]

    def tables(self, seq) -> list[list[int]]:
        return [seq.pages, *seq.group_pages]

    # ---- a running sequence -------------------------------------------------------------
    def free_skipped(self, seq, start: int) -> None:
        """Give back, in every window group, the pages wholly before the window of position `start`."""
        tables = self.tables(seq)
        for g, w in self.windowed:
            table = tables[g]
            end = min(max(0, start - w + 1) // self.page_size, len(table))
            if end == 0 or table[end - 1] == NULL_PAGE:
                continue
            self._publish(seq, end)  # their tokens are computed and known: they stay cached, evictable
            self.bm.release(seq.drop_window_pages(g, end))

    def ensure_pages(self, seq, start: int, upto_tokens: int) -> bool:
        """Pages in every group for tokens up to upto_tokens, after giving back what the window of `start`
        no longer sees. False (nothing allocated) if the pool lacks them."""
        self.free_skipped(seq, start)
        grow = self.bm.pages_needed(upto_tokens) - len(seq.pages)
        if grow <= 0:
            return True
        if self.bm.num_free_pages < grow * self.num_groups:
            return False
        seq.add_pages(self.bm.allocate(grow), [self.bm.allocate(grow) for _ in self.windows[1:]])
        return True

    def release(self, seq) -> None:
        """Drop one reference on every page of the sequence's tables (it forgets them next: preempt, finish)."""
        for table in self.tables(seq):
            self.bm.release([p for p in table if p != NULL_PAGE])

    def publish(self, seq, num_full: int) -> None:
        """Key and publish every group's pages up to num_full (full, computed, their tokens known)."""
        self._publish(seq, min(num_full, len(seq.pages)))

    def _publish(self, seq, num_pages: int) -> None:
        bm = self.bm
        if not bm.enable_prefix_caching:
            return
        tables, first = self.tables(seq), len(seq.page_keys)
        keys = list(bm.page_keys(seq.token_slice, num_pages, seq.page_keys))
        for i, key in enumerate(keys, first):
            for g, table in enumerate(tables):
                if table[i] != NULL_PAGE:
                    bm.register_full_page(table[i], key + self.tags[g])
        seq.add_page_keys(keys)

    # ---- admission ------------------------------------------------------------------------
    def match_prefix(self, tokens: list[int]) -> PrefixHit:
        """The longest prefix of full pages (leaving a token to compute) that every group holds (the
        invariants' rule), without taking references."""
        bm, ps = self.bm, self.page_size
        keys: list[bytes] = []
        if not bm.enable_prefix_caching:
            return PrefixHit([[] for _ in self.windows], keys)
        cached = bm.cached
        for key in bm.page_keys(lambda a, b: tokens[a:b], (len(tokens) - 1) // ps):
            if any(key + self.tags[g] not in cached for g in self.full):  # as far as every full-attention group holds the chain
                break
            keys.append(key)
        n = len(keys)
        while True:  # each window group may shorten the hit; repeat until all agree
            before = n
            for g, w in self.windowed:
                n = self._window_hit(keys, self.tags[g], w, n)
            if n == before:
                break
        tables = []
        for g, w in enumerate(self.windows):
            first = 0 if w is None else self._first_seen(n, w)
            tables.append([NULL_PAGE] * first + [cached[keys[i] + self.tags[g]] for i in range(first, n)])
        return PrefixHit(tables, keys[:n])

    def _first_seen(self, num_pages: int, window: int) -> int:
        """The first page the window of position num_pages * page_size sees."""
        return max(0, num_pages * self.page_size - window + 1) // self.page_size

    def _window_hit(self, keys: list[bytes], group_tag: bytes, window: int, n: int) -> int:
        """The largest m <= n whose window pages [first_seen(m), m) this group holds under keys."""
        cached = self.bm.cached
        i = n - 1
        while n > 0:
            first = self._first_seen(n, window)
            while i >= first and keys[i] + group_tag in cached:
                i -= 1
            if i < first:
                return n
            n = i  # page i is missing: no hit may need it
            i = n - 1
        return 0

    def can_admit(self, hit: PrefixHit, upto_tokens: int) -> bool:
        grow = self.bm.pages_needed(upto_tokens) - hit.num_pages
        return self.bm.can_allocate(grow * self.num_groups, hit.pages())

    def admit(self, seq, hit: PrefixHit, upto_tokens: int) -> None:
        """Give seq the hit's pages (one reference each) and fresh ones up to upto_tokens in every group."""
        self.bm.acquire(hit.pages(), count=False)
        self.bm.device_hit_pages += hit.num_pages  # counted in tokens of the prompt, not pages of every group
        grow = self.bm.pages_needed(upto_tokens) - hit.num_pages
        tables = [table + self.bm.allocate(grow) for table in hit.tables]
        seq.admit(tables[0], hit.num_pages * self.page_size, hit.keys, group_pages=tables[1:])



def pages_per_sequence(windows, page_size: int, num_tokens: int, chunk: int = 1) -> int:
    """Page ids a sequence of num_tokens holds at most in groups of these windows, computing up to `chunk`
    tokens a step (1: decoding; a prefill chunk's queries need its own tokens' pages too)."""
    full = -(-num_tokens // page_size)
    return sum(full if w is None else min(full, -(-(w - 1 + chunk) // page_size) + 1) for w in windows)


def layout_for(family, config, by_kind: bool = True):
    """The pool's kv_layout.KVGroups: by attention kind for families that declare their layers' windows
    (`kv_layer_windows`), else (or with by_kind False) one group of every layer keeping every page."""
    windows_fn = getattr(family, "kv_layer_windows", None)
    windows = windows_fn(config) if windows_fn is not None else (None,) * config.num_layers
    return group_layers(windows, by_kind=by_kind and windows_fn is not None)


def pool_shapes(family, config, num_pages: int, page_size: int, layout) -> tuple[tuple, tuple]:
    """The K and V pool shapes: the family's, their layer axis cut to the layout's slots when it has groups."""
    k_shape, v_shape = family.kv_cache_shapes(config, num_pages, page_size)
    if layout.num_groups == 1:
        return k_shape, v_shape
    return (layout.num_slots,) + tuple(k_shape[1:]), (layout.num_slots,) + tuple(v_shape[1:])


def engine_layout(family, config, engine_config):
    """The layout an engine's pool takes: by kind unless disable_hybrid_kv_cache_manager or a host tier
    (which moves one table of pages) says otherwise."""
    by_kind = not (engine_config.disable_hybrid_kv_cache_manager or engine_config.kv_offloading_size)
    return layout_for(family, config, by_kind)


def keeps_window(layout) -> bool:
    """Whether a layout needs KVGroupPages: several groups, or one group with a sliding window."""
    return layout.num_groups > 1 or layout.windows[0] is not None
