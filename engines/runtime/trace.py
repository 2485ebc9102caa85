"""Event trace recorder: MLC's ``EventTraceRecorder``, exported as Chrome Trace Event Format.

The engine records what each request goes through (``"start prefill"``, ``"finish decode"``,
``"first token"``, ...) and ``/debug/dump_event_trace`` serialises it for Perfetto or
chrome://tracing. The contract is in ``docs/interfaces.md`` ("Event trace").

Tracing off means the engine holds ``None`` instead of a recorder, so the disabled path is a
single identity check, with no timestamp and no allocation. Every call site looks like::

    tracer = self.tracer
    if tracer is not None:
        tracer.add_event(request_ids, "start decode", {"batch_size": n}, engine_lane=True)

Recording is kept cheap (about a microsecond; see ``bench/trace_recorder.py``): one clock read
and one small tuple appended to a deque under a lock. Everything else (lanes, span pairing, the
``"X (n)"`` counters, ordering, JSON) happens at dump time, vectorised, with the byte assembly in
a numba loop, so a million events export in well under a second.

Choices the contract leaves open, and why:

* **Bounded buffer, newest window kept.** At most ``max_events`` trace events are held; past
  that the oldest recorded calls are evicted (ring buffer) and counted in ``dropped_events``.
  For a live server the recent past is what one debugs.
* **Spans cut by eviction or ``clear()``.** A ``"finish X"`` whose ``"start X"`` is gone is
  omitted (counted in ``otherData.orphan_finishes``) rather than emitted as an ``E`` without a
  ``B``; a span still open at dump time is closed at the dump time with ``args.unclosed = true``.
* **Counters count within the retained window.** ``"decode (n)"`` is the nth ``start decode`` of
  the request among the events held, so after eviction a long request's first retained decode
  may be ``(0)``. Absolute numbering would need per-request state that outlives the window.
* **Pairing.** A finish closes the most recent unclosed start of the same name on its lane, and
  takes its name (``"decode (3)"``). Spans on one lane are expected to nest, as Chrome's ``B``/``E``
  require; the engine emits them that way.
* **Ordering.** The timestamp is read under the lock, so buffer order is timestamp order and,
  per lane, causal order. Within a lane, events at an equal ``ts`` keep that order except that an
  ``E`` closing an earlier-started span moves before them (the contract's "E before B"); an ``E``
  whose ``B`` has the same ``ts`` stays after it, so a zero-length span never underflows.
"""
from __future__ import annotations

import functools
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from itertools import chain
from operator import itemgetter
from typing import Any

import numba
import numpy as np
import orjson

__all__ = ["TraceRecorder", "DEFAULT_MAX_EVENTS"]

DEFAULT_MAX_EVENTS = 1_000_000

# One anchor per process: perf_counter_ns is monotonic (ts never goes backwards when the wall
# clock is adjusted) and high resolution; adding this offset once maps it onto the Unix epoch.
# Shared by every recorder so traces of several engines in one process line up.
_EPOCH_ANCHOR_NS = time.time_ns() - time.perf_counter_ns()

_PID = 1
_ENGINE_TID = 0

# Event kinds.
_B, _E, _I = 0, 1, 2


