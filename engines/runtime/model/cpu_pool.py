"""The CPU backend's own threads, one per core, for work BLAS does not do in a prefill step.

Attention's matrix products in a prefill are small (an inner dimension of ``head_dim``, a few
hundred query rows a tile): split over BLAS's threads, each call pays a fork and join that its
work barely covers, and the softmax between two calls runs on one core. Running whole heads
side by side instead, one per core with BLAS held to one thread, keeps every core busy through
products and softmax alike (the way PyTorch's CPU attention parallelises over heads). A prefill
step's ``silu_mul`` and ``rope_kv_append`` run here too, in row slices: numba's own thread pool
would spin after each loop and take the core from BLAS's next call. Both measured in
docs/perf-log/cpu-anchors.md#2026-11-25-long-weight-streams.

BLAS's thread count is process-wide, so it is lowered for the length of :meth:`CpuPool.run`
and restored after it. Two engines computing in one process at the same moment would slow each
other's BLAS calls while one of them is in here, never change results.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable

import numpy as np
from threadpoolctl import ThreadpoolController

__all__ = ["CpuPool", "scratch"]

_local = threading.local()


def scratch(size: int) -> np.ndarray:
    """A float32 buffer of at least ``size`` elements, this thread's own, kept between calls
    (a step's tiles reuse it instead of mapping fresh pages for every product)."""
    buffer = getattr(_local, "buffer", None)
    if buffer is None or buffer.size < size:
        buffer = _local.buffer = np.empty(max(size, 1 << 16), dtype=np.float32)
    return buffer[:size]


class CpuPool:
    """Runs independent jobs on ``threads`` threads (the calling one among them) with BLAS
    single-threaded meanwhile, or one after the other on the calling thread when there is a
    single thread or no BLAS library whose threads can be held to one (running BLAS's own
    threads beside ours would oversubscribe the cores ten times over)."""

    def __init__(self, threads: int | None = None) -> None:
        controller = ThreadpoolController()
        self._blas = controller.select(user_api="blas")
        blas_threads = max((lib["num_threads"] for lib in self._blas.info()), default=1)
        wanted = threads if threads is not None else min(blas_threads, os.cpu_count() or 1)
        self.threads = wanted if len(self._blas.lib_controllers) else 1
        self._executor = ThreadPoolExecutor(self.threads - 1, "cpu-pool") if self.threads > 1 else None

    def run(self, job: Callable[[int], Any], items: Iterable[int]) -> None:
        """``job(item)`` for each item; returns when all are done, raising the first error."""
        items = list(items)
        if self._executor is None or len(items) < 2:
            for item in items:
                job(item)
            return
        # Items are taken from a shared iterator, so a thread that finishes early takes the next.
        source = iter(items)
        lock = threading.Lock()

        def drain() -> None:
            while True:
                with lock:
                    item = next(source, None)
                if item is None:
                    return
                job(item)

        with self._blas.limit(limits=1):
            helpers = [self._executor.submit(drain) for _ in range(min(self.threads, len(items)) - 1)]
            try:
                drain()
            finally:
                for helper in helpers:
                    helper.result()

    def run_slices(self, job: Callable[[int, int], Any], count: int) -> None:
        """``job(start, end)`` over ``range(count)`` cut into one contiguous slice a thread."""
        parts = max(1, min(self.threads, count))
        bounds = [count * i // parts for i in range(parts + 1)]
        self.run(lambda i: job(bounds[i], bounds[i + 1]), range(parts))
