"""Host arrays that start on a page (or, when small, a cache-line) boundary.

NumPy takes a large array from ``malloc``, which maps it and returns the mapping's start plus its
16-byte chunk header: every weight matrix, KV cache and activation buffer then began 16 bytes
past a page, so each 64-byte vector load of a row (512 bits, the kernels' width on AVX-512)
straddled two cache lines, and a 2 KB weight row touched 33 lines where 32 hold it. The batched
matmul kernels, which read each weight line from L1 once per input row, ran markedly longer for
it, and longer still than over a page-aligned copy at 64 bytes past a page, so large arrays are
page-aligned. Batch-1 steps, bound by memory rather than by loads, neither gain nor lose beyond
the noise; one process a commit is no sample there, since a process's batch-1 rate moves with
where its memory lands (docs/perf-log/cpu-anchors.md#2026-11-26-zen4-page-aligned-reverted and
#2026-11-26-zen4-page-aligned-noise).
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

__all__ = ["PAGE_BYTES", "LINE_BYTES", "aligned_copy", "aligned_empty", "alignment_of", "available_bytes"]

PAGE_BYTES = 4096
LINE_BYTES = 64


def alignment_of(nbytes: int) -> int:
    """The boundary an array of ``nbytes`` starts on: a page from a page's size up, else a cache line."""
    return PAGE_BYTES if nbytes >= PAGE_BYTES else LINE_BYTES


def aligned_empty(shape: int | tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on :func:`alignment_of` its size.

    A view into a slightly larger byte buffer (its ``base``), which it keeps alive."""
    dtype = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    align = alignment_of(nbytes)
    raw = np.empty(nbytes + align, np.uint8)
    start = -raw.ctypes.data % align
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def aligned_copy(array: Any, dtype: Any) -> np.ndarray:
    """A C-contiguous copy of ``array`` in ``dtype``, aligned as :func:`aligned_empty`'s."""
    source = np.asarray(array)
    out = aligned_empty(source.shape, dtype)
    out[...] = source
    return out


def available_bytes() -> int | None:
    """Memory the machine can give without swapping (``MemAvailable``: free plus reclaimable
    caches), or None where the kernel does not say."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None
