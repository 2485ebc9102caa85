"""Chrome Trace Event Format exporter for :class:`~.trace_recorder.TraceRecorder`: the fast one.

:func:`export_json` turns a :class:`~.trace_window.TraceWindow` (the recorder's raw calls,
taken under its lock) into the trace's compact UTF-8 JSON: lanes, span pairing, the ``"X (n)"``
counters, ordering, the closing of open spans and ``otherData``, exactly as the recorder's module
docstring and docs/interfaces.md ("Event trace") say, fast enough that a million events export
within the second a saved trace may take (``bench/trace_recorder.py``; BENCHMARKS.md, "Engine").

``chrome_trace_reference.py`` states the same rules in plain Python, event by event; the tests
diff the two over random workloads. Change a rule there first, then here.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from itertools import chain
from operator import itemgetter
from typing import TYPE_CHECKING, Any

import numba
import numpy as np
import orjson

from engines.runtime.numba_cache import install_cache_locators

if TYPE_CHECKING:
    from engines.runtime.telemetry.trace_window import TraceWindow

install_cache_locators()  # before this module's compiled functions are decorated

__all__ = ["export_json", "json_bytes"]

_PID = 1
_ENGINE_TID = 0

# Event kinds.
_B, _E, _I = 0, 1, 2

# An exported event is a concatenation of byte segments plus two numbers:
#
#   {"name":"decode   (3)"   ,"cat":"request","ph":"B","ts":   <ts>   ,"pid":1,"tid":   <tid>
#   ,"args":{   "batch_size":3}   }
#
# A request id is written once, as its lane's name (the thread_name metadata); the engine lane's
# events name their batch by lane: "request_tids":[1,5,7]. So what a client's id costs the trace
# does not grow with the events of its request.
#
# Python builds the segment table with a handful of bulk calls (the args of all calls, the
# request ids, the engine batches: one orjson call each, split by a numba scan), numpy works out
# each event's segment ids, and numba copies the bytes. No per-event Python object is made.


def _json_default(value: Any) -> Any:
    # Args come from engine code: a non-dict mapping becomes an object; anything else orjson
    # can't serialise is better shown as its str() than failing the whole dump.
    if isinstance(value, Mapping):
        return dict(value)
    return str(value)


def json_bytes(value: Any) -> bytes:
    """``value`` as compact JSON, the way trace args are written."""
    # numpy scalars are common in args (batch sizes from array lengths); a non-str key
    # (a token id) should not fail the whole dump.
    return orjson.dumps(value, default=_json_default,
                        option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS)


# Fixed segments at known ids; the numba loops use the ids as constants.
_FIXED_SEGMENTS = (
    # 0-5, phase: id = kind * 2 + (1 on the engine lane)
    b',"cat":"request","ph":"B","ts":',
    b',"cat":"engine","ph":"B","ts":',
    b',"cat":"request","ph":"E","ts":',
    b',"cat":"engine","ph":"E","ts":',
    b',"cat":"request","ph":"i","s":"t","ts":',
    b',"cat":"engine","ph":"i","s":"t","ts":',
    b',"pid":%d,"tid":' % _PID,                         # 6
    b',"args":{',                                       # 7
    b'"request_tids":',                                 # 8: engine lane: the batch, by lane
    b"}}",                                              # 9: close args and the event
    b'"unclosed":true}}',                               # 10: closing E at dump (args empty so far)
    b',{"name":"thread_name","ph":"M","pid":%d,"tid":' % _PID,  # 11: a request lane's name
    b',"args":{"name":',                                # 12
)
_SEG_PID_TID = 6
_SEG_ARGS = 7
_SEG_REQUEST_TIDS = 8
_SEG_CLOSE = 9
_SEG_UNCLOSED = 10
_SEG_META_LANE = 11
_SEG_META_NAME = 12

# Bytes an event or a lane's metadata may take beyond its variable segments (an upper bound):
# the fixed segments around them, up to three 20-digit numbers (ts, tid, counter) and ' ()"' ','.
_EVENT_EXTRA = sum(map(len, _FIXED_SEGMENTS[_SEG_PID_TID:_SEG_CLOSE + 1])) + 3 * 20 + 8
_LANE_EXTRA = sum(map(len, _FIXED_SEGMENTS[_SEG_META_LANE:])) + len(_FIXED_SEGMENTS[_SEG_CLOSE]) + 20

_get_ns, _get_ids, _get_event, _get_args, _get_engine_lane = (itemgetter(i) for i in range(5))


class _Segments:
    """The byte strings the assembler copies from: one blob, addressed by segment id."""

    def __init__(self, first: Iterable[bytes]) -> None:
        parts = list(first)
        lens = np.fromiter(map(len, parts), np.int64, len(parts))
        self._parts = parts
        self._lens = [lens]
        self._offs = [_offsets(lens)]
        self._size = int(lens.sum())
        self._count = len(parts)
        self._small: list[bytes] = []   # added one by one; flushed before a bulk add

    def add(self, segment: bytes) -> int:
        """Add one segment; returns its id."""
        self._small.append(segment)
        self._count += 1
        return self._count - 1

    def add_json_items(self, values: list[Any]) -> int:
        """Add the JSON of each value (one orjson call for all); returns the first id."""
        self._flush()
        first = self._count
        array = json_bytes(values)
        starts, lens = _split_json_array(np.frombuffer(array, np.uint8))
        if starts.size != len(values):  # orjson output is canonical; this would be our bug
            raise AssertionError(f"split {starts.size} JSON items, expected {len(values)}")
        self._parts.append(array)
        self._lens.append(lens)
        self._offs.append(starts + self._size)
        self._size += len(array)
        self._count += len(values)
        return first

    def _flush(self) -> None:
        if self._small:
            lens = np.fromiter(map(len, self._small), np.int64, len(self._small))
            self._parts.extend(self._small)
            self._lens.append(lens)
            self._offs.append(_offsets(lens) + self._size)
            self._size += int(lens.sum())
            self._small = []

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(blob, offsets, lengths)``; ``lengths`` has one extra 0, the length of id -1."""
        self._flush()
        blob = np.frombuffer(b"".join(self._parts), np.uint8)
        offs = np.concatenate(self._offs)
        lens = np.concatenate(self._lens + [np.zeros(1, np.int64)])
        return blob, offs, lens


