"""Scheduler policy, driven directly over a small KVCachePool with fake sequences (no model).

Page size 4 throughout, so page arithmetic reads at a glance. Each test drives the engine's
side by hand: ``schedule()``, then ``compute()`` for what the forward pass and the update do.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest

from engines.runtime.core.kv_pool import KVCachePool
from engines.runtime.core.scheduler import Scheduler, SchedulerOutput

PS = 4
_tokens = itertools.count(1000)  # every fake prompt gets fresh token ids: no accidental prefix sharing


@dataclass(eq=False)  # identity, as the scheduler's `in` and `remove` on its queues expect
class FakeSeq:
    """The fields of ``request.Sequence`` the scheduler and ``ScheduledChunk`` read and write."""

    seq_id: str
    token_ids: list[int]
    num_prompt_tokens: int = field(init=False)
    num_computed: int = 0
    num_cached_prefix_tokens: int = 0
    num_preemptions: int = 0
    preempted: bool = False
    kv_send: object = None  # a prefill-only sequence of disaggregated serving (never samples)
    prefix_cache_limit: int | None = None  # what admission may take from the prefix cache (None: any)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)

    @property
    def prefill_only(self) -> bool:
        return self.kv_send is not None

    def __repr__(self) -> str:
        return self.seq_id


def seq(name: str, prompt_len: int) -> FakeSeq:
    return FakeSeq(name, [next(_tokens) for _ in range(prompt_len)])


def make(num_pages: int, max_num_seqs: int = 8, token_budget: int = 64,
         prefix_cache: bool = False) -> tuple[Scheduler, KVCachePool]:
    pool = KVCachePool(num_pages, PS, enable_prefix_cache=prefix_cache)
    return Scheduler(pool, max_num_seqs, token_budget), pool


def compute(pool: KVCachePool, out: SchedulerOutput) -> None:
    """The engine's part of a step: commit every chunk's K/V; a chunk that reached the end of
    its sequence samples one token."""
    for c in out.chunks:
        samples = c.samples  # read before the append below changes it
        pool.commit(c.seq.seq_id, c.seq.token_ids[c.start:c.start + c.num_tokens])
        c.seq.num_computed = c.start + c.num_tokens
        if samples:
            c.seq.token_ids.append(next(_tokens))


def chunks(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(c.seq.seq_id, c.start, c.num_tokens) for c in out.chunks]


def test_waiting_sequences_are_admitted_first_come_first_served():
    sched, _ = make(num_pages=16, max_num_seqs=2)
    a, b, c = seq("a", 9), seq("b", 2), seq("c", 1)  # longest first: no shortest-job-first here
    for s in (a, b, c):
        sched.add(s)
    out = sched.schedule()
    assert out.admitted == [a, b]
    assert chunks(out) == [("a", 0, 9), ("b", 0, 2)]
    assert list(sched.waiting) == [c] and sched.running == [a, b]


def test_a_waiting_head_that_does_not_fit_is_not_overtaken():
    """Head-of-line: a later, smaller request does not jump the queue while running ones free pages."""
    sched, pool = make(num_pages=4)
    running = seq("running", 8)  # 2 pages
    sched.add(running)
    compute(pool, sched.schedule())
    big, small = seq("big", 12), seq("small", 2)  # 3 pages (only 2 left), 1 page
    sched.add(big)
    sched.add(small)
    out = sched.schedule()
    assert out.admitted == [] and out.out_of_pages == []
    assert list(sched.waiting) == [big, small]
    sched.remove(running)
    assert sched.schedule().admitted == [big, small]


def test_max_num_seqs_caps_the_running_set():
    sched, pool = make(num_pages=32, max_num_seqs=2)
    seqs = [seq(f"s{i}", 3) for i in range(4)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert out.admitted == seqs[:2]
    compute(pool, out)
    out = sched.schedule()  # both decode; the budget has room, the sequence limit does not
    assert out.admitted == [] and len(sched.running) == 2
    sched.remove(seqs[0])
    out = sched.schedule()
    assert out.admitted == [seqs[2]] and sched.running == [seqs[1], seqs[2]]


def test_token_budget_below_max_num_seqs_is_refused():
    with pytest.raises(ValueError, match="max_num_seqs"):
        Scheduler(KVCachePool(4, PS), max_num_seqs=8, token_budget=4)


def test_chunked_prefill_splits_a_long_prompt_to_the_token_budget():
    sched, pool = make(num_pages=16, max_num_seqs=2, token_budget=6)
    a, b = seq("a", 14), seq("b", 7)
    sched.add(a)
    sched.add(b)
    steps = []
    for _ in range(4):
        out = sched.schedule()
        assert out.num_tokens <= 6
        steps.append(chunks(out))
        compute(pool, out)
    assert steps == [
        [("a", 0, 6)],                  # the budget is spent on a: b waits
        [("a", 6, 6)],
        [("a", 12, 2), ("b", 0, 4)],    # a's last chunk samples; b takes what is left
        [("a", 14, 1), ("b", 4, 3)],    # a decodes first (running before waiting), b finishes its prompt
    ]
    assert a.num_computed == 15 and b.num_computed == 7


def test_a_chunk_that_does_not_reach_the_end_does_not_sample():
    sched, pool = make(num_pages=16, token_budget=8)
    a = seq("a", 10)
    sched.add(a)
    first = sched.schedule().chunks[0]
    assert (first.num_tokens, first.samples, first.is_prefill) == (8, False, True)


def test_the_newest_running_sequence_is_preempted_first_and_requeued_at_the_front():
    sched, pool = make(num_pages=4)
    a, b, c = seq("a", 8), seq("b", 4), seq("c", 4)  # 2 + 1 + 1 pages: the pool is full
    for s in (a, b, c):
        sched.add(s)
    compute(pool, sched.schedule())
    d = seq("d", 1)
    sched.add(d)
    # Every sequence now has 1 sampled token to compute, and each needs a fresh page for it.
    out = sched.schedule()
    # a (oldest) needs a page: c, the newest, goes. b then needs one: b is the newest left.
    assert out.preempted == [c, b]
    assert chunks(out) == [("a", 8, 1)]
    assert sched.running == [a]
    assert list(sched.waiting) == [b, c, d]  # preempted ahead of new arrivals, oldest first
    assert (b.num_computed, c.num_computed) == (0, 0)
    assert b.seq_id not in pool and c.seq_id not in pool
    assert sched.num_preemptions == 2
    assert (b.preempted, c.preempted, b.num_preemptions, d.preempted) == (True, True, 1, False)


def test_nothing_is_admitted_in_a_step_that_preempted():
    """Otherwise the victim, back at the head of the queue, could be readmitted at once into the
    pages it just gave up, and preempted again next step: thrashing."""
    sched, pool = make(num_pages=4, max_num_seqs=2, token_budget=5)
    a, b = seq("a", 4), seq("b", 5)
    sched.add(a)
    sched.add(b)
    for _ in range(10):  # decode both until a's next token needs a fifth page
        out = sched.schedule()
        if out.preempted:
            break
        compute(pool, out)
    assert out.preempted == [b] and chunks(out) == [("a", 8, 1)]
    assert out.admitted == []
    # b would fit: its first chunk after readmission is what is left of the budget, one page's worth.
    left = sched.token_budget - out.num_tokens
    assert -(-min(len(b.token_ids), left) // PS) <= pool.num_available_pages
    compute(pool, out)
    out = sched.schedule()
    assert out.admitted == [b] and ("b", 0, 4) in chunks(out)


def test_a_waiting_sequence_that_can_never_fit_is_reported_and_the_next_one_admitted():
    sched, pool = make(num_pages=2)  # 8 token slots
    too_long, fits = seq("too_long", 12), seq("fits", 3)
    sched.add(too_long)
    sched.add(fits)
    out = sched.schedule()
    assert out.out_of_pages == [too_long]
    assert out.admitted == [fits]
    assert too_long.seq_id not in pool and too_long not in sched.waiting


def test_a_running_sequence_alone_that_outgrows_the_pool_is_reported_not_preempted():
    """Alone in the pool it can never get more pages: preempting it would loop forever."""
    sched, pool = make(num_pages=2)
    a = seq("a", 8)
    sched.add(a)
    compute(pool, sched.schedule())  # 8 tokens + 1 sampled: the 9th needs a third page
    out = sched.schedule()
    assert out.out_of_pages == [a] and out.preempted == [] and out.chunks == []
    assert sched.running == [] and not sched.has_work
    assert pool.num_used_pages == 0


def test_a_sequence_that_does_not_fit_beside_running_ones_waits():
    sched, pool = make(num_pages=3)
    running = seq("running", 8)
    sched.add(running)
    compute(pool, sched.schedule())
    waiting = seq("waiting", 8)  # 2 pages; 1 is free
    sched.add(waiting)
    out = sched.schedule()
    assert out.out_of_pages == [] and out.admitted == []
    assert list(sched.waiting) == [waiting]
