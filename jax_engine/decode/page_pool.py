"""Paged KV cache bookkeeping with a prefix cache (DESIGN §4).

Page 0 is a reserved dummy that padded slots write to. Full pages are keyed by a hash chain of
their tokens; a page whose reference count drops to zero keeps its contents and waits in an LRU
list, so a later request with the same prefix reuses it without recomputation. Allocation takes
free pages first, then evicts the least recently used cached page (and any past their TTL).
"""
from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from typing import Optional, Sequence


def chain_hashes(tokens: Sequence[int], page_size: int, parent: bytes = b"") -> list[bytes]:
    """Hash of each full page, chained so a page's key depends on everything before it."""
    out = []
    h = parent
    for i in range(len(tokens) // page_size):
        page = tokens[i * page_size:(i + 1) * page_size]
        h = hashlib.blake2b(h + b"|" + ",".join(map(str, page)).encode(), digest_size=16).digest()
        out.append(h)
    return out


class PagePool:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_cache: bool = True, ttl_s: float = 0.0):
        if num_pages < 2:
            raise ValueError("need at least 2 pages (page 0 is reserved)")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_cache = enable_prefix_cache
        self.ttl_s = ttl_s
        self._free: list[int] = list(range(num_pages - 1, 0, -1))
        self._ref = [0] * num_pages
        self._hash_of: dict[int, bytes] = {}
        self._page_of: dict[bytes, int] = {}
        self._lru: "OrderedDict[int, float]" = OrderedDict()  # evictable cached pages -> last use
        self.hit_tokens = 0
        self.miss_tokens = 0

    # ------------------------------------------------------------------ counts
    @property
    def usable(self) -> int:
        return self.num_pages - 1

    def num_free(self) -> int:
        """Pages obtainable now (free plus evictable cached)."""
        return len(self._free) + len(self._lru)

    def num_used(self) -> int:
        return self.usable - self.num_free()

    # ------------------------------------------------------------------ alloc
    def allocate(self) -> Optional[int]:
        self._expire()
        if self._free:
            p = self._free.pop()
        elif self._lru:
            p, _ = self._lru.popitem(last=False)
            self._forget(p)
        else:
            return None
        self._ref[p] = 1
        return p

    def allocate_many(self, n: int) -> Optional[list[int]]:
        if n > self.num_free():
            return None
        return [self.allocate() for _ in range(n)]  # type: ignore[misc]

    def incref(self, p: int) -> None:
        if self._ref[p] == 0:
            self._lru.pop(p, None)
        self._ref[p] += 1

    def release(self, pages: Sequence[int]) -> None:
        for p in pages:
            self._ref[p] -= 1
            assert self._ref[p] >= 0, f"page {p} released twice"
            if self._ref[p] == 0:
                if p in self._hash_of and self.enable_prefix_cache:
                    self._lru[p] = time.monotonic()
                else:
                    self._forget(p)
                    self._free.append(p)

    # ------------------------------------------------------------------ prefix cache
    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """Longest run of cached pages for these chained hashes; each returned page is incref'd."""
        if not self.enable_prefix_cache:
            return []
        self._expire()
        pages = []
        for h in hashes:
            p = self._page_of.get(h)
            if p is None:
                break
            self.incref(p)
            pages.append(p)
        return pages

    def register(self, page: int, h: bytes) -> None:
        """Record that `page` holds the full page with chained hash `h`."""
        if not self.enable_prefix_cache or h in self._page_of or page in self._hash_of:
            return
        self._page_of[h] = page
        self._hash_of[page] = h

    def _forget(self, p: int) -> None:
        h = self._hash_of.pop(p, None)
        if h is not None and self._page_of.get(h) == p:
            del self._page_of[h]

    def _expire(self) -> None:
        if self.ttl_s <= 0 or not self._lru:
            return
        now = time.monotonic()
        while self._lru:
            p, t = next(iter(self._lru.items()))
            if now - t < self.ttl_s:
                break
            self._lru.popitem(last=False)
            self._forget(p)
            self._free.append(p)