def _offsets(lens: np.ndarray) -> np.ndarray:
    offs = np.zeros(lens.size, np.int64)
    np.cumsum(lens[:-1], out=offs[1:])
    return offs


def export_json(window: TraceWindow) -> bytes:
    """The window as Chrome Trace Event Format JSON (object form), compact UTF-8 bytes.

    Pass the recorder's only reference to ``window`` (``export_json(rec.snapshot())``): the call
    tuples are then freed once read into columns, before the output buffers are made.
    """
    anchor_ns = window.epoch_anchor_ns
    now_us = (window.now_ns + anchor_ns) // 1000   # >= every recorded ts: closes open spans
    identity = {"engine": window.engine, "model": window.model, "backend": window.backend,
                "version": window.version}
    max_events, dropped = window.max_events, window.dropped_events

    # -- columns per call
    calls = window.calls
    n_calls = len(calls)
    call_ts = np.fromiter(map(_get_ns, calls), np.int64, n_calls)
    call_ts += anchor_ns
    call_ts //= 1000
    ids_col = list(map(_get_ids, calls))
    ev_col = list(map(_get_event, calls))
    args_col = list(map(_get_args, calls))
    call_eng = np.fromiter(map(_get_engine_lane, calls), np.bool_, n_calls)
    del window, calls
    events = list(dict.fromkeys(ev_col))
    ev_code = dict(zip(events, range(len(events)), strict=True))
    call_ev = np.fromiter(map(ev_code.__getitem__, ev_col), np.int64, n_calls)
    del ev_col

    # -- rows: one per (call, request id), then one per engine-lane call. Within every lane,
    #    row order is call order: spans pair in it, and it is timestamp order (but for at_ns
    #    readings older than what came before), which the fast ordering relies on.
    flat_ids = list(chain.from_iterable(ids_col))
    lane_ids = list(dict.fromkeys(flat_ids))           # tid = position + 1, first-seen order
    tid_of = dict(zip(lane_ids, range(1, len(lane_ids) + 1), strict=True))
    req_tid = np.fromiter(map(tid_of.__getitem__, flat_ids), np.int64, len(flat_ids))
    n_req = len(flat_ids)
    del flat_ids
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
    segs = _Segments(_FIXED_SEGMENTS)
    n_ev = len(events)
    ev_kind = np.empty(n_ev, np.int8)
    ev_base = np.full(n_ev, -1, np.int64)       # span name id for start/finish, -1 for instants
    ev_nameseg = np.empty(n_ev, np.int64)
    bases: dict[str, tuple[int, int]] = {}      # span name -> (id, name segment)
    for i, event in enumerate(events):
        kind, name = _classify(event)
        ev_kind[i] = kind
        if kind == _I:
            ev_nameseg[i] = segs.add(b'{"name":' + json_bytes(name))
            continue
        if name not in bases:
            # left open: ' (n)"' completes the name
            bases[name] = (len(bases), segs.add(b'{"name":' + json_bytes(name)[:-1]))
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
            uniq, inverse = np.unique(key, return_inverse=True)
            group[is_span] = inverse
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

    # "E before B at equal ts": the E's of spans begun earlier go first in their equal-ts run,
    # innermost first (a finish recorded late by another thread still nests).
    key2 = np.ones(n_out, np.int8)
    e_out = np.flatnonzero(out_kind == _E)
    key2[e_out[row_ts[out_start[e_out]] < out_ts[e_out]]] = 0
    order = _lane_order(out_tid, out_ts, key2, out_start, n_lanes)
    if order is None:
        # A lane's ts went back (an at_ns reading older than events recorded before it): the
        # same order by a general sort. Within an equal-ts run, the E's of spans begun earlier
        # innermost first (an E's start row is unique), then the rest in input order.
        innermost = np.where(key2 == 0, -out_start, np.arange(n_out))
        order = np.lexsort((innermost, key2, out_ts, out_tid))

    # -- request ids, args and engine batches: one bulk JSON call each
    lane_seg = np.full(n_lanes, -1, np.int64)
    lane_seg[1:] = segs.add_json_items(lane_ids) + np.arange(len(lane_ids))
    arg_calls = np.flatnonzero(np.fromiter(map(bool, args_col), np.bool_, n_calls))
    call_argseg = np.full(n_calls, -1, np.int64)
    if arg_calls.size:
        first = segs.add_json_items(list(map(args_col.__getitem__, arg_calls.tolist())))
        call_argseg[arg_calls] = first + np.arange(arg_calls.size)
    row_idsseg = np.full(n_rows, -1, np.int64)
    if eng_call.size:
        batches = [[tid_of[rid] for rid in ids_col[c]] for c in eng_call.tolist()]
        first = segs.add_json_items(batches)
        row_idsseg[n_req:] = first + np.arange(eng_call.size)
    del args_col, ids_col, tid_of
    blob, seg_off, seg_len = segs.arrays()

    out_name = ev_nameseg[row_ev[src]]
    out_phase = out_kind * 2 + out_eng
    out_args = call_argseg[row_call[src]]
    out_ids = row_idsseg[src]
    out_fixed = np.full(n_out, -1, np.int64)
    out_fixed[n_keep:] = _SEG_UNCLOSED
    out_args[n_keep:] = -1
    out_ids[n_keep:] = -1

    header, trailer = _frame(
        identity, max_events, event_count=n_out, request_count=len(lane_ids), dropped=dropped,
        first_ts=int(out_ts.min()) if n_out else None, last_ts=int(out_ts.max()) if n_out else None,
        unclosed=int(open_rows.size), orphans=n_orphans)
    bound = (int(seg_len[out_name].sum() + seg_len[out_phase].sum() + seg_len[out_args].sum()
                 + seg_len[out_ids].sum() + seg_len[out_fixed].sum() + seg_len[lane_seg].sum())
             + n_out * _EVENT_EXTRA + n_lanes * _LANE_EXTRA)
    buf = np.empty(len(header) + bound + len(trailer), np.uint8)
    buf[:len(header)] = np.frombuffer(header, np.uint8)
    end = _assemble(buf, len(header), lane_seg, order, out_name, out_counter, out_phase, out_ts,
                    out_tid, out_args, out_ids, out_fixed, blob, seg_off, seg_len)
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


