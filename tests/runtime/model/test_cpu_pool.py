"""CpuPool: every job once, side by side on its threads, BLAS held to one thread meanwhile and
given back after (errors included); row slices that cover a range exactly; prefill attention,
``silu_mul`` and ``rope_kv_append`` of a large step through it equal the kernels called alone."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from threadpoolctl import ThreadpoolController

from engines.runtime.model.backend import CpuBackend, StepInputs
from engines.runtime.model.cpu_pool import CpuPool, scratch
from engines.runtime.model.kernels import rope_kv, run_attention, silu_mul
from engines.runtime.model.kernels.rope_kv import rope_tables
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
    pool = CpuPool(threads=2)
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
    pool = CpuPool(threads=2)
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
    pool = CpuPool(threads=1)
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
    pool = CpuPool(threads=2)
    for start, end, first, seq in [(0, 300, 400, 0), (300, 700, 0, 1)]:
        alone = np.full((700, Q_HEADS * HEAD_DIM), np.nan, np.float32)
        side_by_side = alone.copy()
        run_attention.run_attention(qkv, start, end, first, seq, page_table, k, v, 1, Q_HEADS, scale, alone)
        run_attention.run_attention(qkv, start, end, first, seq, page_table, k, v, 1, Q_HEADS, scale, side_by_side,
                                    pool)
        assert not np.isnan(side_by_side[start:end]).any()
        np.testing.assert_allclose(side_by_side, alone, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("count", [0, 1, 2, 7, 100])
def test_row_slices_cover_the_range_once_in_order(two_blas_threads, count):
    pool = CpuPool(threads=2)
    slices: list[tuple[int, int]] = []
    pool.run_slices(lambda a, b: slices.append((a, b)), count)
    covered = [i for a, b in sorted(slices) for i in range(a, b)]
    assert covered == list(range(count))
    assert len(slices) == max(1, min(2, count))


def test_a_large_steps_elementwise_kernels_on_the_pool_equal_the_kernels_alone(two_blas_threads):
    """100 rows (past the decode sizes that use numba's threads): silu_mul and rope_kv_append
    through the backend, its pool at two threads, against one call of each kernel."""
    rng = np.random.default_rng(5)
    rows, width = 100, 24
    cpu = CpuBackend()
    cpu.cpu_pool = CpuPool(threads=2)

    gate_up = rng.standard_normal((rows, 2 * width)).astype(np.float32)
    got, want = np.full((rows, width), np.nan, np.float32), np.empty((rows, width), np.float32)
    cpu.silu_mul(gate_up, got)
    silu_mul.silu_mul_serial_cpu(gate_up, want)
    np.testing.assert_array_equal(got, want)

    # Two sequences (60 and 40 new tokens after some cached), the slice boundary inside the first.
    positions = np.concatenate([np.arange(5, 65), np.arange(0, 40)]).astype(np.int32)
    token_seq = np.repeat(np.array([0, 1], np.int32), [60, 40])
    page_table = rng.permutation(2 * 17).astype(np.int32).reshape(2, 17)
    picked = np.arange(rows, dtype=np.int32)
    step = StepInputs(token_ids=picked, positions=positions, token_seq=token_seq, page_table=page_table,
                      rows=picked, logit_rows=picked)
    cos, sin = rope_tables(HEAD_DIM, 10000.0, 128)
    qkv = rng.standard_normal((rows, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM)).astype(np.float32)
    cache_shape = (2, 34, KV_HEADS, PAGE_SIZE, HEAD_DIM)
    k, v = np.zeros(cache_shape, np.float32), np.zeros(cache_shape, np.float32)
    qkv_alone, k_alone, v_alone = qkv.copy(), k.copy(), v.copy()
    cpu.rope_kv_append(qkv, step, cos, sin, k, v, 1, Q_HEADS)
    rope_kv.rope_kv_append_cpu(qkv_alone, positions, token_seq, page_table, cos, sin, k_alone, v_alone, 1, Q_HEADS)
    np.testing.assert_array_equal(qkv, qkv_alone)
    np.testing.assert_array_equal(k, k_alone)
    np.testing.assert_array_equal(v, v_alone)
    assert np.count_nonzero(k[1]) > 0
