"""The paged KV cache's bookkeeping (jax_engine/decode/page_pool.py): page 0 reserved, reference
counts, prefix reuse keyed by chained page hashes, LRU eviction of cached pages, TTL. No model."""
from __future__ import annotations

import time

import pytest

from jax_engine.decode.page_pool import PagePool, chain_hashes


def test_page_zero_is_reserved_and_counts_add_up():
    with pytest.raises(ValueError):
        PagePool(1, 4)
    pool = PagePool(5, 4)
    assert (pool.usable, pool.num_free(), pool.num_used()) == (4, 4, 0)
    pages = pool.allocate_many(4)
    assert sorted(pages) == [1, 2, 3, 4] and 0 not in pages
    assert (pool.num_free(), pool.num_used()) == (0, 4)
    assert pool.allocate() is None and pool.allocate_many(1) is None
    pool.release(pages)
    assert (pool.num_free(), pool.num_used()) == (4, 0)
    assert pool.allocate_many(5) is None and pool.num_free() == 4   # all or nothing


def test_refcounts_keep_a_shared_page_until_the_last_release():
    pool = PagePool(4, 4, enable_prefix_cache=False)
    p = pool.allocate()
    pool.incref(p)                      # a second sequence shares it (n > 1 fork)
    pool.release([p])
    assert pool.num_used() == 1         # still held by the other one
    pool.release([p])
    assert pool.num_used() == 0
    with pytest.raises(AssertionError, match="released twice"):
        pool.release([p])


def test_chain_hashes_depend_on_every_earlier_token_and_skip_the_partial_page():
    a = chain_hashes(list(range(10)), 4)
    assert len(a) == 2                                      # 10 tokens: 2 full pages of 4
    b = chain_hashes(list(range(8)) + [99, 98], 4)
    assert b == a                                           # the partial third page is not hashed
    c = chain_hashes([0, 1, 2, 77] + list(range(4, 8)), 4)
    assert c[0] != a[0] and c[1] != a[1]                    # same second page, different history
    assert chain_hashes(list(range(4, 8)), 4, parent=a[0]) == [a[1]]


def test_prefix_reuse_by_chained_hash():
    pool = PagePool(8, 4)
    toks = list(range(12))
    hashes = chain_hashes(toks, 4)
    pages = pool.allocate_many(3)
    for p, h in zip(pages, hashes):
        pool.register(p, h)
    pool.release(pages)
    assert pool.num_used() == 0 and pool.num_free() == 7    # cached pages stay obtainable
    # a request sharing the first two pages gets exactly those, in order, each incref'd
    other = chain_hashes(toks[:8] + [50, 51, 52, 53], 4)
    got = pool.match(other)
    assert got == pages[:2] and pool.num_used() == 2
    pool.release(got)
    # a different first page matches nothing, even though the second page's tokens are equal
    assert pool.match(chain_hashes([9, 9, 9, 9] + toks[4:8], 4)) == []
    # registering again (same hash or same page) changes nothing
    pool.register(pages[0], hashes[1])
    assert pool.match(hashes[:1]) == pages[:1]


def test_without_the_prefix_cache_nothing_matches_and_pages_go_straight_back():
    pool = PagePool(4, 4, enable_prefix_cache=False)
    p = pool.allocate()
    h = chain_hashes([1, 2, 3, 4], 4)
    pool.register(p, h[0])
    pool.release([p])
    assert pool.match(h) == [] and pool.num_used() == 0


def test_allocation_takes_free_pages_first_then_evicts_the_least_recently_used():
    pool = PagePool(4, 4)                       # 3 usable pages
    hs = [chain_hashes([k] * 4, 4)[0] for k in range(3)]
    pages = pool.allocate_many(3)
    for p, h in zip(pages, hs):
        pool.register(p, h)
    pool.release([pages[1]])                    # released in the order 1, 0, 2: LRU order
    pool.release([pages[0]])
    pool.release([pages[2]])
    assert pool.num_free() == 3 and pool.num_used() == 0
    got = pool.allocate()
    assert got == pages[1]                      # the least recently used cached page is evicted
    assert pool.match([hs[1]]) == []            # and forgotten: its hash no longer matches
    assert pool.match([hs[0]]) == [pages[0]]    # the others still do (match refreshes nothing else)
    pool.release([pages[0]])                    # now pages[2] is the oldest
    assert pool.allocate() == pages[2]
    assert pool.match([hs[2]]) == []


def test_cached_pages_past_their_ttl_are_freed():
    pool = PagePool(4, 4, ttl_s=0.05)
    p = pool.allocate()
    h = chain_hashes([5, 6, 7, 8], 4)
    pool.register(p, h[0])
    pool.release([p])
    assert pool.match(h) == [p]
    pool.release([p])
    time.sleep(0.1)
    assert pool.match(h) == [] and pool.num_free() == 3 and pool.num_used() == 0
