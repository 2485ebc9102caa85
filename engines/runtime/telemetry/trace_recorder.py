"""Event trace recorder: MLC's ``EventTraceRecorder``, exported as Chrome Trace Event Format.

The engine records what each request goes through (``"start prefill"``, ``"finish decode"``,
``"first token"``, ...) and ``/debug/dump_event_trace`` serialises it for Perfetto or
chrome://tracing. The contract is in ``docs/interfaces.md`` ("Event trace").

This module records: the :class:`TraceRecorder` (its bounded buffer, eviction, ``clear()``) and
the process's clock anchor. The exporters turn a :class:`~.trace_window.TraceWindow` (the raw
calls, taken under the recorder's lock) into the trace: ``chrome_trace.py`` is the fast one
``dump_json`` serves, ``chrome_trace_reference.py`` the plain-Python statement of the same rules
that the tests diff it against. The rules below are what both implement.

Tracing off means the engine holds ``None`` instead of a recorder, so the disabled path is a
single identity check, with no timestamp and no allocation. Every call site looks like::

    tracer = self.tracer
    if tracer is not None:
        tracer.add_event(request_ids, "start decode", {"batch_size": n}, engine_lane=True)

Recording is kept cheap (about a microsecond; see ``bench/trace_recorder.py``): one clock read
and one small tuple appended to a deque under a lock. Everything else (lanes, span pairing, the
``"X (n)"`` counters, ordering, JSON) happens at dump time in ``chrome_trace.py``, vectorised,
with the byte assembly in a numba loop, so a million events export in well under a second.

Choices the contract leaves open, and why:

* **Bounded buffer, newest window kept.** At most ``max_events`` trace events are held; past
  that the oldest recorded calls are evicted (ring buffer) and counted in ``dropped_events``.
  For a live server the recent past is what one debugs.
* **Spans cut by eviction, ``clear()`` or ``dump_json(clear=True)``.** A ``"finish X"`` whose
  ``"start X"`` is gone is omitted (counted in ``otherData.orphan_finishes``) rather than emitted
  as an ``E`` without a ``B``; a span still open at dump time is closed at the dump time with
  ``args.unclosed = true``.
* **Counters count within the retained window.** ``"decode (n)"`` is the nth ``start decode`` of
  the request among the events held, so after eviction a long request's first retained decode
  may be ``(0)``. Absolute numbering would need per-request state that outlives the window.
* **Pairing.** A finish closes the most recent unclosed start of the same name on its lane, and
  takes its name (``"decode (3)"``). Spans on one lane are expected to nest, as Chrome's ``B``/``E``
  require; the engine emits them that way.
* **Ordering.** The timestamp is read under the lock, so buffer order is timestamp order and,
  per lane, causal order (an ``at_ns`` older than events already held is sorted into place by
  its ``ts``, but pairs in recorded order). Within a lane, events at an equal ``ts`` keep that order except that
  the ``E``s closing spans begun earlier move first, innermost first (the contract's "E before
  B"; it also untangles a finish recorded late by another thread). An ``E`` whose ``B`` has the
  same ``ts`` stays after it, so a zero-length span never underflows.
"""
from __future__ import annotations

import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import orjson

from engines.runtime.telemetry.chrome_trace import export_json, json_bytes
from engines.runtime.telemetry.trace_window import RecordedCall, TraceWindow

__all__ = ["TraceRecorder", "TraceDelta", "DEFAULT_MAX_EVENTS",
           "DEFAULT_DELTA_CALLS", "DEFAULT_DELTA_BYTES", "epoch_anchor_ns", "set_epoch_anchor_ns"]

DEFAULT_MAX_EVENTS = 1_000_000
# A live reader takes at most this many calls a read: the lock is held while they are copied,
# so a reader that fell far behind catches up over several reads instead of stalling a step.
DEFAULT_DELTA_CALLS = 20_000
#: A read's ``calls_json`` stays under this: a websocket message has a size limit (Daphne's is 1 MiB).
DEFAULT_DELTA_BYTES = 512 * 1024

# One anchor per process: perf_counter_ns is monotonic (ts never goes backwards when the wall
# clock is adjusted) and high resolution; adding this offset once maps it onto the Unix epoch.
# Shared by every recorder so traces of several engines in one process line up.
_EPOCH_ANCHOR_NS = time.time_ns() - time.perf_counter_ns()


def epoch_anchor_ns() -> int:
    """This process's offset from the recorder clock to the Unix epoch, in nanoseconds."""
    return _EPOCH_ANCHOR_NS


def set_epoch_anchor_ns(anchor_ns: int) -> None:
    """Adopt another process's anchor (an engine process takes its server's), so that events
    recorded on both sides of the pipe land on one timeline to the nanosecond."""
    global _EPOCH_ANCHOR_NS
    _EPOCH_ANCHOR_NS = anchor_ns


