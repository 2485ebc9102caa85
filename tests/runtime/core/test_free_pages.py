"""FreePages: a pool's free page ids, handed out in runs per sequence."""
import random
from itertools import pairwise

import pytest

from engines.runtime.core.free_pages import FreePages
from engines.runtime.core.kv_pool import KVCachePool


def runs(pages: list[int]) -> list[int]:
    """The lengths of the runs of consecutive ids in ``pages``."""
    lengths = [1]
    for before, page in pairwise(pages):
        if page == before + 1:
            lengths[-1] += 1
        else:
            lengths.append(1)
    return lengths


def test_a_fresh_pool_hands_its_first_sequence_pages_in_order():
    free = FreePages(10, run=4)
    pages = [free.take(None)]
    for _ in range(5):
        pages.append(free.take(pages[-1]))
    assert pages == [0, 1, 2, 3, 4, 5]
    assert len(free) == 4


def test_a_batch_growing_in_step_gets_a_run_per_extent_not_interleaved_pages():
    free = FreePages(64, run=8)
    batch = [[free.take(None)] for _ in range(4)]
    assert [pages[0] for pages in batch] == [0, 8, 16, 24]  # each starts a wholly free extent
    for _ in range(11):  # every sequence takes its next page in turn, as a decode batch does
        for pages in batch:
            pages.append(free.take(pages[-1]))
    for pages in batch:
        assert runs(pages) == [8, 4]  # its extent, then a fresh one
    assert sorted(p for pages in batch for p in pages) == sorted(set(p for pages in batch for p in pages))


def test_without_a_wholly_free_extent_the_page_released_last_comes_first():
    free = FreePages(8, run=4)
    taken = [free.take(None) for _ in range(8)]  # no extent is wholly free after the first two
    assert len(free) == 0 and sorted(taken) == list(range(8))
    free.give(5)
    free.give(2)
    assert free.take(None) == 2
    assert free.take(6) == 5  # 7 is taken: the last released is next
    with pytest.raises(IndexError):
        free.take(None)


def test_the_page_after_a_sequence_s_last_is_preferred_wherever_it_lies():
    free = FreePages(16, run=4)
    for _ in range(16):
        free.take(None)
    for page in (9, 3, 14):
        free.give(page)
    assert free.take(8) == 9
    assert free.take(2) == 3
    assert 7 not in free and 14 in free


def test_giving_back_a_page_that_is_free_or_not_in_the_pool_raises():
    free = FreePages(4, run=2)
    page = free.take(None)
    free.give(page)
    with pytest.raises(ValueError):
        free.give(page)
    with pytest.raises(ValueError):
        free.give(4)
    with pytest.raises(ValueError):
        FreePages(0)


@pytest.mark.parametrize("run", [1, 3, 16])
def test_churn_never_hands_out_a_taken_page_and_the_bookkeeping_stays_bounded(run):
    """Random takes (after a random held page or none) and gives, against a plain set."""
    rng = random.Random(run)
    free = FreePages(40, run=run)
    held: list[int] = []
    for _ in range(20_000):
        if held and (len(free) == 0 or rng.random() < 0.45):
            page = held.pop(rng.randrange(len(held)))
            free.give(page)
        else:
            after = rng.choice(held) if held and rng.random() < 0.7 else None
            page = free.take(after)
            assert page not in held
            if after is not None and after + 1 < 40 and after + 1 not in held:
                assert page == after + 1
            held.append(page)
        assert len(free) == 40 - len(held)
        assert all((p in free) == (p not in held) for p in range(40))
        assert len(free._stack) <= 2 * 40  # stale entries are dropped, not hoarded
        assert len(free._whole) <= -(-40 // run)  # an extent is listed once


def test_the_kv_pool_gives_each_sequence_of_a_growing_batch_runs_of_pages():
    pool = KVCachePool(num_pages=256, page_size=16, enable_prefix_cache=False)
    seqs = [f"s{i}" for i in range(8)]
    for i, seq in enumerate(seqs):
        assert pool.admit(seq, list(range(100 * i, 100 * i + 16)), max_new_tokens=16) is not None
    for _ in range(20 * 16):  # 20 more pages each, one token a step
        for seq in seqs:
            assert pool.try_allocate(seq, 1)
    table = pool.page_table(seqs)
    for row in table.tolist():
        assert runs(row) == [16, 5]  # one extent of 16 pages, then the next one's first five
    assert len({p for row in table.tolist() for p in row}) == 8 * 21