class TraceRecorder:
    """Records engine events per request and exports them as a Chrome trace (object form).

    Thread-safe: the engine thread records while server threads dump or clear.
    """

    def __init__(self, engine: str = "engine", model: str = "", backend: str = "",
                 max_events: int = DEFAULT_MAX_EVENTS, version: str = "dev") -> None:
        """``engine`` names the process in the trace; ``model``, ``backend`` and ``version`` go to
        ``otherData``; ``max_events`` bounds the buffer (trace events, not calls)."""
        if not isinstance(max_events, int) or max_events < 1:
            raise ValueError(f"max_events must be a positive integer, got {max_events!r}")
        self.engine = engine
        self.model = model
        self.backend = backend
        self.version = version
        self._max_events = max_events
        self._lock = threading.Lock()
        # (clock_ns, request_ids tuple, event, args or None, engine_lane) per call, oldest first.
        self._calls: deque[tuple[int, tuple[str, ...], str, Mapping[str, Any] | None, bool]] = deque()
        self._held = 0      # trace events the held calls expand to
        self._dropped = 0   # trace events evicted since the last clear()
        self._clock = time.perf_counter_ns

    # ------------------------------------------------------------------ recording

    def add_event(self, request_id: str | Iterable[str], event: str,
                  args: Mapping[str, Any] | None = None, engine_lane: bool = False) -> None:
        """Record ``event`` for one request or a batch of them, all with one timestamp.

        ``"start X"`` / ``"finish X"`` open and close span X; anything else is an instant.
        ``args`` (JSON-ready values) is attached to every lane's event; it is kept by reference,
        not copied, so don't mutate it afterwards. ``engine_lane=True`` records the event once
        more on the engine lane (tid 0), for batch-wide steps.
        """
        if type(request_id) is str:
            ids: tuple[str, ...] = (request_id,)
        else:
            ids = tuple(request_id)
            if not ids and not engine_lane:
                return
        with self._lock:
            # Read the clock under the lock: buffer order is then timestamp order.
            self._calls.append((self._clock(), ids, event, args, engine_lane))
            self._held += len(ids) + engine_lane
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

    def clear(self) -> None:
        """Forget every recorded event and the dropped count (spans open now lose their start)."""
        with self._lock:
            self._calls.clear()
            self._held = 0
            self._dropped = 0

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

    def dump_json(self) -> bytes:
        """The trace as Chrome Trace Event Format JSON (object form), compact UTF-8 bytes.

        This is the fast path (≈0.5 µs per event); serve it as is.
        """
        return _export(self)

    def dump(self) -> dict[str, Any]:
        """The trace as a dict: exactly ``orjson.loads(self.dump_json())``.

        Going through the bytes keeps one code path and builds the many small dicts in C.
        """
        return orjson.loads(_export(self))


# ====================================================================== export
#
# An exported event is the concatenation of byte segments from a small table plus two numbers:
#
#   {"name":"decode  +  ' (3)"'  +  ,"cat":"request","ph":"B","ts":  +  <ts>
#     + ,"pid":1,"tid":7,"args":{"request_id":"<id>"  +  ,"batch_size":3}  +  }
#
# Python builds the table (one entry per distinct name, lane, args dict, engine batch) and
# per-event segment ids with numpy; numba copies the bytes. No per-event Python object is made.

def _json_default(value: Any) -> Any:
    # Args come from engine code: a non-dict mapping becomes an object; anything else orjson
    # can't serialise is better shown as its str() than failing the whole dump.
    if isinstance(value, Mapping):
        return dict(value)
    return str(value)


# numpy scalars are common in args (batch sizes from array lengths).
_json = functools.partial(orjson.dumps, default=_json_default, option=orjson.OPT_SERIALIZE_NUMPY)

# Fixed segments, at known ids (the numba assembler uses these ids as constants).
_FIXED_SEGMENTS = (
    # phase: id = kind * 2 + (1 on the engine lane)
    b',"cat":"request","ph":"B","ts":',
    b',"cat":"engine","ph":"B","ts":',
    b',"cat":"request","ph":"E","ts":',
    b',"cat":"engine","ph":"E","ts":',
    b',"cat":"request","ph":"i","s":"t","ts":',
    b',"cat":"engine","ph":"i","s":"t","ts":',
    b"}}",                                          # 6: close args and event
    b',"unclosed":true}}',                          # 7: span closed at dump, request lane
    b'"unclosed":true}}',                           # 8: same on the engine lane (args empty so far)
    b'"request_ids":',                              # 9: engine lane: the batch instead of one id
    b',"pid":%d,"tid":%d,"args":{' % (_PID, _ENGINE_TID),  # 10: engine lane
)
_SEG_CLOSE = 6
_SEG_UNCLOSED_REQUEST = 7
_SEG_UNCLOSED_ENGINE = 8
_SEG_REQUEST_IDS = 9
_SEG_ENGINE_LANE = 10

_get_ns, _get_ids, _get_event, _get_args, _get_engine_lane = (itemgetter(i) for i in range(5))


