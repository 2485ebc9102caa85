"""KVCachePool: page accounting, prefix sharing, LRU eviction, pinning, statistics."""
import numpy as np
import pytest

from engines.runtime.core.kv_pool import Admission, KVCachePool

PS = 4  # page size used throughout: small so tests read in whole pages


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def run_prefill(pool: KVCachePool, seq_id, token_ids, budget: int = 10_000) -> Admission:
    """Admit and commit a whole prompt in one chunk, as the engine would."""
    adm = pool.admit(seq_id, token_ids, budget)
    assert adm is not None
    pool.commit(seq_id, token_ids[adm.cached_tokens:adm.cached_tokens + adm.new_tokens])
    return adm


def check_invariants(pool: KVCachePool) -> None:
    u = pool.usage()
    assert u.used_pages + u.cached_pages + u.free_pages == u.total_pages
    held = [p for s in pool._seqs.values() for p in s.pages]
    # a page is held by several sequences only if it is a cached (shared) page
    for page in set(held):
        assert pool._refcount[page] == held.count(page)
        if held.count(page) > 1:
            assert pool._key[page] is not None
    assert not any(page in pool._free for page in held)
    assert not set(held) & set(pool._evictable)


def test_fresh_pool_hands_out_pages_in_order_and_counts_usage():
    pool = KVCachePool(num_pages=8, page_size=PS)
    assert pool.usage().free_pages == 8
    adm = pool.admit("a", toks(0, 6), max_new_tokens=100)
    assert adm == Admission(cached_tokens=0, new_tokens=6)
    assert pool.pages("a") == (0, 1)
    assert (pool.num_used_pages, pool.num_free_pages, pool.num_cached_pages) == (2, 6, 0)
    assert pool.num_computed_tokens("a") == 0
    pool.commit("a", toks(0, 6))
    assert pool.num_computed_tokens("a") == 6
    check_invariants(pool)


def test_admit_respects_the_chunk_budget_and_later_chunks_allocate_incrementally():
    pool = KVCachePool(num_pages=8, page_size=PS)
    prompt = toks(0, 10)
    adm = pool.admit("a", prompt, max_new_tokens=3)
    assert adm == Admission(0, 3)
    assert len(pool.pages("a")) == 1
    pool.commit("a", prompt[:3])
    assert pool.pages_needed("a", 1) == 0  # slot 3 is on page 0 still
    assert pool.pages_needed("a", 2) == 1
    assert pool.try_allocate("a", 7)
    assert len(pool.pages("a")) == 3
    pool.commit("a", prompt[3:])
    assert pool.num_computed_tokens("a") == 10
    # decode: one token at a time, a page every PS tokens
    for i in range(10, 13):
        assert pool.try_allocate("a", 1)
        pool.commit("a", [i])
    assert len(pool.pages("a")) == 4
    check_invariants(pool)


def test_commit_beyond_reserved_slots_is_rejected():
    pool = KVCachePool(num_pages=4, page_size=PS)
    pool.admit("a", toks(0, 3), 3)
    with pytest.raises(ValueError, match="allocate first"):
        pool.commit("a", toks(0, 4))


def test_exhaustion_is_signalled_without_side_effects():
    pool = KVCachePool(num_pages=3, page_size=PS)
    run_prefill(pool, "a", toks(0, 8))  # 2 pages
    before = pool.usage()
    assert pool.admit("b", toks(100, 9), 100) is None  # needs 3 pages, 1 available
    assert "b" not in pool
    assert pool.usage() == before  # no statistics counted for a refused admission
    assert pool.pages_needed("a", 5) == 2 and pool.num_available_pages == 1
    assert pool.try_allocate("a", 5) is False
    assert len(pool.pages("a")) == 2
    assert pool.usage() == before
    assert pool.try_allocate("a", 4)  # exactly fits
    assert pool.num_available_pages == 0


