"""Independent per-head jobs on the host's cores, each with single-threaded BLAS.

Attention's matrix products in a prefill are small (an inner dimension of ``head_dim``, a few
hundred query rows a tile): split over BLAS's threads, each call pays a fork and join that its
work barely covers, and the softmax between two calls runs on one core. Running whole heads
side by side instead, one per core with BLAS held to one thread, keeps every core busy through
products and softmax alike (the way PyTorch's CPU attention parallelises over heads): a
2048-token prefill layer's attention went from 54 to 40 ms on 2 cores.

BLAS's thread count is process-wide, so it is lowered for the length of :meth:`HeadPool.run`
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

__all__ = ["HeadPool", "scratch"]

_local = threading.local()


def scratch(size: int) -> np.ndarray:
    """A float32 buffer of at least ``size`` elements, this thread's own, kept between calls
    (a step's tiles reuse it instead of mapping fresh pages for every product)."""
    buffer = getattr(_local, "buffer", None)
    if buffer is None or buffer.size < size:
        buffer = _local.buffer = np.empty(max(size, 1 << 16), dtype=np.float32)
    return buffer[:size]


class HeadPool:
    """Runs ``job(head)`` for every head on ``threads`` threads (the calling one among them)
    with BLAS single-threaded meanwhile, or one after the other on the calling thread when
    there is a single thread or no BLAS library whose threads can be held to one (running
    BLAS's own threads beside ours would oversubscribe the cores ten times over)."""

    def __init__(self, threads: int | None = None) -> None:
        controller = ThreadpoolController()
        self._blas = controller.select(user_api="blas")
        blas_threads = max((lib["num_threads"] for lib in self._blas.info()), default=1)
        wanted = threads if threads is not None else min(blas_threads, os.cpu_count() or 1)
        self.threads = wanted if len(self._blas.lib_controllers) else 1
        self._executor = ThreadPoolExecutor(self.threads - 1, "head-pool") if self.threads > 1 else None

    def run(self, job: Callable[[int], Any], heads: Iterable[int]) -> None:
        """``job(head)`` for each head; returns when all are done, raising the first error."""
        heads = list(heads)
        if self._executor is None or len(heads) < 2:
            for head in heads:
                job(head)
            return
        # Heads are taken from a shared iterator, so a thread that finishes early takes the next.
        source = iter(heads)
        lock = threading.Lock()

        def drain() -> None:
            while True:
                with lock:
                    head = next(source, None)
                if head is None:
                    return
                job(head)

        with self._blas.limit(limits=1):
            helpers = [self._executor.submit(drain) for _ in range(min(self.threads, len(heads)) - 1)]
            try:
                drain()
            finally:
                for helper in helpers:
                    helper.result()
