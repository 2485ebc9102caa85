"""HeadPool: every head once, side by side on its threads, BLAS held to one thread meanwhile and
given back after (errors included); prefill attention through it equals attention without it."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from threadpoolctl import ThreadpoolController

from engines.runtime.model.head_pool import HeadPool, scratch
from engines.runtime.model.kernels import run_attention
from tests.runtime.model.test_kernels import HEAD_DIM, KV_HEADS, PAGE_SIZE, Q_HEADS


def blas_threads() -> int:
    return max(lib["num_threads"] for lib in ThreadpoolController().select(user_api="blas").info())


@pytest.fixture
def two_blas_threads():
    """BLAS at two threads for the test, whatever this machine's default (restored after)."""
    blas = ThreadpoolController().select(user_api="blas")
    with blas.limit(limits=2):
        yield


def test_every_head_runs_once_on_two_threads_with_blas_single_threaded(two_blas_threads):
    pool = HeadPool(threads=2)
    assert pool.threads == 2
    seen: list[tuple[int, str, int]] = []
    lock = threading.Lock()

    def job(head: int) -> None:
        time.sleep(0.01)  # long enough that the helper thread takes some of the heads
        with lock:
            seen.append((head, threading.current_thread().name, blas_threads()))

    pool.run(job, range(6))
    assert sorted(head for head, _, _ in seen) == list(range(6))
    assert len({name for _, name, _ in seen}) == 2
    assert {threads for _, _, threads in seen} == {1}
    assert blas_threads() == 2


def test_an_error_in_a_job_reaches_the_caller_and_blas_gets_its_threads_back(two_blas_threads):
    pool = HeadPool(threads=2)
    done: list[int] = []

    def job(head: int) -> None:
        if head == 3:
            raise ValueError("head 3")
        done.append(head)

    with pytest.raises(ValueError, match="head 3"):
        pool.run(job, range(8))
    assert sorted(done) == [0, 1, 2, 4, 5, 6, 7]  # the other heads still ran
    assert blas_threads() == 2
    pool.run(done.append, [10, 11])  # and the pool still works
    assert done[-2:] in ([10, 11], [11, 10])


def test_one_thread_runs_the_heads_in_order_on_the_calling_thread():
    pool = HeadPool(threads=1)
    names: list[tuple[int, str]] = []
    pool.run(lambda head: names.append((head, threading.current_thread().name)), range(4))
    assert names == [(h, threading.current_thread().name) for h in range(4)]


def test_scratch_is_per_thread_and_kept():
    first = scratch(100)
    assert first.dtype == np.float32 and first.size == 100
    assert np.shares_memory(scratch(50), first)
    other: list[np.ndarray] = []
    thread = threading.Thread(target=lambda: other.append(scratch(100)))
    thread.start()
    thread.join()
    assert not np.shares_memory(other[0], first)


def test_prefill_attention_through_the_pool_equals_attention_without_it(two_blas_threads):
    """Two runs (one after cached keys, several tiles; one from position 0): each query head's
    output is the same with heads side by side as one after the other."""
    rng = np.random.default_rng(3)
    pages_per_seq = -(-700 // PAGE_SIZE)
    page_table = rng.permutation(2 * pages_per_seq).astype(np.int32).reshape(2, pages_per_seq)
    shape = (2, 2 * pages_per_seq, KV_HEADS, PAGE_SIZE, HEAD_DIM)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    qkv = rng.standard_normal((700, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM)).astype(np.float32)
    scale = np.float32(HEAD_DIM ** -0.5)
    pool = HeadPool(threads=2)
    for start, end, first, seq in [(0, 300, 400, 0), (300, 700, 0, 1)]:
        alone = np.full((700, Q_HEADS * HEAD_DIM), np.nan, np.float32)
        side_by_side = alone.copy()
        run_attention.run_attention(qkv, start, end, first, seq, page_table, k, v, 1, Q_HEADS, scale, alone)
        run_attention.run_attention(qkv, start, end, first, seq, page_table, k, v, 1, Q_HEADS, scale, side_by_side,
                                    pool)
        assert not np.isnan(side_by_side[start:end]).any()
        np.testing.assert_allclose(side_by_side, alone, rtol=1e-6, atol=1e-7)
