from __future__ import annotations

import random

import numpy as np
import pytest

from scheduler_proc.kv_allocator import KVAllocator


def check_layout(alloc: KVAllocator, row: int, length: int) -> None:
    """Slots of positions in one page share the page; offsets follow positions; no page 0."""
    slots = alloc.slots(row, 0, length)
    pages = slots // alloc.page_size
    assert (pages >= 1).all() and (pages <= alloc.num_pages).all()
    assert (slots % alloc.page_size == np.arange(length) % alloc.page_size).all()
    for p in range(0, length, alloc.page_size):
        assert len(set(pages[p : p + alloc.page_size].tolist())) == 1


@pytest.mark.parametrize("page_size", [1, 4])
def test_grow_continues_the_last_page(page_size):
    alloc = KVAllocator(num_pages=12, page_size=page_size, max_running_requests=2)
    row = alloc.alloc_row()
    first = alloc.grow(row, 6)
    second = alloc.grow(row, 9)
    assert len(first) == 6 and len(second) == 3
    assert np.array_equal(np.concatenate([first, second]), alloc.slots(row, 0, 9))
    check_layout(alloc, row, 9)
    assert 0 not in alloc.slots(row, 0, 9)
    assert alloc.num_free_pages == 12 - -(-9 // page_size)


@pytest.mark.parametrize("page_size", [1, 4])
def test_failed_grow_allocates_nothing(page_size):
    alloc = KVAllocator(num_pages=3, page_size=page_size, max_running_requests=2)
    row = alloc.alloc_row()
    assert alloc.grow(row, 2) is not None
    free_before = alloc.num_free_pages
    assert alloc.grow(row, 3 * page_size + 1) is None
    assert alloc.num_free_pages == free_before
    assert alloc.allocated_len(row) == 2
    alloc.free(row)
    assert alloc.is_whole()


def test_shrink_frees_whole_pages_only():
    alloc = KVAllocator(num_pages=10, page_size=4, max_running_requests=1)
    row = alloc.alloc_row()
    alloc.grow(row, 13)  # 4 pages
    kept = alloc.slots(row, 0, 5).copy()
    alloc.shrink(row, 5)  # positions 0..4 -> 2 pages
    assert alloc.num_held_pages(row) == 2 and alloc.num_free_pages == 8
    assert np.array_equal(alloc.slots(row, 0, 5), kept)
    regrown = alloc.grow(row, 8)  # positions 5..7 stay in the kept second page
    assert (regrown // 4 == kept[4] // 4).all()
    with pytest.raises(ValueError):
        alloc.shrink(row, 9)


def test_rows_exclude_zero_and_run_out():
    alloc = KVAllocator(num_pages=4, page_size=1, max_running_requests=3)
    rows = [alloc.alloc_row() for _ in range(3)]
    assert sorted(rows) == [1, 2, 3]
    assert alloc.alloc_row() is None
    alloc.free(rows[1])
    assert alloc.alloc_row() == rows[1]


@pytest.mark.parametrize("page_size", [1, 4])
def test_random_grow_shrink_free_keeps_slots_disjoint_and_ends_whole(page_size):
    rng = random.Random(page_size)
    alloc = KVAllocator(num_pages=40, page_size=page_size, max_running_requests=6)
    lens: dict[int, int] = {}
    for _ in range(600):
        op = rng.random()
        if op < 0.2 and alloc.num_free_rows:
            lens[alloc.alloc_row()] = 0
        elif lens and op < 0.7:
            row = rng.choice(list(lens))
            new_len = lens[row] + rng.randint(0, 9)
            if alloc.grow(row, new_len) is not None:
                lens[row] = new_len
            else:
                assert alloc.allocated_len(row) == lens[row]
        elif lens and op < 0.9:
            row = rng.choice(list(lens))
            lens[row] = rng.randint(0, lens[row])
            alloc.shrink(row, lens[row])
        elif lens:
            alloc.free(lens.popitem()[0])
        live = np.concatenate([alloc.slots(r, 0, n) for r, n in lens.items()] + [np.zeros(0)])
        assert len(set(live.tolist())) == len(live) and 0 not in live
        held = sum(alloc.num_held_pages(r) for r in lens)
        assert held + alloc.num_free_pages == alloc.num_pages
    for row in list(lens):
        alloc.free(row)
    assert alloc.is_whole()


@pytest.mark.parametrize("page_size", [1, 4])
def test_slot_ranges_agree_with_what_grow_returned(page_size):
    """What grow returns is what slots reads back, whole or in pieces, after interleaved
    grows of a few positions have scattered each row's pages."""
    rng = random.Random(7)
    alloc = KVAllocator(num_pages=1000, page_size=page_size, max_running_requests=3)
    rows = [alloc.alloc_row() for _ in range(3)]
    grown = {row: [] for row in rows}
    for _ in range(120):  # interleaved one- and few-position grows scatter the pages
        row = rng.choice(rows)
        new_len = alloc.allocated_len(row) + rng.choice([1, 1, 3, 7])
        grown[row] += alloc.grow(row, new_len).tolist()
    for row in rows:
        length = alloc.allocated_len(row)
        whole = alloc.slots(row, 0, length)
        assert length > 16 and whole.tolist() == grown[row]
        pieces = [alloc.slots(row, a, min(a + 5, length)) for a in range(0, length, 5)]
        assert np.concatenate(pieces).tolist() == whole.tolist()


def test_a_one_page_grow_reuses_the_page_given_back_last():
    alloc = KVAllocator(num_pages=10, page_size=2, max_running_requests=2)
    a, b = alloc.alloc_row(), alloc.alloc_row()
    alloc.grow(a, 6)  # pages 1, 2, 3
    alloc.shrink(a, 2)  # gives back 3 then 2: 2 is the last given back
    assert alloc.grow(b, 1).tolist() == [2 * 2]  # page 2, slot 4
    assert alloc.grow(b, 3).tolist() == [2 * 2 + 1, 3 * 2]  # then page 3
    assert alloc.grow(a, 3).tolist() == [4 * 2]  # then a fresh page


def allocator_state(alloc: KVAllocator) -> tuple:
    """Everything that decides what the allocator hands out next (free list order included)."""
    return (
        dict(alloc._lens),
        {r: list(p) for r, p in alloc._pages.items()},
        list(alloc._free_pages),
        alloc._next_fresh,
        list(alloc._free_rows),
    )


@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_grow_rows_is_grow_row_after_row(page_size):
    """grow_rows (a decode step's batched grow) returns the slots, and takes the same pages in
    the same order, as `grow(row, max(allocated_len, n))` for each row in turn; a batch that
    does not fit allocates nothing. Shrinks and frees in between make it reuse pages."""
    rng = random.Random(11 * page_size)
    num_pages = 64 // page_size  # small enough that some batches do not fit
    batched = KVAllocator(num_pages=num_pages, page_size=page_size, max_running_requests=8)
    single = KVAllocator(num_pages=num_pages, page_size=page_size, max_running_requests=8)
    rows: list[int] = []
    num_grown = num_refused = 0
    for _ in range(800):
        op = rng.random()
        if op < 0.1 and batched.num_free_rows:
            rows.append(batched.alloc_row())
            assert single.alloc_row() == rows[-1]
        elif rows and op < 0.2:
            row = rows.pop(rng.randrange(len(rows)))
            batched.free(row)
            single.free(row)
        elif rows and op < 0.45:
            row = rng.choice(rows)
            keep = rng.randint(0, batched.allocated_len(row))
            batched.shrink(row, keep)
            single.shrink(row, keep)
        elif rows:
            chosen = rng.sample(rows, rng.randint(0, len(rows)))  # any order, any subset
            # below, at or above the allocated length (the decode step's usual one or few)
            min_lens = [
                max(0, batched.allocated_len(r) + rng.choice([-2, 0, 1, 1, 2, 5])) for r in chosen
            ]
            needed = sum(single.pages_needed(r, n) for r, n in zip(chosen, min_lens, strict=True))
            assert batched.pages_needed_rows(chosen, min_lens) == needed
            before = allocator_state(batched)
            grown = batched.grow_rows(chosen, min_lens)
            if needed > single.num_free_pages:
                assert grown is None and allocator_state(batched) == before
                num_refused += 1
                continue
            starts, lens, slots = grown
            expected_slots = []
            for i, (row, n) in enumerate(zip(chosen, min_lens, strict=True)):
                assert starts[i] == single.allocated_len(row)
                new = single.grow(row, max(single.allocated_len(row), n))
                assert lens[i] == len(new)
                expected_slots += new.tolist()
            assert slots == expected_slots
            num_grown += 1
        assert allocator_state(batched) == allocator_state(single)
    assert num_grown > 100 and num_refused > 5
    for row in rows:
        batched.free(row)
    assert batched.is_whole()
