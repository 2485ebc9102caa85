"""The thread team's rendezvous and barrier (engines/runtime/model/thread_team.py), on numba's threads."""
from __future__ import annotations

import time

import numba
import numpy as np
from numba import njit, prange

from engines.runtime.model import thread_team

ROUNDS = 2000


@njit(parallel=True, nogil=True)
def _exchange(state, team, slots, rounds, mismatches):
    """Each round every member writes its slot, passes a barrier, checks everyone's, passes another."""
    thread_team.reset(state, team)
    for member in prange(team):
        if thread_team.rendezvous(state, team):
            passed = 0
            for r in range(rounds):
                slots[member * 16] = r * team + member  # a cache line a member
                passed += 1
                thread_team.barrier(state, team, passed)
                for other in range(team):
                    if slots[other * 16] != r * team + other:
                        mismatches[member] += 1
                passed += 1
                thread_team.barrier(state, team, passed)
    return state[thread_team.ARRIVED] >= team


def test_members_see_each_others_writes_after_every_barrier() -> None:
    """(A rendezvous is called off, by design, when a member's thread does not start within its
    wait: on a VM whose other vCPU the host stalled for tens of ms, it was, once in a full suite
    run. Such a try does no work; the next one meets.)"""
    team = numba.get_num_threads()
    for _ in range(5):
        state, slots = thread_team.new_state(team), np.full(16 * team, -1, np.int64)
        mismatches = np.zeros(team, np.int64)
        if _exchange(state, team, slots, ROUNDS, mismatches):
            break
        assert state[thread_team.BARRIER] == 0 and slots.tolist() == [-1] * (16 * team)
    else:
        raise AssertionError("the team never met in 5 tries")
    assert mismatches.tolist() == [0] * team
    assert state[thread_team.BARRIER] == 2 * ROUNDS * team


def test_a_team_whose_members_share_a_thread_is_called_off_before_any_works() -> None:
    """Two members put on one thread (numba's pool cut to one thread): the first would wait for the
    second forever at its first barrier. The rendezvous calls the team off and no member works."""
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        state, slots, mismatches = thread_team.new_state(2), np.full(32, -1, np.int64), np.zeros(2, np.int64)
        assert not _exchange(state, 2, slots, ROUNDS, mismatches)
    finally:
        numba.set_num_threads(threads)
    assert state[thread_team.ARRIVED] < 0 and state[thread_team.BARRIER] == 0
    assert slots.tolist() == [-1] * 32


@njit(nogil=True)
def _clock():
    return thread_team.monotonic_ns()


def test_the_rendezvous_waits_a_time_not_a_count() -> None:
    """Called off only once ``RENDEZVOUS_NS`` has passed, however fast its waits return (a stalled
    vCPU's partner yields to nobody), on the clock Python's ``time.monotonic_ns`` reads."""
    before = time.monotonic_ns()
    now = _clock()
    assert before <= now <= time.monotonic_ns()
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        for _ in range(2):  # the first call compiles
            state, slots, mismatches = thread_team.new_state(2), np.full(32, -1, np.int64), np.zeros(2, np.int64)
            began = time.monotonic_ns()
            assert not _exchange(state, 2, slots, 1, mismatches)
            waited = time.monotonic_ns() - began
    finally:
        numba.set_num_threads(threads)
    assert waited >= thread_team.RENDEZVOUS_NS


def test_a_team_of_one_needs_nobody() -> None:
    state, slots, mismatches = thread_team.new_state(1), np.full(16, -1, np.int64), np.zeros(1, np.int64)
    assert _exchange(state, 1, slots, 10, mismatches)
    assert mismatches.tolist() == [0] and slots[0] == 9


@njit(parallel=True, nogil=True)
def _claim_all(state, team, ops, per_run, slow_member, owner):
    """``ops`` ops of ``team * per_run`` chunks: each member records the chunks it claims in
    ``owner[op, chunk]`` (+1 for each claim); ``slow_member`` dawdles over each of its chunks."""
    thread_team.reset(state, team)
    for member in prange(team):
        if thread_team.rendezvous(state, team):
            drawn = 0
            passed = 0
            for op in range(ops):
                chunk, step = thread_team.claim(state, member, team, 0, drawn, per_run)
                while chunk >= 0:
                    owner[op, chunk, member] += 1
                    if member == slow_member:
                        spins = 0
                        for _ in range(20000):
                            spins += 1
                            thread_team.spin_pause()
                    chunk, step = thread_team.claim(state, member, team, step, drawn, per_run)
                drawn += per_run + team
                passed += 1
                thread_team.barrier(state, team, passed)


def test_every_chunk_of_every_op_is_claimed_once_and_a_slow_member_gets_help() -> None:
    team, ops, per_run = numba.get_num_threads(), 50, 8
    if team < 2:
        raise AssertionError("this test needs numba's pool of two threads or more")
    state = thread_team.new_state(team)
    owner = np.zeros((ops, team * per_run, team), np.int64)
    _claim_all(state, team, ops, per_run, 0, owner)
    assert (owner.sum(axis=2) == 1).all()  # each chunk of each op once, by one member
    for run in range(team):
        assert state[thread_team.TICKETS + 8 * run] == ops * (per_run + team)
    # Member 0 is slow: the others, done with their own runs, take some of its run's chunks.
    assert owner[:, :per_run, 1:].sum() > 0
    assert owner[:, :per_run, 0].sum() > 0
