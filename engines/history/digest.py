"""A trace's bytes turned into what the history stores: checked, compressed and analysed.

:func:`digest_trace` does it in the calling process. A server runs it in a process of its own
(:class:`DigestProcess`, started by ``manage.py serve``): parsing a minute of a busy engine's
trace makes about a million small objects (~100 MiB) at every autosave, and in the serving
process their churn, interleaved with the event loop's own allocations, left the allocator
holding ever more memory (bench/soak.py: +3 MiB a minute after every other fix;
docs/perf-log/serving-and-tools.md#soak). In a process of its own the parse costs the server
nothing but the bytes it sends, and the process is replaced every :data:`DIGESTS_PER_PROCESS`
digests, so its memory is bounded too. Nothing here touches the database.
"""
from __future__ import annotations

import gc
import logging
import multiprocessing
import os
from collections.abc import Iterator, Mapping
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import orjson

from engines.server.child_lifetime import start_django_child
from engines.history.analysis import TraceAnalysis, TraceFormatError, analyze_trace, trace_events
from engines.history.payload import StoredPayload, compress_json

__all__ = ["DIGESTS_PER_PROCESS", "DigestProcess", "digest_trace"]

logger = logging.getLogger(__name__)

_compressor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="trace-gzip")
#: Digests a digest process makes before a fresh one replaces it (its memory bounded by one digest).
DIGESTS_PER_PROCESS = 20


def digest_trace(trace: Mapping[str, Any] | list[Any] | bytes) -> tuple[TraceAnalysis, StoredPayload]:
    """Check that ``trace`` (a Chrome trace, or its JSON bytes) is one, compress its JSON and
    analyse it, in this process. Bytes are stored exactly as given.

    Raises :class:`TraceFormatError` (a ``ValueError``) for something that is not a Chrome trace.
    """
    # The collector stays paused over parsing and analysis: see _gc_paused.
    with _gc_paused():
        if isinstance(trace, (bytes, bytearray, memoryview)):
            raw = bytes(trace)
            try:
                parsed = orjson.loads(raw)
            except orjson.JSONDecodeError as exc:
                raise TraceFormatError(f"the trace is not valid JSON: {exc}") from exc
            trace_events(parsed)
        else:
            parsed = trace
            trace_events(parsed)  # fail on a non-trace before spending time on it
            try:
                raw = orjson.dumps(parsed, option=orjson.OPT_SERIALIZE_NUMPY)
            except TypeError as exc:
                raise TraceFormatError(f"the trace cannot be serialised as JSON: {exc}") from exc

        compressing = _compressor.submit(compress_json, raw)
        try:
            analysis = analyze_trace(parsed)
        finally:
            stored = compressing.result()  # never leave the worker busy behind an exception
        # Free a trace parsed here by reference counting, before the collector resumes
        # and would walk its millions of objects once more.
        del parsed
    return analysis, stored


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while a large trace is parsed and walked.

    Parsing a million events allocates millions of dicts, and the allocation bursts
    trigger collections that walk every young object again and again, several times the
    parse's own work; resumed between parsing and the analysis, the collector slows the
    whole save as much (bench/trace_history.py; docs/perf-log/code-comments.md#gc-paused).
    Nothing built here forms reference cycles. The
    collector is re-enabled only if it was on (another thread may be doing the same).
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class DigestProcess:
    """:func:`digest_trace` for bytes, run in a child process (spawned: a fresh interpreter, none of
    the server's threads) that ends with the server however it ends. Thread-safe: the pool queues."""

    def __init__(self, digests_per_process: int = DIGESTS_PER_PROCESS) -> None:
        self._pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                                         initializer=start_django_child, initargs=(os.getpid(),),
                                         max_tasks_per_child=digests_per_process)

    def digest(self, raw: bytes) -> tuple[TraceAnalysis, StoredPayload]:
        """``digest_trace(raw)`` in the child; its exceptions are raised here."""
        return self._pool.submit(digest_trace, raw).result()

    def child_pid(self) -> int | None:
        """The current child's pid (None before the first digest)."""
        processes = getattr(self._pool, "_processes", None) or {}
        return next(iter(processes), None)

    def warm(self) -> None:
        """Start the child now (an import of a few modules), not at the first save."""
        self._pool.submit(os.getpid).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