def _export(rec: TraceRecorder) -> bytes:
    """Serialise ``rec``: copy under the lock, then pair, order and assemble outside it."""
    with rec._lock:
        calls = list(rec._calls)
        dropped = rec._dropped
        now_ns = rec._clock()  # >= every recorded timestamp: closes still-open spans
    now_us = (now_ns + _EPOCH_ANCHOR_NS) // 1000
    if not calls:
        header, trailer = _frame(rec, [], event_count=0, dropped=dropped, first_ts=None,
                                 last_ts=None, unclosed=0, orphans=0)
        return header + trailer

    # -- columns per call
    n_calls = len(calls)
    call_ts = np.fromiter(map(_get_ns, calls), np.int64, n_calls)
    call_ts += _EPOCH_ANCHOR_NS
    call_ts //= 1000
    ids_col = list(map(_get_ids, calls))
    ev_col = list(map(_get_event, calls))
    args_col = list(map(_get_args, calls))
    call_eng = np.fromiter(map(_get_engine_lane, calls), np.bool_, n_calls)
    del calls
    events = list(dict.fromkeys(ev_col))
    ev_code = dict(zip(events, range(len(events))))
    call_ev = np.fromiter(map(ev_code.__getitem__, ev_col), np.int64, n_calls)
    del ev_col

    # -- rows: one per (call, request id), then one per engine-lane call. Within every lane,
    #    row order is call order, which is timestamp order: pairing and ordering rely on it.
    flat_ids = list(chain.from_iterable(ids_col))
    lane_ids = list(dict.fromkeys(flat_ids))           # tid = position + 1, first-seen order
    tid_of = dict(zip(lane_ids, range(1, len(lane_ids) + 1)))
    req_tid = np.fromiter(map(tid_of.__getitem__, flat_ids), np.int64, len(flat_ids))
    n_req = len(flat_ids)
    del flat_ids, tid_of
    req_call = np.repeat(np.arange(n_calls, dtype=np.int64),
                         np.fromiter(map(len, ids_col), np.int64, n_calls))
    eng_call = np.flatnonzero(call_eng)
    row_call = np.concatenate((req_call, eng_call))
    row_tid = np.concatenate((req_tid, np.zeros(eng_call.size, np.int64)))
    row_ev = call_ev[row_call]
    row_ts = call_ts[row_call]
    n_rows = row_call.size
    n_lanes = len(lane_ids) + 1

    # -- distinct event strings: kind, span name, name segment
    segs = list(_FIXED_SEGMENTS)
    n_ev = len(events)
    ev_kind = np.empty(n_ev, np.int8)
    ev_base = np.full(n_ev, -1, np.int64)       # span name id for start/finish, -1 for instants
    ev_nameseg = np.empty(n_ev, np.int64)
    bases: dict[str, tuple[int, int]] = {}      # span name -> (id, name segment)
    for i, event in enumerate(events):
        kind, name = _classify(event)
        ev_kind[i] = kind
        if kind == _I:
            ev_nameseg[i] = len(segs)
            segs.append(b'{"name":' + _json(name))
            continue
        if name not in bases:
            bases[name] = (len(bases), len(segs))
            segs.append(b'{"name":' + _json(name)[:-1])  # left open: ' (n)"' completes it
        ev_base[i], ev_nameseg[i] = bases[name]
    row_kind = ev_kind[row_ev]

    # -- pair spans per (lane, span name)
    n_bases = len(bases)
    is_span = row_kind != _I
    group = np.full(n_rows, -1, np.int64)
    n_groups = 0
    if n_bases:
        key = row_tid[is_span] * n_bases + ev_base[row_ev[is_span]]
        if n_lanes * n_bases <= 8 * n_rows + 1024:
            group[is_span] = key
            n_groups = n_lanes * n_bases
        else:  # many lanes x names: compact the keys rather than allocate a huge table
            uniq, group[is_span] = np.unique(key, return_inverse=True)
            n_groups = uniq.size
    partner, counter, unclosed = _pair_spans(group, row_kind, n_groups)
    orphan = (row_kind == _E) & (partner < 0)
    n_orphans = int(np.count_nonzero(orphan))

    # -- output events: the kept rows, then a closing E for every open span (innermost first)
    keep = np.flatnonzero(~orphan)
    open_rows = np.flatnonzero(unclosed)[::-1]
    src = np.concatenate((keep, open_rows))
    n_out, n_keep = src.size, keep.size
    out_tid = row_tid[src]
    out_ts = row_ts[src]
    out_ts[n_keep:] = now_us
    out_kind = row_kind[src].astype(np.int64)
    out_kind[n_keep:] = _E
    out_eng = out_tid == _ENGINE_TID
    out_counter = counter[src]
    out_start = partner[src]              # for an E, the row of its B
    out_start[n_keep:] = open_rows

    # "E before B at equal ts": an E whose B started earlier goes first in its equal-ts run.
    key2 = np.ones(n_out, np.int8)
    e_out = np.flatnonzero(out_kind == _E)
    key2[e_out[row_ts[out_start[e_out]] < out_ts[e_out]]] = 0
    order = _lane_order(out_tid, out_ts, key2, n_lanes)
    if order is None:  # unreachable while timestamps come from the lock-held monotonic clock
        order = np.lexsort((np.arange(n_out), key2, out_ts, out_tid))

    # -- lanes, args and engine batches as segments
    rid_json = list(map(_json, lane_ids))
    lane_seg = np.empty(n_lanes, np.int64)
    lane_seg[_ENGINE_TID] = _SEG_ENGINE_LANE
    lane_seg[1:] = np.arange(len(segs), len(segs) + len(lane_ids))
    segs.extend([b',"pid":%d,"tid":%d,"args":{"request_id":%s' % (_PID, t, j)
                 for t, j in enumerate(rid_json, 1)])
    call_argseg = np.full(n_calls, -1, np.int64)
    arg_calls = np.flatnonzero(np.fromiter(map(bool, args_col), np.bool_, n_calls))
    if arg_calls.size:
        call_argseg[arg_calls] = np.arange(len(segs), len(segs) + arg_calls.size)
        segs.extend(map(_json, map(args_col.__getitem__, arg_calls.tolist())))
    row_idsseg = np.full(n_rows, -1, np.int64)
    row_idsseg[n_req:] = np.arange(len(segs), len(segs) + eng_call.size)
    segs.extend(map(_json, map(ids_col.__getitem__, eng_call.tolist())))
    del args_col, ids_col

    out_name = ev_nameseg[row_ev[src]]
    out_phase = out_kind * 2 + out_eng
    out_mid = lane_seg[out_tid]
    out_args = call_argseg[row_call[src]]
    out_ids = row_idsseg[src]
    out_fixed = np.full(n_out, -1, np.int64)
    out_fixed[n_keep:] = np.where(out_eng[n_keep:], _SEG_UNCLOSED_ENGINE, _SEG_UNCLOSED_REQUEST)
    out_args[n_keep:] = -1
    out_ids[n_keep:] = -1

    blob = np.frombuffer(b"".join(segs), np.uint8)
    seg_len = np.zeros(len(segs) + 1, np.int64)  # the extra 0 is the length of id -1 (absent)
    seg_len[:-1] = np.fromiter(map(len, segs), np.int64, len(segs))
    seg_off = np.zeros(len(segs), np.int64)
    np.cumsum(seg_len[:-2], out=seg_off[1:])
    del segs

    header, trailer = _frame(
        rec, rid_json, event_count=n_out, dropped=dropped, first_ts=int(out_ts.min()),
        last_ts=int(out_ts.max()), unclosed=int(open_rows.size), orphans=n_orphans)
    # Segments, plus at most: 20 ts digits, ' (n)"' with 19 digits, '"request_ids":' and 3 bytes.
    bound = int(seg_len[out_name].sum() + seg_len[out_phase].sum() + seg_len[out_mid].sum()
                + seg_len[out_args].sum() + seg_len[out_ids].sum() + seg_len[out_fixed].sum()
                ) + n_out * 64
    buf = np.empty(len(header) + bound + len(trailer), np.uint8)
    buf[:len(header)] = np.frombuffer(header, np.uint8)
    end = _assemble(buf, len(header), order, out_name, out_counter, out_phase, out_ts, out_mid,
                    out_args, out_ids, out_fixed, blob, seg_off, seg_len)
    buf[end:end + len(trailer)] = np.frombuffer(trailer, np.uint8)
    return buf[:end + len(trailer)].tobytes()