def _frame(identity: dict[str, str], max_events: int, *, event_count: int, request_count: int,
           dropped: int, first_ts: int | None, last_ts: int | None, unclosed: int, orphans: int
           ) -> tuple[bytes, bytes]:
    """The JSON before the lanes' metadata and after the events (otherData)."""
    header = (b'{"traceEvents":[{"name":"process_name","ph":"M","pid":%d,"tid":%d,"args":{"name":%s}},'
              b'{"name":"thread_name","ph":"M","pid":%d,"tid":%d,"args":{"name":"engine"}}'
              % (_PID, _ENGINE_TID, json_bytes(identity["engine"]), _PID, _ENGINE_TID))
    other = {
        **identity,                        # engine, model, backend, version
        "window": {"first_ts": first_ts, "last_ts": last_ts},
        "event_count": event_count,        # non-metadata entries of traceEvents
        "dropped_events": dropped,         # evicted by the bound since the last clear()
        "request_count": request_count,
        "max_events": max_events,
        "unclosed_spans": unclosed,        # closed at dump time, args.unclosed = true
        "orphan_finishes": orphans,        # finishes whose start was evicted or cleared: omitted
    }
    trailer = b'],"displayTimeUnit":"ms","otherData":' + json_bytes(other) + b"}"
    return header, trailer


# ---------------------------------------------------------------------- numba loops
# Plain loops over int arrays, nogil so the engine thread keeps stepping during a dump, and
# cached on disk so only the first dump after an install pays the compile.


