"""Page (block) allocation for the paged KV cache, with reference counts and a prefix cache.

Page 0 is never handed out: it is the scratch page that padding tokens write to.

Prefix caching: a page that is full is keyed by a hash chained over all tokens up to its
end, so equal keys mean equal prefixes. A new sequence reuses the pages of its longest
cached prefix. Pages whose reference count drops to zero keep their key and sit in an LRU
list; they are reused by a later match or evicted (least recently used first) when the free
list runs dry.
"""
from __future__ import annotations

import collections
import hashlib
import struct


def page_hash(parent: bytes, tokens) -> bytes:
    """Key of a full page: a digest of the parent page's key and this page's tokens."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(struct.pack(f"<{len(tokens)}i", *tokens))
    return h.digest()


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
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

    # ---- allocation ------------------------------------------------------------------------
    def _take_page(self) -> int:
        if self.free_pages:
            page = self.free_pages.popleft()
        else:
            page, _ = self.evictable.popitem(last=False)
            del self.cached[self.page_key[page]]
            self.page_key[page] = None
        self.ref_count[page] = 1
        return page

    def match_prefix(self, tokens: list[int]) -> tuple[list[int], list[bytes]]:
        """Longest cached prefix of full pages, leaving at least one token to compute.

        Returns (pages, keys) without taking references.
        """
        pages, keys, parent = [], [], b""
        if not self.enable_prefix_caching:
            return pages, keys
        max_pages = (len(tokens) - 1) // self.page_size
        for i in range(max_pages):
            key = page_hash(parent, tokens[i * self.page_size:(i + 1) * self.page_size])
            page = self.cached.get(key)
            if page is None:
                break
            pages.append(page)
            keys.append(key)
            parent = key
        return pages, keys

    def can_allocate(self, num_new_pages: int, reused_pages: list[int] = ()) -> bool:
        # Reused pages that sit in the evictable list stop being free once taken.
        reclaimed = sum(1 for p in reused_pages if self.ref_count[p] == 0)
        return self.num_free_pages - reclaimed >= num_new_pages

    def acquire(self, pages: list[int]) -> None:
        """Take a reference on already-cached pages (a prefix-cache hit)."""
        for p in pages:
            if self.ref_count[p] == 0:
                self.evictable.pop(p, None)
            self.ref_count[p] += 1

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free_pages:
            raise RuntimeError(f"out of KV pages: asked for {n}, {self.num_free_pages} free")
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