def _classify(event: str) -> tuple[int, str]:
    """Kind and display name: B/E only for the prefix plus a non-empty rest (MLC emitted a bare
    ``"finish"`` as an ``E`` named ``"(0)"``)."""
    event = str(event)
    if event.startswith("start ") and len(event) > 6:
        return _B, event[6:]
    if event.startswith("finish ") and len(event) > 7:
        return _E, event[7:]
    return _I, event


def _frame(rec: TraceRecorder, rid_json: list[bytes], *, event_count: int, dropped: int,
           first_ts: int | None, last_ts: int | None, unclosed: int, orphans: int
           ) -> tuple[bytes, bytes]:
    """The JSON before the events (metadata) and after them (otherData).

    ``rid_json`` holds the request ids, JSON-encoded, in lane order.
    """
    meta = [
        b'{"name":"process_name","ph":"M","pid":%d,"tid":%d,"args":{"name":%s}}'
        % (_PID, _ENGINE_TID, _json(rec.engine)),
        b'{"name":"thread_name","ph":"M","pid":%d,"tid":%d,"args":{"name":"engine"}}'
        % (_PID, _ENGINE_TID),
    ]
    meta.extend([b'{"name":"thread_name","ph":"M","pid":%d,"tid":%d,"args":{"name":%s}}' % (_PID, t, j)
                 for t, j in enumerate(rid_json, 1)])
    header = b'{"traceEvents":[' + b",".join(meta) + (b"," if event_count else b"")
    other = {
        "engine": rec.engine,
        "model": rec.model,
        "backend": rec.backend,
        "version": rec.version,
        "window": {"first_ts": first_ts, "last_ts": last_ts},
        "event_count": event_count,        # non-metadata entries of traceEvents
        "dropped_events": dropped,         # evicted by the bound since the last clear()
        "request_count": len(rid_json),
        "max_events": rec.max_events,
        "unclosed_spans": unclosed,        # closed at dump time, args.unclosed = true
        "orphan_finishes": orphans,        # finishes whose start was evicted or cleared: omitted
    }
    trailer = b'],"displayTimeUnit":"ms","otherData":' + _json(other) + b"}"
    return header, trailer


