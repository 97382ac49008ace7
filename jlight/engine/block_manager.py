"""Page (block) allocation for the paged KV cache, with reference counts and a prefix cache.

Page 0 is never handed out: it is the scratch page that padding tokens write to (and the null entry of
a sliding-window group's table: kv_groups.py keeps the tables of a pool grouped by attention kind
over one BlockManager, each group's pages cached under its own tag of the prefix key).

Prefix caching: a page that is full is keyed by a hash chained over all tokens up to its
end, so equal keys mean equal prefixes. This module is the only one that computes keys (`page_keys`,
`prefix_key`): the KV groups and the state pool key their pages and snapshots through it. A new sequence reuses the pages of its longest
cached prefix. Pages whose reference count drops to zero keep their key and sit in an LRU
list; they are reused by a later match or evicted (least recently used first) when the free
list runs dry.

With a host tier (host_tier.py) an evicted page's K/V are offloaded instead of dropped, and a
prefix match that runs out of device pages goes on in the host tier: each further key the tier
holds gets a fresh device page, registered under the key at once (cached, unreferenced, most
recently used) while the tier copies its K/V back before the next step. A restore never takes a
page of the prefix being matched, and `acquire` counts the pages it takes by the tier they came from.
"""
from __future__ import annotations

import collections
import hashlib
import struct