@numba.njit(cache=True, nogil=True)
def _split_json_array(a):
    """Start offsets and lengths of the top-level items of a compact JSON array (orjson's)."""
    n = a.shape[0]
    starts = np.empty(n // 2 + 1, np.int64)
    lens = np.empty(n // 2 + 1, np.int64)
    k = 0
    depth = 0
    in_str = False
    escaped = False
    item = 1
    for i in range(n):
        c = a[i]
        if in_str:
            if escaped:
                escaped = False
            elif c == 92:    # backslash
                escaped = True
            elif c == 34:    # "
                in_str = False
        elif c == 34:
            in_str = True
        elif c == 91 or c == 123:    # [ {
            depth += 1
        elif c == 93 or c == 125:    # ] }
            depth -= 1
            if depth == 0 and i > item:
                starts[k] = item
                lens[k] = i - item
                k += 1
        elif c == 44 and depth == 1:  # , between items
            starts[k] = item
            lens[k] = i - item
            k += 1
            item = i + 1
    return starts[:k].copy(), lens[:k].copy()


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
def _lane_order(tid, ts, key2, start_row, n_lanes):
    """Output order: by lane, then ts; within an equal-ts run, the ``key2 == 0`` events (ends of
    spans begun earlier) first, innermost (latest ``start_row``) first, then the rest in input
    order.

    Input order is ts order within each lane (timestamps are read under the recorder's lock),
    so a stable counting sort by lane plus one pass over each equal-ts run does it in O(n).
    Returns None if a lane's ts ever decreases (only ``at_ns`` can do that; the caller then
    sorts the general way).
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
            first = w
            for k in range(i, j):
                e = by_lane[k]
                if key2[e] == 0:
                    # insertion sort, descending start row: runs are a handful of events
                    m = w
                    while m > first and start_row[order[m - 1]] < start_row[e]:
                        order[m] = order[m - 1]
                        m -= 1
                    order[m] = e
                    w += 1
            for k in range(i, j):
                e = by_lane[k]
                if key2[e] != 0:
                    order[w] = e
                    w += 1
            i = j
    return order


@numba.njit(cache=True, nogil=True, inline="always")
def _put(buf, pos, blob, seg_off, seg_len, s):
    """Copy segment ``s`` to ``buf[pos:]``; returns the position after it."""
    o = seg_off[s]
    n = seg_len[s]
    for k in range(n):  # not a slice assignment: see model/kernels/__init__.py
        buf[pos + k] = blob[o + k]
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
def _assemble(buf, pos, lane_seg, order, name, counter, phase, ts, tid, args, ids, fixed,
              blob, seg_off, seg_len):
    """Write the request lanes' metadata, then the events, into ``buf`` from ``pos``.

    Per event: name [' (n)"'] phase ts ',"pid":1,"tid":' tid ',"args":{', then either a fixed
    tail (closing E) or ['"request_tids":' tids] [','] [args-members] '}}'. Segment id -1 means
    "absent". Returns the end position.
    """
    for t in range(1, lane_seg.shape[0]):
        pos = _put(buf, pos, blob, seg_off, seg_len, _SEG_META_LANE)
        pos = _put_int(buf, pos, t)
        pos = _put(buf, pos, blob, seg_off, seg_len, _SEG_META_NAME)
        pos = _put(buf, pos, blob, seg_off, seg_len, lane_seg[t])
        pos = _put(buf, pos, blob, seg_off, seg_len, _SEG_CLOSE)
    for w in range(order.shape[0]):
        e = order[w]
        buf[pos] = 44  # , (the metadata always comes first)
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
        pos = _put(buf, pos, blob, seg_off, seg_len, _SEG_PID_TID)
        pos = _put_int(buf, pos, tid[e])
        pos = _put(buf, pos, blob, seg_off, seg_len, _SEG_ARGS)
        if fixed[e] >= 0:
            pos = _put(buf, pos, blob, seg_off, seg_len, fixed[e])
            continue
        member = False
        if ids[e] >= 0:
            pos = _put(buf, pos, blob, seg_off, seg_len, _SEG_REQUEST_TIDS)
            pos = _put(buf, pos, blob, seg_off, seg_len, ids[e])
            member = True
        a = args[e]
        if a >= 0:
            # the args object minus its '{': its members, then its own '}' closes "args"
            if member:
                buf[pos] = 44  # ,
                pos += 1
            o = seg_off[a] + 1
            n = seg_len[a] - 1
            for k in range(n):
                buf[pos + k] = blob[o + k]
            pos += n
            buf[pos] = 125  # }
            pos += 1
        else:
            pos = _put(buf, pos, blob, seg_off, seg_len, _SEG_CLOSE)
    return pos