# ---------------------------------------------------------------------- numba loops
# Plain loops over int arrays, nogil so the engine thread keeps stepping during a dump, and
# cached on disk so only the first dump after an install pays the compile.


@numba.njit(cache=True, nogil=True)
def _pair_spans(group, kind, n_groups):
    """Pair starts and finishes per span group (lane x name), a stack per group.

    Returns, per row: ``partner`` (for a finish, the row of the start it closes, -1 if none),
    ``counter`` (the n of the span's ``"X (n)"``: its start's rank in the group, -1 for
    instants and orphans) and ``unclosed`` (a start never finished). The stacks are linked
    through ``below``, so memory is O(rows + groups).
    """
    n = group.shape[0]
    partner = np.full(n, -1, np.int64)
    counter = np.full(n, -1, np.int64)
    unclosed = np.zeros(n, np.bool_)
    below = np.full(n, -1, np.int64)
    top = np.full(max(n_groups, 1), -1, np.int64)
    starts = np.zeros(max(n_groups, 1), np.int64)
    for r in range(n):
        g = group[r]
        if g < 0:
            continue
        if kind[r] == 0:
            counter[r] = starts[g]
            starts[g] += 1
            below[r] = top[g]
            top[g] = r
        else:
            b = top[g]
            if b >= 0:
                partner[r] = b
                counter[r] = counter[b]
                top[g] = below[b]
    for g in range(n_groups):
        b = top[g]
        while b >= 0:
            unclosed[b] = True
            b = below[b]
    return partner, counter, unclosed