def _page_hash(parent: bytes, tokens) -> bytes:
    """Key of a full page: a digest of the parent page's key and this page's tokens."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(struct.pack(f"<{len(tokens)}i", *tokens))
    return h.digest()


def prefix_key(tokens, num_pages: int, page_size: int) -> bytes:
    """The prefix key of page num_pages - 1 of `tokens` (b"" for none): the key that page is cached under."""
    key = b""
    for i in range(num_pages):
        key = _page_hash(key, tokens[i * page_size:(i + 1) * page_size])
    return key


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True, host_tier=None):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages} is too small: need at least 2 (page 0 is reserved)")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_pages
        self.page_key: list[bytes | None] = [None] * num_pages
        self.cached: dict[bytes, int] = {}  # key -> page id
        self.free_pages = collections.deque(range(1, num_pages))  # never cached or evicted
        self.evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached, ref 0, LRU order
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.host_tier = host_tier  # a HostTier, or None: evicted pages are dropped
        self.restored: set[int] = set()  # pages copied back from the host tier that no sequence has taken yet
        self.device_hit_pages = 0  # cached pages taken by admitted sequences, by the tier they came from
        self.host_hit_pages = 0

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return len(self.free_pages) + len(self.evictable)

    @property
    def num_used_pages(self) -> int:
        """Pages referenced by at least one sequence (excluding the scratch page)."""
        return self.num_pages - 1 - self.num_free_pages

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def page_keys(self, token_slice, num_pages: int, keys=()):
        """Yield the prefix keys of pages len(keys) .. num_pages - 1, chained on `keys` (those of the pages
        before); token_slice(start, end) gives the tokens. Lazy: a prefix match stops at its first miss."""
        ps, parent = self.page_size, keys[-1] if keys else b""
        for i in range(len(keys), num_pages):
            parent = _page_hash(parent, token_slice(i * ps, (i + 1) * ps))
            yield parent

    # ---- allocation ------------------------------------------------------------------------
    def _take_page(self) -> int:
        if self.free_pages:
            page = self.free_pages.popleft()
        else:
            page, _ = self.evictable.popitem(last=False)
            key = self.page_key[page]
            del self.cached[key]
            self.page_key[page] = None
            self.restored.discard(page)
            if self.host_tier is not None:
                self.host_tier.offload(page, key)
        self.ref_count[page] = 1
        return page

    def match_prefix(self, tokens: list[int]) -> tuple[list[int], list[bytes]]:
        """Longest cached prefix of full pages, leaving at least one token to compute.

        Returns (pages, keys) without taking references.
        """
        pages, keys = [], []
        if not self.enable_prefix_caching:
            return pages, keys
        for key in self.page_keys(lambda a, b: tokens[a:b], (len(tokens) - 1) // self.page_size):
            page = self.cached.get(key)
            if page is None and self.host_tier is not None and key in self.host_tier:
                page = self._restore(key, pages)
            if page is None:
                break
            pages.append(page)
            keys.append(key)
        return pages, keys

    def _restore(self, key: bytes, matched: list[int]) -> int | None:
        """A fresh page registered under `key`, its K/V to come back from the host tier; None if the only
        pages left to take are the matched prefix's own."""
        unreferenced = [p for p in matched if self.ref_count[p] == 0]
        if len(self.free_pages) + len(self.evictable) - len(unreferenced) < 1:
            return None
        for p in unreferenced:  # out of the LRU end, so _take_page evicts none of them
            self.evictable.move_to_end(p)
        page = self._take_page()
        self.ref_count[page] = 0
        self.page_key[page] = key
        self.cached[key] = page
        self.evictable[page] = None
        self.restored.add(page)
        self.host_tier.restore(key, page)
        return page

    def can_allocate(self, num_new_pages: int, reused_pages: list[int] = ()) -> bool:
        # Reused pages that sit in the evictable list stop being free once taken.
        reclaimed = sum(1 for p in reused_pages if self.ref_count[p] == 0)
        return self.num_free_pages - reclaimed >= num_new_pages

    def acquire(self, pages: list[int], count: bool = True) -> None:
        """Take a reference on already-cached pages (a prefix-cache hit); count: add them to the hit counters
        (kv_groups.py counts its hits itself: one page of each group holds the same tokens)."""
        for p in pages:
            if p in self.restored:
                self.restored.discard(p)
                self.host_hit_pages += count
            else:
                self.device_hit_pages += count
            if self.ref_count[p] == 0:
                self.evictable.pop(p, None)
            self.ref_count[p] += 1

    def hold(self, pages: list[int]) -> None:
        """One more reference on pages in use (a transfer reading them after their sequence ends)."""
        for p in pages:
            assert self.ref_count[p] > 0, f"page {p} is not in use"
            self.ref_count[p] += 1

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free_pages:
            raise RuntimeError(f"out of KV pages: asked for {n}, {self.num_free_pages} free")
        return [self._take_page() for _ in range(n)]

    def allocate_unused(self, n: int) -> list[int]:
        """n pages that neither a sequence nor the prefix cache holds, or [] when fewer are unused (a
        reservation that must not evict cached prefixes)."""
        if n > len(self.free_pages):
            return []
        return [self._take_page() for _ in range(n)]

    def release(self, pages: list[int]) -> None:
        """Drop one reference on each page; unreferenced pages become free (or evictable if cached)."""
        for p in reversed(pages):  # later pages first, so a prefix's head is evicted last
            self.ref_count[p] -= 1
            assert self.ref_count[p] >= 0, f"page {p} released twice"
            if self.ref_count[p] == 0:
                if self.page_key[p] is not None:
                    self.evictable[p] = None
                else:
                    self.free_pages.append(p)

    def publish_full_pages(self, pages: list[int], page_keys: list[bytes], token_slice, num_full: int) -> list[bytes]:
        """Key and publish a sequence's pages up to `num_full` (full, computed, tokens known on the host),
        past the len(page_keys) it has published; returns the new keys (the sequence appends them).
        token_slice(start, end) gives the sequence's tokens."""
        if not self.enable_prefix_caching:
            return []
        new = list(self.page_keys(token_slice, min(num_full, len(pages)), page_keys))
        for i, key in enumerate(new, len(page_keys)):
            self.register_full_page(pages[i], key)
        return new

    def register_full_page(self, page: int, key: bytes) -> None:
        """Publish a page whose tokens are all computed under its prefix key."""
        if not self.enable_prefix_caching or self.page_key[page] is not None:
            return
        if key in self.cached:  # an identical page already exists; keep the first one
            return
        self.page_key[page] = key
        self.cached[key] = page

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_query_tokens += num_tokens
        self.prefix_hit_tokens += num_hit_tokens

    def reset_prefix_cache(self) -> None:
        for p in list(self.evictable):
            self.cached.pop(self.page_key[p], None)
            self.page_key[p] = None
            self.free_pages.append(p)
        self.evictable.clear()
        self.restored.clear()
        if self.host_tier is not None:
            self.host_tier.clear()