def test_free_returns_pages_and_ids_are_reused():
    pool = KVCachePool(num_pages=4, page_size=PS, enable_prefix_cache=False)
    run_prefill(pool, "a", toks(0, 8))
    run_prefill(pool, "b", toks(50, 8))
    assert pool.num_available_pages == 0
    a_pages = set(pool.pages("a"))
    pool.free("a")
    assert pool.num_free_pages == 2
    run_prefill(pool, "c", toks(80, 8))
    assert set(pool.pages("c")) == a_pages
    pool.free("unknown")  # aborting a request that never got pages is fine
    pool.free("c")
    pool.free("b")
    assert pool.num_free_pages == 4 and pool.num_cached_pages == 0
    check_invariants(pool)


def test_duplicate_or_empty_admission_is_rejected():
    pool = KVCachePool(num_pages=4, page_size=PS)
    pool.admit("a", [1], 1)
    with pytest.raises(ValueError, match="already"):
        pool.admit("a", [1], 1)
    with pytest.raises(ValueError, match="no tokens"):
        pool.admit("b", [], 1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        pool.admit("b", [1], 0)


def test_prefix_is_shared_with_refcounts_over_full_pages_only():
    pool = KVCachePool(num_pages=16, page_size=PS)
    system = toks(0, 10)  # 2 full pages + 2 tokens
    run_prefill(pool, "a", system + [500])
    a_pages = pool.pages("a")
    adm = run_prefill(pool, "b", system + [600, 601, 602])
    assert adm.cached_tokens == 8  # the partial third page is never shared
    b_pages = pool.pages("b")
    assert b_pages[:2] == a_pages[:2]
    assert b_pages[2] != a_pages[2]
    assert pool._refcount[a_pages[0]] == 2 and pool._refcount[a_pages[1]] == 2
    assert pool.num_computed_tokens("b") == 13
    check_invariants(pool)
    pool.free("a")
    assert pool._refcount[a_pages[0]] == 1
    assert pool.num_cached_pages == 0  # shared pages still held by b; a's partial page freed
    pool.free("b")
    assert pool.num_cached_pages == 3  # the shared pages and b's own full page stay resident
    # b's third page held tokens 8..11 = [8, 9, 600, 601]: full, so cached too
    assert pool.match_prefix(system + [600, 601, 602, 603]) == 12
    check_invariants(pool)


def test_match_leaves_at_least_one_token_to_compute():
    pool = KVCachePool(num_pages=8, page_size=PS)
    prompt = toks(0, 8)
    run_prefill(pool, "a", prompt)
    pool.free("a")
    assert pool.match_prefix(prompt) == 4  # not 8: the model needs the last token's logits
    adm = pool.admit("b", prompt, 100)
    assert adm == Admission(cached_tokens=4, new_tokens=4)
    assert pool.match_prefix(prompt + [9]) == 8


def test_max_cached_tokens_caps_the_reused_prefix_in_whole_pages():
    """A sequence that must compute positions the cache holds (prompt logprobs) takes no more of
    the cached prefix than it may; its own full pages are private duplicates, the cache keeps
    the first copy."""
    pool = KVCachePool(num_pages=16, page_size=PS)
    prompt = toks(0, 13)
    run_prefill(pool, "a", prompt)
    cached = pool.pages("a")[:3]
    stats = (pool.usage().query_tokens, pool.usage().hit_tokens)
    assert pool.admit("none", prompt, 100, max_cached_tokens=0) == Admission(cached_tokens=0, new_tokens=13)
    assert pool.pages("none")[0] not in cached
    # A cap inside a page rounds down; a cap past the match changes nothing.
    assert pool.admit("some", prompt, 100, max_cached_tokens=7) == Admission(cached_tokens=4, new_tokens=9)
    assert pool.pages("some")[0] == cached[0] and pool.pages("some")[1] not in cached
    assert pool.admit("all", prompt, 100, max_cached_tokens=50) == Admission(cached_tokens=12, new_tokens=1)
    pool.commit("none", prompt)
    assert pool.match_prefix(prompt) == 12 and pool._cached[pool._key[cached[0]]] == cached[0]
    # Capped admissions are no lookups: the hit rate stays the cache's worth to the others.
    assert (pool.usage().query_tokens, pool.usage().hit_tokens) == stats
    check_invariants(pool)
    for seq in ("a", "none", "some", "all"):
        pool.free(seq)
    check_invariants(pool)


def test_prefix_key_covers_the_whole_prefix_not_just_the_page():
    pool = KVCachePool(num_pages=8, page_size=PS)
    run_prefill(pool, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    # same second page, different first page: no match for either
    assert pool.match_prefix([0, 2, 3, 4, 5, 6, 7, 8, 9]) == 0
    assert pool.match_prefix([1, 2, 3, 4, 5, 6, 7, 0, 9]) == 4


def test_decode_tokens_fill_pages_that_become_cacheable():
    pool = KVCachePool(num_pages=8, page_size=PS)
    run_prefill(pool, "a", toks(0, 3))
    for t in (3, 4, 5, 6, 7):  # the sampled tokens, fed back one per step
        assert pool.try_allocate("a", 1)
        pool.commit("a", [t])
    pool.free("a")
    assert pool.match_prefix(toks(0, 9)) == 8


def test_pages_committed_in_the_same_step_are_not_matched_before_commit():
    pool = KVCachePool(num_pages=8, page_size=PS)
    prompt = toks(0, 9)
    assert pool.admit("a", prompt, 100).cached_tokens == 0
    # "b" arrives before "a"'s forward pass: nothing to share yet
    assert pool.admit("b", prompt, 100).cached_tokens == 0
    pool.commit("a", prompt)
    pool.commit("b", prompt)  # duplicate contents stay private to b
    assert pool.pages("a")[:2] != pool.pages("b")[:2]
    pool.free("b")
    assert pool.num_free_pages == 5  # b's private pages went back to the free list
    pool.free("a")
    assert pool.num_cached_pages == 2
    check_invariants(pool)


def test_evictable_pages_are_used_only_when_no_free_page_is_left():
    pool = KVCachePool(num_pages=6, page_size=PS)
    run_prefill(pool, "a", toks(0, 9))  # 2 full cached pages + 1 partial
    pool.free("a")
    assert (pool.num_cached_pages, pool.num_free_pages) == (2, 4)
    run_prefill(pool, "b", toks(100, 16))  # exactly the 4 free pages
    assert pool.num_cached_pages == 2  # nothing evicted yet
    assert pool.match_prefix(toks(0, 9)) == 8
    assert pool.try_allocate("b", 1)  # needs a fresh page: evicts one
    assert pool.num_cached_pages == 1
    check_invariants(pool)


def test_eviction_is_least_recently_released_first_and_tail_first_within_a_sequence():
    pool = KVCachePool(num_pages=8, page_size=PS)
    run_prefill(pool, "x", toks(0, 9))      # pages x0, x1 cached
    run_prefill(pool, "y", toks(100, 9))    # pages y0, y1 cached
    x0, x1, _ = pool.pages("x")
    y0, y1, _ = pool.pages("y")
    pool.free("x")
    pool.free("y")
    # x released before y; within x the tail page x1 goes first
    assert list(pool._evictable) == [x1, x0, y1, y0]
    # re-using x's prefix refreshes it: y is now least recently used
    run_prefill(pool, "x2", toks(0, 9))
    pool.free("x2")
    assert list(pool._evictable) == [y1, y0, x1, x0]
    assert pool.num_free_pages == 4
    run_prefill(pool, "z", toks(200, 24))  # 6 pages: the 4 free ones, then y1, y0 evicted
    assert pool.match_prefix(toks(100, 9)) == 0
    assert pool.match_prefix(toks(0, 9)) == 8
    check_invariants(pool)


def test_partial_eviction_truncates_a_cached_chain_from_its_end():
    pool = KVCachePool(num_pages=4, page_size=PS)
    run_prefill(pool, "a", toks(0, 13))  # 3 full pages + 1 partial
    pool.free("a")
    assert pool.num_cached_pages == 3
    run_prefill(pool, "b", toks(100, 3))  # takes the free page
    assert pool.try_allocate("b", 2)  # evicts the LRU page: the chain's tail
    assert pool.match_prefix(toks(0, 13)) == 8


def test_matching_an_evictable_page_revives_it_and_is_accounted_for_in_admission():
    pool = KVCachePool(num_pages=3, page_size=PS)
    run_prefill(pool, "a", toks(0, 9))  # uses all 3 pages; 2 cached
    pool.free("a")
    assert pool.num_available_pages == 3
    # needs the 2 cached pages plus 1 fresh (the free one): fits exactly
    adm = run_prefill(pool, "b", toks(0, 12))
    assert adm == Admission(8, 4)
    assert pool.num_available_pages == 0
    pool.free("b")
    assert pool.num_cached_pages == 3
    # would share all 3 cached pages and need 1 fresh one: none is left after sharing
    assert pool.admit("c", toks(0, 16), 100) is None
    assert pool.num_cached_pages == 3  # refused admission evicted nothing


def test_pinned_pages_are_never_evicted_until_reset():
    pool = KVCachePool(num_pages=6, page_size=PS)
    system = toks(0, 8)
    prompt = system + [900, 901]
    adm = pool.admit("a", prompt, 100)
    pool.pin("a", len(prompt))  # pinned before the prompt's pages exist
    assert pool.num_pinned_pages == 0
    pool.commit("a", prompt[adm.cached_tokens:])
    assert pool.num_pinned_pages == 2  # the partial page is not pinned
    pool.free("a")
    assert pool.num_cached_pages == 0  # pinned pages are not evictable...
    assert pool.num_used_pages == 2    # ...they count as used
    # fill the rest of the pool twice over: pinned pages survive
    for i in range(3):
        run_prefill(pool, f"f{i}", toks(1000 * (i + 1), 16))
        pool.free(f"f{i}")
    assert pool.match_prefix(prompt) == 8
    assert pool.admit("big", toks(5000, 17), 100) is None  # 5 pages, only 4 available
    # a later request with the same system prompt shares the pinned pages
    adm = run_prefill(pool, "b", system + [1, 2, 3])
    assert adm.cached_tokens == 8
    pool.free("b")
    assert pool.num_pinned_pages == 2
    pool.reset()
    assert pool.num_pinned_pages == 0
    assert pool.num_free_pages == 6
    assert pool.match_prefix(prompt) == 0


def test_pin_after_prefill_pins_the_already_cached_pages_including_shared_ones():
    pool = KVCachePool(num_pages=8, page_size=PS)
    run_prefill(pool, "a", toks(0, 9))
    pool.free("a")  # 2 cached, evictable
    run_prefill(pool, "b", toks(0, 13))  # shares 2, computes 1 more full page
    pool.pin("b", 13)
    assert pool.num_pinned_pages == 3
    pool.free("b")
    assert pool.num_cached_pages == 0
    assert pool.match_prefix(toks(0, 13)) == 12


def test_pin_of_a_private_duplicate_pins_the_cached_copy():
    pool = KVCachePool(num_pages=8, page_size=PS)
    prompt = toks(0, 5)
    pool.admit("a", prompt, 100)
    pool.admit("b", prompt, 100)
    pool.commit("a", prompt)
    pool.commit("b", prompt)  # b's first page duplicates a's cached one
    pool.pin("b", 5)
    cached = pool.pages("a")[0]
    assert pool._pinned[cached]
    pool.free("a")
    pool.free("b")
    assert pool.num_pinned_pages == 1
    assert pool.num_cached_pages == 0


def test_reset_frees_everything_and_clears_statistics():
    pool = KVCachePool(num_pages=5, page_size=PS)
    run_prefill(pool, "a", toks(0, 9))
    run_prefill(pool, "b", toks(0, 9))
    pool.reset()
    assert "a" not in pool
    u = pool.usage()
    assert (u.free_pages, u.used_pages, u.cached_pages, u.query_tokens, u.hit_tokens) == (5, 0, 0, 0, 0)
    assert pool.admit("c", toks(0, 9), 100) == Admission(cached_tokens=0, new_tokens=9)
    assert pool.pages("c") == (0, 1, 2)


def test_reset_prefix_cache_forgets_every_prefix_but_the_pinned_ones():
    pool = KVCachePool(num_pages=12, page_size=PS)
    system = toks(0, 8)
    pool.admit("pinned", system + [900], 100)
    pool.pin("pinned", 9)
    pool.commit("pinned", system + [900])
    pool.free("pinned")  # 2 pinned pages
    run_prefill(pool, "gone", toks(100, 9))
    pool.free("gone")  # 2 cached pages nobody holds
    run_prefill(pool, "live", toks(200, 9))  # 2 cached pages held by a live sequence
    before = pool.usage()
    assert pool.reset_prefix_cache() == 4
    check_invariants(pool)
    assert pool.num_cached_pages == 0 and pool.num_pinned_pages == 2
    assert pool.num_free_pages == before.free_pages + 2  # the unheld cached pages are free now
    assert (pool.usage().query_tokens, pool.usage().hit_tokens) == (before.query_tokens, before.hit_tokens)
    assert pool.match_prefix(toks(100, 9)) == 0 and pool.match_prefix(toks(200, 9)) == 0
    assert pool.match_prefix(system + [1]) == 8  # a pin lasts until reset()
    free_before = pool.num_free_pages
    pool.free("live")  # its pages were uncached: they go back to the free list, not the cache
    assert pool.num_free_pages == free_before + 3 and pool.num_cached_pages == 0
    check_invariants(pool)
    run_prefill(pool, "again", toks(100, 9))  # cached again as it is computed
    pool.free("again")
    assert pool.match_prefix(toks(100, 9)) == 8


def test_hit_statistics_count_prompt_tokens_and_cached_tokens():
    pool = KVCachePool(num_pages=16, page_size=PS)
    assert pool.usage().hit_rate == 0.0
    run_prefill(pool, "a", toks(0, 10))
    run_prefill(pool, "b", toks(0, 10))  # 8 of 10 from cache
    run_prefill(pool, "c", toks(50, 6))  # miss
    u = pool.usage()
    assert (u.query_tokens, u.hit_tokens) == (26, 8)
    assert u.hit_rate == pytest.approx(8 / 26)
    pool.match_prefix(toks(0, 10))  # a pure query does not count
    assert pool.usage().query_tokens == 26


def test_prefix_cache_disabled_shares_nothing_and_pin_is_a_no_op():
    pool = KVCachePool(num_pages=8, page_size=PS, enable_prefix_cache=False)
    run_prefill(pool, "a", toks(0, 9))
    pool.pin("a", 9)
    assert run_prefill(pool, "b", toks(0, 9)).cached_tokens == 0
    pool.free("a")
    pool.free("b")
    assert (pool.num_free_pages, pool.num_pinned_pages) == (8, 0)


def test_page_table_is_padded_int32():
    pool = KVCachePool(num_pages=8, page_size=PS)
    run_prefill(pool, "a", toks(0, 9))
    run_prefill(pool, "b", toks(100, 2))
    table = pool.page_table(["a", "b"])
    assert table.dtype == np.int32
    assert table.tolist() == [list(pool.pages("a")), [pool.pages("b")[0], -1, -1]]
    assert pool.page_table(["b"], width=4).tolist() == [[pool.pages("b")[0], -1, -1, -1]]
    with pytest.raises(ValueError, match="width"):
        pool.page_table(["a"], width=1)


def test_random_workload_keeps_the_books_balanced():
    """Admit, grow, preempt and free at random; invariants hold and nothing leaks."""
    rng = np.random.default_rng(0)
    pool = KVCachePool(num_pages=24, page_size=PS)
    prefixes = [list(rng.integers(0, 50, size=12)) for _ in range(3)]
    live: dict[int, list[int]] = {}
    next_id = 0
    for _ in range(2000):
        op = rng.integers(0, 4)
        if op == 0 or not live:
            prompt = prefixes[rng.integers(0, 3)] + list(rng.integers(0, 50, size=rng.integers(1, 9)))
            adm = pool.admit(next_id, prompt, int(rng.integers(1, 30)))
            if adm is not None:
                assert adm.cached_tokens % PS == 0 and adm.cached_tokens < len(prompt)
                pool.commit(next_id, prompt[adm.cached_tokens:adm.cached_tokens + adm.new_tokens])
                live[next_id] = prompt
                if rng.random() < 0.1:
                    pool.pin(next_id, len(prompt))
            next_id += 1
        elif op in (1, 2):
            sid = list(live)[rng.integers(0, len(live))]
            if pool.try_allocate(sid, 1):
                pool.commit(sid, [int(rng.integers(0, 50))])
        else:
            sid = list(live)[rng.integers(0, len(live))]
            pool.free(sid)
            del live[sid]
        check_invariants(pool)
        assert pool.num_pinned_pages <= 24
    for sid in list(live):
        pool.free(sid)
    assert pool.num_used_pages == pool.num_pinned_pages
    assert all(r == 0 for r in pool._refcount)


def test_reserve_holds_a_window_for_arriving_kv_and_rename_hands_it_on():
    pool = KVCachePool(num_pages=8, page_size=4)
    run_prefill(pool, "warm", toks(0, 10))  # pages of [0:8] cached once committed
    pool.free("warm")
    admission = pool.reserve("recv", toks(0, 20), 14)
    assert admission == Admission(cached_tokens=8, new_tokens=6)
    assert len(pool.pages("recv")) == 4 and pool.num_computed_tokens("recv") == 8
    pool.commit("recv", toks(8, 6))  # the arrived K/V of [8:14]
    pool.rename("recv", "gen")
    assert "recv" not in pool and pool.num_computed_tokens("gen") == 14
    assert pool.try_allocate("gen", 6)  # the rest of the prompt, on top
    check_invariants(pool)
    pool.free("gen")
    assert pool.num_used_pages == 0


def test_reserve_may_match_past_its_end_and_refuses_without_side_effects():
    pool = KVCachePool(num_pages=4, page_size=4)
    run_prefill(pool, "warm", toks(0, 13))
    pool.free("warm")
    assert pool.reserve("recv", toks(0, 13), 5) == Admission(cached_tokens=12, new_tokens=0)
    pool.free("recv")
    before = pool.usage()
    assert pool.reserve("big", toks(100, 30), 20) is None  # 5 pages of a 4-page pool
    assert pool.usage() == before and "big" not in pool
    with pytest.raises(ValueError, match="end must be in 1..3"):
        pool.reserve("bad", toks(0, 3), 4)


def test_prefix_leaves_are_the_ends_of_shared_chains_and_count_their_hits() -> None:
    """What the debugger's KV dump lists: cached prefixes, their hits and evictions."""
    pool = KVCachePool(8, 4)
    base = list(range(8))
    for sid, tail in (("a", [100, 101, 102, 103, 9]), ("b", [200, 201, 202, 203, 9])):
        tokens = base + tail
        admission = pool.admit(sid, tokens, len(tokens))
        assert admission is not None
        pool.commit(sid, tokens[admission.cached_tokens:])
        pool.free(sid)
    leaves = pool.prefix_leaves()
    assert sorted(leaf.depth for leaf in leaves) == [3, 3]  # two chains sharing their first two pages
    assert all(pool.first_page_hits(leaf.page) == 1 for leaf in leaves)  # b matched the shared start
    assert pool.num_evictions == 0
    big = list(range(1000, 1032))  # 8 pages: every cached page must go
    assert pool.admit("big", big, len(big)) is not None
    assert pool.num_evictions == 4 and pool.prefix_leaves() == []
    assert pool.num_pages_held("big") == 8 and pool.pages_held("big") == list(pool.pages("big"))
    assert pool.pages_held("gone") == [] and pool.num_pages_held("gone") == 0
    pool.reset()
    assert pool.num_evictions == 0
