"""The prefix cache's radix tree and the allocator on top of it: matches in whole pages, splits
edges where sequences part, returns the pages it already holds, never evicts a locked path,
evicts least recently used leaves first, and keeps its counters right under random use."""

from __future__ import annotations

import random

import pytest

from scheduler_proc.kv_allocator import KVAllocator
from scheduler_proc.radix_cache import RadixCache


def test_matches_whole_pages_and_splits_where_sequences_part():
    cache = RadixCache(page_size=2)
    assert cache.insert([1, 2, 3, 4, 5, 6], [10, 11, 12]) == []
    assert cache.match_len([1, 2, 3, 4, 5, 6, 7]) == 6
    assert cache.match_len([1, 2, 3, 9]) == 2  # page [3, 9] differs
    assert cache.match_len([1, 2, 3]) == 2  # a partial page never matches
    # [1, 2, 3, 4] is cached under other pages: the tree keeps its own, hands these back.
    assert cache.insert([1, 2, 3, 4, 7, 8], [20, 21, 22]) == [20, 21]
    assert cache.num_pages == 4 and cache.num_nodes == 3  # [1..4] split above [5, 6] / [7, 8]
    pages, _ = cache.acquire([1, 2, 3, 4, 7, 8])
    assert pages == [10, 11, 22]
    cache.check()


def test_a_locked_path_is_never_evicted_and_eviction_takes_the_oldest_leaf_first():
    cache = RadixCache(page_size=1)
    cache.insert([1, 2, 3], [1, 2, 3])
    cache.insert([4, 5], [4, 5])
    cache.insert([6], [6])
    _, node = cache.acquire([1, 2])  # [1, 2] locked, its leaf [3] not
    assert cache.num_evictable_pages == 4
    _, touched = cache.acquire([4, 5])
    cache.release(touched)  # [4, 5] is now the most recently used
    assert cache.evict(1) == [3]  # [3] (inserted first) before [6]
    assert cache.evict(1) == [6]
    assert cache.evict(10) == [4, 5]  # one edge; [1, 2] stays: locked
    assert cache.num_pages == 2 and cache.num_evictable_pages == 0
    cache.release(node)
    assert sorted(cache.evict(10)) == [1, 2]
    cache.check()


def test_acquire_refuses_what_is_not_cached():
    cache = RadixCache(page_size=2)
    cache.insert([1, 2], [5])
    with pytest.raises(ValueError, match="not whole pages"):
        cache.acquire([1])
    with pytest.raises(ValueError, match="only 2 of 4"):
        cache.acquire([1, 2, 3, 4])


@pytest.mark.parametrize("page_size, lookahead", [(1, 0), (1, 1), (4, 1), (2, 3)])
def test_random_requests_share_pages_only_through_the_cache(page_size, lookahead):
    """Requests over a few shared prefixes come and go, some cached before their row is freed
    (`cache_row`: finished, a plan still holding them); a live row's pages are its cached prefix
    (the same pages the tree holds for those tokens) plus pages no one else holds, and when
    every row is gone every page is free or cached exactly once."""
    rng = random.Random(page_size * 10 + lookahead)
    alloc = KVAllocator(64, page_size, 6, prefix_cache=True, draft_lookahead=lookahead)
    stems = [[rng.randrange(50) for _ in range(rng.randrange(4, 20))] for _ in range(4)]
    live: dict[int, tuple[list[int], int]] = {}  # row -> (tokens, reused or cached)
    finished: set[int] = set()  # rows cached by cache_row, not freed yet
    num_cached_early = 0
    for _ in range(300):
        if live and (len(live) == 6 or rng.random() < 0.4):
            row = rng.choice(list(live))
            tokens, reused = live[row]
            if row not in finished and rng.random() < 0.3:  # a plan in flight still holds it
                alloc.cache_row(row, tokens)
                cached = min(len(tokens) // page_size, alloc.num_held_pages(row)) * page_size
                assert alloc.cache.match_len(tokens) >= cached
                live[row] = tokens, max(cached, reused)
                finished.add(row)
                num_cached_early += 1
            else:
                del live[row]
                finished.discard(row)
                alloc.free(row, tokens if rng.random() < 0.8 else None)
        else:
            tokens = rng.choice(stems) + [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
            reused, taken = alloc.cached_prefix(tokens)
            assert reused % page_size == 0 and reused <= len(tokens) - 1
            assert reused <= alloc.cache.match_len(tokens) - lookahead or reused == 0
            if alloc.pages_needed(None, len(tokens)) - reused // page_size + taken > (
                alloc.num_free_pages
            ):
                continue
            row = alloc.alloc_row(tokens[:reused])
            assert alloc.grow(row, len(tokens)) is not None
            live[row] = tokens, reused
        owned = [p for row in live for p in alloc._pages[row][live[row][1] // page_size :]]
        held = owned + [p for pages in alloc._duplicates.values() for p in pages]
        assert len(held) == len(set(held)), "a page held by two rows"
        assert not set(held) & set(alloc.cache.all_pages()), "a row's own page is cached"
        alloc.cache.check()
    assert num_cached_early > 10
    for row, (tokens, _) in live.items():
        alloc.free(row, tokens)
    assert alloc.is_whole()


def test_requests_admitted_together_count_their_shared_cached_prefix_once():
    """Two waiting requests reuse one evictable 16-token prefix: locking it takes 16 pages out
    of the free count once, so both fit in 24 pages (16 + 3 + 3 with their decode headroom)."""
    from aerie.messages import SamplingParams
    from scheduler_proc.policy import SchedulePolicy
    from scheduler_proc.request import Request

    alloc = KVAllocator(24, 1, 8, prefix_cache=True)
    shared = list(range(100, 116))
    row = alloc.alloc_row()
    alloc.grow(row, 16)
    alloc.free(row, shared)
    policy = SchedulePolicy(chunked_prefill_size=64, decode_alloc_len=1, max_running_requests=8)
    waiting = [
        Request(rid, shared + tail, SamplingParams(max_new_tokens=1))
        for rid, tail in (("a", [1, 2]), ("b", [3, 4]))
    ]
    decision = policy.plan_extend([], waiting, alloc)
    assert [r.rid for r in decision.admitted] == ["a", "b"]
    assert decision.cached_lens == [16, 16]


def test_rows_retracted_together_release_the_prefix_they_share():
    """Two rows reuse one cached prefix: freeing either alone releases only its own pages;
    counted as one decision, the second also releases the shared prefix, and the count is
    what freeing both does."""
    alloc = KVAllocator(num_pages=32, page_size=2, max_running_requests=4, prefix_cache=True)
    stem = [1, 2, 3, 4, 5, 6]
    first = alloc.alloc_row()
    alloc.grow(first, 6)
    alloc.free(first, stem)  # stem cached: 3 evictable pages
    rows = []
    for tail in ([7, 8], [9, 10, 11, 12]):
        reused, _ = alloc.cached_prefix(stem + tail)
        row = alloc.alloc_row((stem + tail)[:reused])
        alloc.grow(row, len(stem) + len(tail))
        rows.append(row)
    assert [alloc.releasable_pages(r) for r in rows] == [1, 2]  # the shared 3 counted by none
    released: dict[int, int] = {}
    counted = [alloc.releasable_pages(r, released) for r in rows]
    assert counted == [1, 2 + 3]
    before = alloc.num_free_pages
    for row in rows:
        alloc.free(row)
    assert alloc.num_free_pages - before == sum(counted)
    assert alloc.is_whole()