@numba.njit(cache=True, nogil=True)
def _lane_order(tid, ts, key2, n_lanes):
    """Output order: by lane, then ts, then ``key2`` (0 first), then input order.

    Input order is already ts order within each lane (timestamps are read under the recorder's
    lock), so a stable counting sort by lane plus one pass over each equal-ts run does it in
    O(n). Returns None if a lane's ts ever decreases (the caller then sorts the general way).
    """
    n = tid.shape[0]
    start = np.zeros(n_lanes + 1, np.int64)
    for i in range(n):
        start[tid[i] + 1] += 1
    for t in range(n_lanes):
        start[t + 1] += start[t]
    fill = start[:-1].copy()
    by_lane = np.empty(n, np.int64)
    for i in range(n):
        t = tid[i]
        by_lane[fill[t]] = i
        fill[t] += 1
    order = np.empty(n, np.int64)
    w = 0
    for t in range(n_lanes):
        i = start[t]
        end = start[t + 1]
        while i < end:
            t0 = ts[by_lane[i]]
            j = i + 1
            while j < end and ts[by_lane[j]] == t0:
                j += 1
            if j < end and ts[by_lane[j]] < t0:
                return None
            for k in range(i, j):
                if key2[by_lane[k]] == 0:
                    order[w] = by_lane[k]
                    w += 1
            for k in range(i, j):
                if key2[by_lane[k]] != 0:
                    order[w] = by_lane[k]
                    w += 1
            i = j
    return order


@numba.njit(cache=True, nogil=True, inline="always")
def _put(buf, pos, blob, seg_off, seg_len, s):
    """Copy segment ``s`` to ``buf[pos:]``; returns the position after it."""
    o = seg_off[s]
    n = seg_len[s]
    buf[pos:pos + n] = blob[o:o + n]
    return pos + n


@numba.njit(cache=True, nogil=True, inline="always")
def _put_int(buf, pos, v):
    """Write non-negative ``v`` in decimal at ``pos``; returns the position after it."""
    nd = 1
    x = v
    while x >= 10:
        x //= 10
        nd += 1
    for k in range(nd):
        buf[pos + nd - 1 - k] = 48 + v % 10
        v //= 10
    return pos + nd


@numba.njit(cache=True, nogil=True)
def _assemble(buf, pos, order, name, counter, phase, ts, mid, args, ids, fixed,
              blob, seg_off, seg_len):
    """Write the events' JSON, comma separated, into ``buf`` from ``pos``; returns the end.

    Per event: name [' (n)"'] phase ts lane, then either a fixed tail (closing E) or
    ['"request_ids":' ids] [',' args-members] '}}'. Segment id -1 means "absent".
    """
    for w in range(order.shape[0]):
        e = order[w]
        if w:
            buf[pos] = 44  # ,
            pos += 1
        pos = _put(buf, pos, blob, seg_off, seg_len, name[e])
        c = counter[e]
        if c >= 0:
            buf[pos] = 32      # space
            buf[pos + 1] = 40  # (
            pos = _put_int(buf, pos + 2, c)
            buf[pos] = 41      # )
            buf[pos + 1] = 34  # "
            pos += 2
        pos = _put(buf, pos, blob, seg_off, seg_len, phase[e])
        pos = _put_int(buf, pos, ts[e])
        pos = _put(buf, pos, blob, seg_off, seg_len, mid[e])
        if fixed[e] >= 0:
            pos = _put(buf, pos, blob, seg_off, seg_len, fixed[e])
            continue
        if ids[e] >= 0:
            pos = _put(buf, pos, blob, seg_off, seg_len, _SEG_REQUEST_IDS)
            pos = _put(buf, pos, blob, seg_off, seg_len, ids[e])
        a = args[e]
        if a >= 0:
            # the args object without its '{': its members, then its own '}' closes "args"
            buf[pos] = 44  # ,
            o = seg_off[a] + 1
            n = seg_len[a] - 1
            buf[pos + 1:pos + 1 + n] = blob[o:o + n]
            pos += 1 + n
            buf[pos] = 125  # }
            pos += 1
        else:
            pos = _put(buf, pos, blob, seg_off, seg_len, _SEG_CLOSE)
    return pos
