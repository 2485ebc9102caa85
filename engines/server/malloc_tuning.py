"""glibc's allocator set for a long-lived server process that parses big traces now and then.

A trace save parses tens of MB of JSON on a worker thread, then frees it. Left at its defaults,
glibc gives each new thread an arena of its own (up to eight per core) and raises its mmap
threshold after the first big free, so those buffers land in arenas that never shrink: the
soak (``bench/soak.py``) saw the server's RSS climb from 272 to 535 MiB in ten minutes while the
Python heap stayed flat (tracemalloc). Two arenas, a fixed 1 MiB mmap threshold (big buffers
are mapped and unmapped whole), and a trim after each save keep it flat: the remedy gunicorn's
and CPython's own docs give for the same symptom. No-ops off glibc.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

__all__ = ["tune_malloc", "trim_malloc"]

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h).
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
#: Arenas for the whole process: the event loop's thread and one for every worker thread.
ARENA_MAX = 2
#: Allocations at least this large are mapped on their own and returned to the OS when freed.
MMAP_THRESHOLD = 1 << 20


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


_LIBC = _libc()


def tune_malloc() -> bool:
    """Set the arena count and mmap threshold (before the server's threads start); whether the
    allocator took them (False off glibc)."""
    if _LIBC is None:
        return False
    applied = bool(_LIBC.mallopt(_M_ARENA_MAX, ARENA_MAX)) and bool(_LIBC.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    if not applied:
        logger.warning("malloc: glibc refused the arena and mmap settings; RSS may grow after big trace saves")
    return applied


def trim_malloc() -> bool:
    """Give the free pages of every arena back to the OS (after a big parse); whether any were."""
    return bool(_LIBC.malloc_trim(0)) if _LIBC is not None else False
