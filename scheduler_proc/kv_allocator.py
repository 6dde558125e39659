"""Logical KV allocation: request rows and KV pages, as free lists. CPU only (numpy, no torch).

Rows are 1..max_running_requests; row 0 is a reserved dummy (CUDA-graph padding). Pages are
1..num_pages of `page_size` slots each; the slot of position `p` of a row is
`pages[p // page_size] * page_size + p % page_size`, so page 0 (and with it slot 0) is never
handed out and the worker's KV pools need `(num_pages + 1) * page_size` slots.

Per row the allocator keeps its page list and `allocated_len`, the number of positions that
have slots. `grow` extends it (all or nothing), `grow_rows` does so for every row of a decode
step in one call, `shrink` gives back whole pages beyond a length (speculative headroom that
was not accepted), `free` releases everything.

With a prefix cache (`RadixCache`) a row may start on cached pages (`alloc_row(prefix)`), and
`free(row, token_ids)` caches the row's whole pages instead of freeing them; `cache_row` caches
them earlier, while the row lives on (a finished request whose last plan is still in flight).
Cached pages no running row uses count as free: taking pages evicts them, least recently used
first.
"""

from __future__ import annotations

import logging

import numpy as np

from scheduler_proc.radix_cache import Node, RadixCache

log = logging.getLogger(__name__)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class KVAllocator:
    """Free lists of request rows and KV pages. Every method is O(pages touched)."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        max_running_requests: int,
        prefix_cache: bool = False,
        draft_lookahead: int = 0,
    ) -> None:
        """draft_lookahead: how many tokens past a position a draft's KV there depends on (1
        for EAGLE, the layer count for MTP): a reused prefix stops that many tokens short of
        the match, so every runner's KV in it was made from the same tokens."""
        if num_pages < 1 or page_size < 1 or max_running_requests < 1:
            raise ValueError("num_pages, page_size and max_running_requests must be >= 1")
        self.cache = RadixCache(page_size) if prefix_cache else None
        self.draft_lookahead = draft_lookahead
        self._locks: dict[int, tuple[Node, int]] = {}  # row -> (cached node, its pages)
        # row -> pages `cache_row` found the tree already held: still the row's until `free`.
        self._duplicates: dict[int, list[int]] = {}
        self.num_pages = num_pages
        self.page_size = page_size
        self.max_running_requests = max_running_requests
        # Pages given back, reused first (a stack); pages >= _next_fresh were never handed
        # out. Building a free list of every page up front costs seconds and gigabytes for
        # the tens of millions of pages a small model's cache can hold.
        self._free_pages: list[int] = []
        self._next_fresh = 1
        self._free_rows: list[int] = list(range(max_running_requests, 0, -1))
        self._pages: dict[int, list[int]] = {}  # row -> its pages, in position order
        self._lens: dict[int, int] = {}  # row -> allocated_len

    # ---------------------------------------------------------------- rows

    def alloc_row(self, prefix_ids: list[int] | None = None) -> int | None:
        """A free row (>= 1), or None when every row is taken. prefix_ids (whole pages, all
        cached: see `cached_prefix`): the row starts holding their cached pages."""
        if not self._free_rows:
            return None
        row = self._free_rows.pop()
        self._pages[row] = []
        self._lens[row] = 0
        if prefix_ids:
            assert self.cache is not None
            pages, node = self.cache.acquire(prefix_ids)
            self._pages[row] = pages
            self._lens[row] = len(prefix_ids)
            self._locks[row] = (node, len(pages))
        return row

    def free(self, row: int, token_ids: list[int] | None = None) -> None:
        """Release the row and its pages. token_ids (with a prefix cache): the tokens at the
        row's positions; its whole pages among them are cached rather than freed."""
        if token_ids is not None:
            self.cache_row(row, token_ids)
        pages = self._pages.pop(row)
        del self._lens[row]
        self._free_rows.append(row)
        node, num_locked = self._locks.pop(row, (None, 0))
        if node is not None:
            self.cache.release(node)
        self._free_pages.extend(reversed(pages[num_locked:]))
        self._free_pages.extend(self._duplicates.pop(row, ()))

    def cache_row(self, row: int, token_ids: list[int]) -> None:
        """Cache the row's whole pages of token_ids (the tokens at its positions) now, so that
        requests admitted from now on reuse them, while the row keeps them (locked) and every
        other page it holds until `free` (a finished request a plan in flight still holds;
        `free` caches through it too).
        Safe to reuse at once because plans run in order: whatever the plan in flight writes
        into these positions (the same tokens' KV) is written before a later plan reads it."""
        if self.cache is None:
            return
        pages = self._pages[row]
        node, num_locked = self._locks.get(row, (None, 0))
        num_cached = min(len(token_ids) // self.page_size, len(pages))
        if num_cached <= num_locked:
            return
        cached = token_ids[: num_cached * self.page_size]
        self._duplicates.setdefault(row, []).extend(self.cache.insert(cached, pages[:num_cached]))
        tree_pages, locked = self.cache.acquire(cached)
        if node is not None:
            self.cache.release(node)
        self._locks[row] = (locked, num_cached)
        self._pages[row] = tree_pages + pages[num_cached:]

    def cached_prefix(
        self, token_ids: list[int], counted: dict[int, int] | None = None
    ) -> tuple[int, int]:
        """(n, pages): the first n of token_ids a new row can reuse from the cache (whole
        pages, `draft_lookahead` short of the match, leaving at least the last token to run)
        and how many evictable pages reusing them takes (those not in `counted`, which
        requests admitted together share: see `RadixCache.evictable_pages_on`). (0, 0)
        without a cache."""
        if self.cache is None:
            return 0, 0
        matched = self.cache.match_len(token_ids)
        usable = min(matched - self.draft_lookahead, len(token_ids) - 1)
        usable -= usable % self.page_size
        if usable <= 0:
            return 0, 0
        return usable, self.cache.evictable_pages_on(token_ids[:usable], counted)

    def flush_cache(self) -> int:
        """Free every cached page no row uses; -> how many."""
        if self.cache is None:
            return 0
        freed = self.cache.evict(self.cache.num_evictable_pages)
        self._free_pages += freed
        return len(freed)

    def releasable_pages(self, row: int, released: dict[int, int] | None = None) -> int:
        """Pages that become free (or evictable) when the row is freed: its own and the cached
        ones no other row uses. released (node id -> rows): the rows an earlier call of the
        same decision released too, updated; a cached node they share with this row counts
        once the last of its rows is released."""
        released = {} if released is None else released
        node, num_locked = self._locks.get(row, (None, 0))
        held = len(self._pages[row]) - num_locked
        while node is not None and node.parent is not None:
            released[id(node)] = released.get(id(node), 0) + 1
            held += len(node.pages) if released[id(node)] == node.lock_ref else 0
            node = node.parent
        return held

    # ---------------------------------------------------------------- pages

    def allocated_len(self, row: int) -> int:
        return self._lens[row]

    def num_held_pages(self, row: int) -> int:
        return len(self._pages[row])

    def pages_needed(self, row: int | None, new_len: int) -> int:
        """Pages `grow(row, new_len)` would take (row None: a row not allocated yet)."""
        held = 0 if row is None else len(self._pages[row])
        return max(0, ceil_div(new_len, self.page_size) - held)

    def pages_needed_rows(self, rows: list[int], new_lens: list[int]) -> int:
        """Pages `grow_rows(rows, new_lens)` would take: `pages_needed` summed over the rows."""
        page_size, all_pages = self.page_size, self._pages
        needs = [
            -(-n // page_size) - len(all_pages[row]) for row, n in zip(rows, new_lens, strict=True)
        ]
        return sum([need for need in needs if need > 0])

    def grow(self, row: int, new_len: int) -> np.ndarray | None:
        """Slots for positions [allocated_len, new_len), int32 [new_len - allocated_len].

        Allocates pages as needed. Returns None, allocating nothing, when there are not
        enough free pages. new_len below allocated_len is an error (use `shrink`).
        """
        old_len = self._lens[row]
        if new_len < old_len:
            raise ValueError(f"grow to {new_len} below allocated length {old_len}")
        num_new = self.pages_needed(row, new_len)
        if num_new > self.num_free_pages:
            return None
        if num_new:
            self._pages[row].extend(self._take_pages(num_new))
        self._lens[row] = new_len
        return self.slots(row, old_len, new_len)

    def grow_rows(
        self, rows: list[int], min_lens: list[int]
    ) -> tuple[list[int], list[int], list[int]] | None:
        """A decode step's `grow` of many rows in one call: each row to at least min_lens[i]
        positions (a row already that long gets no slots).

        Returns (starts, lens, slots): per row the first newly assigned position and how many,
        and the new slots of every row back to back. The same as calling
        `grow(row, max(allocated_len(row), min_len))` row after row, the same pages taken in
        the same order (the pages a run of grows takes are `_take_pages` of their sum). None,
        allocating nothing, when there are not enough free pages for all of them.
        """
        # List comprehensions over the rows: a decode step assigns each row a position or a
        # few, so numpy's per-call overhead would cost more than the work, and a loop per row
        # more than these.
        page_size, all_lens = self.page_size, self._lens
        starts = [all_lens[row] for row in rows]
        ends = [n if n > start else start for start, n in zip(starts, min_lens, strict=True)]
        row_pages = [self._pages[row] for row in rows]
        # A row holds ceil(allocated_len / page_size) pages (grow and shrink keep it so).
        needs = [
            -(-end // page_size) - len(pages) for pages, end in zip(row_pages, ends, strict=True)
        ]
        num_new = sum(needs)
        if num_new > self.num_free_pages:
            return None
        taken, next_taken = self._take_pages(num_new), 0
        for pages, need in zip(row_pages, needs, strict=True):
            if need:
                pages += taken[next_taken : next_taken + need]
                next_taken += need
        all_lens.update(zip(rows, ends, strict=True))
        if page_size == 1:  # a page per position: the new positions are the new pages
            slots = taken
        else:
            slots = [
                pages[p // page_size] * page_size + p % page_size
                for pages, start, end in zip(row_pages, starts, ends, strict=True)
                for p in range(start, end)
            ]
        return starts, [end - start for start, end in zip(starts, ends, strict=True)], slots

    def _take_pages(self, num: int) -> list[int]:
        """num free pages: given-back ones first (most recent first), then fresh ones, then
        evicted cached ones."""
        short = num - len(self._free_pages) - (self.num_pages + 1 - self._next_fresh)
        if short > 0:
            assert self.cache is not None, "took more pages than are free"
            self._free_pages[:0] = self.cache.evict(short)  # used after the given-back ones
        reused = min(num, len(self._free_pages))
        pages = self._free_pages[len(self._free_pages) - reused :][::-1]
        del self._free_pages[len(self._free_pages) - reused :]
        fresh = num - reused
        pages.extend(range(self._next_fresh, self._next_fresh + fresh))
        self._next_fresh += fresh
        return pages

    def shrink(self, row: int, keep_len: int) -> None:
        """Keep positions [0, keep_len); free whole pages beyond them. keep_len <= allocated."""
        old_len = self._lens[row]
        if keep_len >= old_len:  # a decode step that used all of its headroom: nothing to do
            if keep_len > old_len:
                raise ValueError(f"shrink to {keep_len} above allocated length {old_len}")
            return
        pages = self._pages[row]
        num_keep = ceil_div(keep_len, self.page_size)
        assert num_keep >= self._locks.get(row, (None, 0))[1], "shrink into cached pages"
        if num_keep < len(pages):
            self._free_pages.extend(reversed(pages[num_keep:]))
            del pages[num_keep:]
        self._lens[row] = keep_len

    def slots(self, row: int, start: int, end: int) -> np.ndarray:
        """Slot ids of positions [start, end) of an allocated row, int32 [end - start]."""
        if not 0 <= start <= end <= self._lens[row]:
            raise ValueError(f"positions [{start}, {end}) outside [0, {self._lens[row]})")
        page_size, pages = self.page_size, self._pages[row]
        first = start // page_size  # only the pages the range touches (O(range), not O(row))
        touched = np.asarray(pages[first : ceil_div(end, page_size)], dtype=np.int64)
        positions = np.arange(start, end, dtype=np.int64) - first * page_size  # [end - start]
        slots = touched[positions // page_size] * page_size + positions % page_size
        return slots.astype(np.int32)

    # ---------------------------------------------------------------- totals

    @property
    def num_free_pages(self) -> int:
        """Pages a grow may take: free ones and cached ones no running row uses."""
        evictable = self.cache.num_evictable_pages if self.cache is not None else 0
        return len(self._free_pages) + self.num_pages + 1 - self._next_fresh + evictable

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    @property
    def num_free_tokens(self) -> int:
        return self.num_free_pages * self.page_size

    @property
    def num_total_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def num_used_tokens(self) -> int:
        return self.num_total_tokens - self.num_free_tokens

    def is_whole(self) -> bool:
        """Every page and row is free (or cached and unused), each exactly once: nothing
        leaked. O(pages handed out so far), in numpy: /flush_cache asks it of an idle server."""
        given_back = [np.asarray(self._free_pages, dtype=np.int64)]
        if self.cache is not None:
            try:
                self.cache.check()
            except AssertionError:
                log.exception("the prefix cache's tree is inconsistent")
                return False
            if self.cache.num_evictable_pages != self.cache.num_pages:
                return False
            given_back.append(np.asarray(self.cache.all_pages(), dtype=np.int64))
        pages = np.concatenate(given_back)  # must be each page below _next_fresh once
        handed_out = self._next_fresh - 1
        if len(pages) != handed_out or (
            len(pages) and (pages.min() < 1 or pages.max() > handed_out)
        ):
            return False
        return (
            not self._pages
            and not np.any(np.bincount(pages, minlength=handed_out + 1) > 1)
            and sorted(self._free_rows) == list(range(1, self.max_running_requests + 1))
        )
