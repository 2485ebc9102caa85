"""The simulator's shared arrays (tests/cudasim_shared_arrays.py): every thread of a block gets
the one array of its call site, however the threads interleave."""
from __future__ import annotations

import os
import sys
import threading

import numpy as np
import pytest
from numba.cuda.simulator import kernelapi

pytestmark = pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") != "1",
                                reason="the simulator is not on (ENGINES_TEST_GPU=1): nothing of it is patched")


def arrays_one_block_got(threads: int) -> int:
    """How many distinct arrays ``threads`` threads of one block got from one call site."""
    shared = kernelapi.FakeCUDAShared(0)
    got: list[object] = [None] * threads
    start = threading.Barrier(threads)

    def thread(i: int) -> None:
        start.wait()
        got[i] = shared.array((2, 8, 32), np.float32)

    running = [threading.Thread(target=thread, args=(i,)) for i in range(threads)]
    for t in running:
        t.start()
    for t in running:
        t.join()
    return len({id(array) for array in got})


def test_every_thread_of_a_block_gets_the_one_array_of_its_call_site() -> None:
    # Switching threads every microsecond, the simulator's own look-up-then-store gave a block of
    # 64 threads two arrays or more in about one trial of ten (20 of 200 here).
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        counts = [arrays_one_block_got(64) for _ in range(200)]
    finally:
        sys.setswitchinterval(previous)
    assert counts == [1] * 200