@dataclass(frozen=True, slots=True)
class TraceDelta:
    """The calls recorded since a cursor (:meth:`TraceRecorder.read_since`), for a live viewer.

    ``calls_json`` is a JSON array, one ``[ts_us, [request ids], event, args, engine_lane]`` per
    ``add_event`` call in recorded order, ``ts_us`` on the dump's clock (µs since the Unix epoch)
    and ``args`` as the dump writes them (``null`` for none). Pairing, lanes and the ``"X (n)"``
    counters are the reader's to apply, by the rules of the dump (``trace_recorder``'s docstring).
    """

    calls_json: bytes
    calls: int          # how many calls ``calls_json`` holds
    recorder: str       # the recorder's identity: cursors mean nothing to another one
    cursor: int         # pass back to read on from here
    missed: int         # trace events evicted or cleared before this reader took them
    more: bool          # more calls are held past ``cursor`` (the read was capped)
    now_us: int         # the recorder clock at the read, µs since the Unix epoch
    held_events: int    # trace events the recorder holds now
    dropped_events: int  # trace events evicted since the last clear()


class TraceRecorder:
    """Records engine events per request and exports them as a Chrome trace (object form).

    Thread-safe: the engine thread records while server threads dump or clear.
    """

    def __init__(self, engine: str = "engine", model: str = "", backend: str = "",
                 max_events: int = DEFAULT_MAX_EVENTS, version: str = "dev", *,
                 clock: Callable[[], int] = time.perf_counter_ns) -> None:
        """``engine`` names the process in the trace; ``model``, ``backend`` and ``version`` go to
        ``otherData``; ``max_events`` bounds the buffer (trace events, not calls).

        ``clock`` is a monotonic nanosecond counter on ``time.perf_counter_ns``'s timebase (tests
        inject one to make timestamps collide on purpose).
        """
        if not isinstance(max_events, int) or max_events < 1:
            raise ValueError(f"max_events must be a positive integer, got {max_events!r}")
        self.engine = engine
        self.model = model
        self.backend = backend
        self.version = version
        self._max_events = max_events
        self._lock = threading.Lock()
        self._calls: deque[RecordedCall] = deque()   # oldest first
        self._held = 0      # trace events the held calls expand to
        self._dropped = 0   # trace events evicted since the last clear()
        # Cursors count trace events ever recorded: the held calls expand to events number
        # [_first_event, _next_event). Eviction and clear() move _first_event; nothing resets it.
        self._first_event = 0
        self._next_event = 0
        self.identity = uuid.uuid4().hex   # a cursor belongs to one recorder (an engine restart makes a new one)
        self._clock = clock

    # ------------------------------------------------------------------ recording

    def add_event(self, request_id: str | Iterable[str], event: str,
                  args: Mapping[str, Any] | None = None, engine_lane: bool = False,
                  at_ns: int | None = None) -> None:
        """Record ``event`` for one request or a batch of them, all with one timestamp.

        ``"start X"`` / ``"finish X"`` open and close span X; anything else is an instant.
        ``args`` (JSON-ready values) is attached to every lane's event; it is kept by reference,
        not copied, so don't mutate it afterwards. ``engine_lane=True`` records the event once
        more on the engine lane (tid 0), for batch-wide steps. ``at_ns`` is a timestamp taken
        earlier on the recorder clock's timebase (``time.perf_counter_ns``, system-wide on Linux),
        for events another process recorded, such as the server's tokenization.
        """
        if type(request_id) is str:
            ids: tuple[str, ...] = (request_id,)
        else:
            ids = tuple(request_id)
            if not ids and not engine_lane:
                return
        with self._lock:
            # Read the clock under the lock: buffer order is then timestamp order.
            self._calls.append((self._clock() if at_ns is None else at_ns, ids, event, args, engine_lane))
            n = len(ids) + engine_lane
            self._held += n
            self._next_event += n
            if self._held > self._max_events:
                self._evict()

    def _evict(self) -> None:
        # Called with the lock held. Whole calls go, oldest first, so a batch's events leave together.
        calls = self._calls
        while self._held > self._max_events and calls:
            _, ids, _, _, engine_lane = calls.popleft()
            n = len(ids) + engine_lane
            self._held -= n
            self._dropped += n
            self._first_event += n

    def clear(self) -> None:
        """Forget every recorded event and the dropped count (spans open now lose their start)."""
        with self._lock:
            self._calls.clear()
            self._held = 0
            self._dropped = 0
            self._first_event = self._next_event

    # ------------------------------------------------------------------ inspection

    @property
    def max_events(self) -> int:
        """The buffer bound, in trace events."""
        return self._max_events

    @property
    def event_count(self) -> int:
        """Trace events held now (before span pairing and closing at export)."""
        return self._held

    @property
    def dropped_events(self) -> int:
        """Trace events evicted by the bound since the last :meth:`clear`."""
        return self._dropped

    def request_ids(self) -> list[str]:
        """Request ids with events in the buffer, in first-seen order (their lanes' order)."""
        with self._lock:
            id_tuples = [c[1] for c in self._calls]
        return list(dict.fromkeys(chain.from_iterable(id_tuples)))

    # ------------------------------------------------------------------ export

    def snapshot(self, clear: bool = False) -> TraceWindow:
        """The held window as plain data, for an exporter; ``clear=True`` also empties the
        recorder in the same step under the lock (see :meth:`dump_json`)."""
        with self._lock:
            calls: Sequence[RecordedCall]
            if clear:
                # Swap in an empty buffer rather than copy: O(1) under the lock, so the engine
                # thread's add_event never waits on a large window being taken.
                calls, self._calls = self._calls, deque()
                dropped, self._held, self._dropped = self._dropped, 0, 0
                self._first_event = self._next_event
            else:
                calls, dropped = list(self._calls), self._dropped
            now_ns = self._clock()  # under the lock: no earlier than any event it timed
        return TraceWindow(calls, now_ns, _EPOCH_ANCHOR_NS, dropped, self._max_events,
                           self.engine, self.model, self.backend, self.version)

    def read_since(self, cursor: int = 0, max_calls: int = DEFAULT_DELTA_CALLS,
                   max_bytes: int = DEFAULT_DELTA_BYTES) -> TraceDelta:
        """The calls recorded since ``cursor`` (0, or the ``cursor`` of the previous read).

        Cheap while the engine runs: the lock is held only to copy references to the new calls,
        walking back from the newest, so a read costs what was recorded since the last one
        (capped at ``max_calls`` and ``max_bytes`` of JSON, though one call always comes; ``more``
        says to read again). Events evicted or cleared before
        they were read are counted in ``missed``, never silently skipped. A cursor ahead of the
        recorder (from another recorder, or a made-up one) is a ValueError.
        """
        if not isinstance(cursor, int) or cursor < 0:
            raise ValueError(f"cursor must be a non-negative integer, got {cursor!r}")
        if max_calls < 1 or max_bytes < 1:
            raise ValueError(f"max_calls and max_bytes must be positive, got {max_calls!r}, {max_bytes!r}")
        with self._lock:
            if cursor > self._next_event:
                raise ValueError(f"cursor {cursor} is ahead of the recorder ({self._next_event} events recorded)")
            missed = max(0, self._first_event - cursor)
            start = max(cursor, self._first_event)
            # The calls past `start`, found from the newest end: O(new calls), not O(held).
            new: list[RecordedCall] = []
            position = self._next_event
            for call in reversed(self._calls):
                if position <= start:
                    break
                new.append(call)
                position -= len(call[1]) + call[4]
            new.reverse()
            more = len(new) > max_calls
            if more:
                new = new[:max_calls]
            now_ns = self._clock()
            held, dropped = self._held, self._dropped
        anchor = _EPOCH_ANCHOR_NS
        rows = [((ns + anchor) // 1000, ids, event, args, engine_lane)
                for ns, ids, event, args, engine_lane in new]
        payload = json_bytes(rows)
        while len(payload) > max_bytes and len(rows) > 1:
            # Cut to the share that fits, with room to spare: one or two passes in practice.
            keep = max(1, min(len(rows) - 1, int(len(rows) * max_bytes / len(payload) * 0.9)))
            rows, new, more = rows[:keep], new[:keep], True
            payload = json_bytes(rows)
        end = start + sum(len(call[1]) + call[4] for call in new)
        return TraceDelta(payload, len(rows), self.identity, end, missed, more,
                          (now_ns + anchor) // 1000, held, dropped)

    def dump_json(self, clear: bool = False) -> bytes:
        """The trace as Chrome Trace Event Format JSON (object form), compact UTF-8 bytes.

        This is the fast path (``bench/trace_recorder.py`` times it: BENCHMARKS.md, "Engine");
        serve it as is.

        ``clear=True`` takes the window and empties the recorder in one step under the lock,
        so a trace saved in slices loses and repeats nothing: every event recorded meanwhile
        lands in exactly one slice (``dump_json()`` then ``clear()`` would drop those recorded
        between the two). A span open at the cut ends the slice with ``args.unclosed``, and
        its finish is an orphan in the next one, as after :meth:`clear`.
        """
        return export_json(self.snapshot(clear))

    def dump(self, clear: bool = False) -> dict[str, Any]:
        """The trace as a dict: exactly ``orjson.loads(self.dump_json(clear))``.

        Going through the bytes keeps one code path and builds the many small dicts in C.
        """
        return orjson.loads(export_json(self.snapshot(clear)))
