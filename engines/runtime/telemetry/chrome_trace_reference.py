"""Chrome Trace Event Format exporter, the reference: the export rules stated event by event.

:func:`export_dict` builds, in plain Python, the same trace that ``chrome_trace.export_json``
assembles as bytes, from the same :class:`~.trace_window.TraceWindow`, as a parsed JSON object.
It is slow (tens of µs per event) and meant only to be obviously right against the rules in
``trace_recorder.py``'s docstring and docs/interfaces.md ("Event trace"): the tests diff the fast
exporter against it over random workloads, as llm.c checks a kernel against its CPU twin.

Args are taken as the contract asks, JSON-ready (numpy numbers included): they go through the
standard library's ``json``, a mapping becoming an object and anything else its ``str()``.
"""
from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from engines.runtime.telemetry.trace_window import TraceWindow

__all__ = ["export_dict"]

_PID = 1
_ENGINE_TID = 0


@dataclass
class _Entry:
    """One output event of a lane, with what ordering needs: its place and, for an E, its B."""

    event: dict[str, Any]
    seq: int                      # position among the lane's entries before sorting
    begin: _Entry | None = None   # for an E: the B it closes


def export_dict(window: TraceWindow) -> dict[str, Any]:
    """The trace of ``window`` as a dict, equal to ``json.loads(export_json(window))``."""
    now_us = (window.now_ns + window.epoch_anchor_ns) // 1000
    engine_lane: list[tuple[int, str, dict[str, Any]]] = []          # (ts, event, args)
    request_lanes: dict[str, list[tuple[int, str, dict[str, Any]]]] = {}   # first-seen order
    for ns, request_ids, event, args, on_engine_lane in window.calls:
        ts = (ns + window.epoch_anchor_ns) // 1000
        for request_id in request_ids:
            request_lanes.setdefault(request_id, []).append((ts, event, _plain(args)))
        if on_engine_lane:   # the batch by lane: a request's tid is its lane's place, from 1
            tid_of = {request_id: tid for tid, request_id in enumerate(request_lanes, start=1)}
            tids = [tid_of[request_id] for request_id in request_ids]
            engine_lane.append((ts, event, {"request_tids": tids, **_plain(args)}))

    metadata = [_metadata("process_name", _ENGINE_TID, window.engine),
                _metadata("thread_name", _ENGINE_TID, "engine")]
    events: list[dict[str, Any]] = []
    unclosed = orphans = 0
    lanes = [(_ENGINE_TID, "engine", engine_lane, {"unclosed": True})]
    for tid, (request_id, recorded) in enumerate(request_lanes.items(), start=1):
        metadata.append(_metadata("thread_name", tid, request_id))
        lanes.append((tid, "request", recorded, {"unclosed": True}))
    for tid, cat, recorded, closing_args in lanes:
        lane_events, lane_unclosed, lane_orphans = _lane(tid, cat, recorded, closing_args, now_us)
        events += lane_events
        unclosed += lane_unclosed
        orphans += lane_orphans

    timestamps = [e["ts"] for e in events]
    return {
        "traceEvents": metadata + events,
        "displayTimeUnit": "ms",
        "otherData": {
            "engine": window.engine, "model": window.model, "backend": window.backend,
            "version": window.version,
            "window": {"first_ts": min(timestamps, default=None),
                       "last_ts": max(timestamps, default=None)},
            "event_count": len(events),
            "dropped_events": window.dropped_events,
            "request_count": len(request_lanes),
            "max_events": window.max_events,
            "unclosed_spans": unclosed,
            "orphan_finishes": orphans,
        },
    }


def _lane(tid: int, cat: str, recorded: list[tuple[int, str, dict[str, Any]]],
          closing_args: dict[str, Any], now_us: int) -> tuple[list[dict[str, Any]], int, int]:
    """One lane's events in output order, its unclosed spans and its orphan finishes."""
    entries: list[_Entry] = []
    open_spans: dict[str, list[_Entry]] = {}   # span name -> its unclosed B's, innermost last
    starts: Counter[str] = Counter()           # span name -> B's so far: the n of "X (n)"
    orphans = 0
    for ts, event, args in recorded:
        kind, name = _classify(event)
        if kind == "B":
            entry = _Entry(_event(f"{name} ({starts[name]})", cat, "B", ts, tid, args), len(entries))
            starts[name] += 1
            open_spans.setdefault(name, []).append(entry)
        elif kind == "E":
            if not open_spans.get(name):   # its start was evicted or cleared
                orphans += 1
                continue
            begin = open_spans[name].pop()
            entry = _Entry(_event(begin.event["name"], cat, "E", ts, tid, args), len(entries), begin)
        else:
            entry = _Entry(_event(name, cat, "i", ts, tid, args), len(entries))
        entries.append(entry)

    # Spans still open end at the dump, innermost (latest begun) first.
    still_open = sorted((b for stack in open_spans.values() for b in stack), key=lambda b: -b.seq)
    for begin in still_open:
        end = _event(begin.event["name"], cat, "E", now_us, tid, dict(closing_args))
        entries.append(_Entry(end, len(entries), begin))

    def order(entry: _Entry) -> tuple[int, int, int]:
        # By ts; at an equal ts, the E's of spans begun earlier first, innermost first, then
        # the rest as recorded (sort() is stable).
        begin = entry.begin
        if begin is not None and begin.event["ts"] < entry.event["ts"]:
            return entry.event["ts"], 0, -begin.seq
        return entry.event["ts"], 1, 0

    entries.sort(key=order)
    return [e.event for e in entries], len(still_open), orphans


def _classify(event: str) -> tuple[str, str]:
    """``("B", X)`` for ``"start X"``, ``("E", X)`` for ``"finish X"`` (X non-empty), else an
    instant named by the whole event."""
    event = str(event)
    for prefix, kind in (("start ", "B"), ("finish ", "E")):
        if event.startswith(prefix) and len(event) > len(prefix):
            return kind, event[len(prefix):]
    return "i", event


def _event(name: str, cat: str, ph: str, ts: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    scope = {"s": "t"} if ph == "i" else {}   # instants are thread-scoped
    return {"name": name, "cat": cat, "ph": ph, **scope, "ts": ts, "pid": _PID, "tid": tid,
            "args": args}


def _metadata(name: str, tid: int, value: str) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": _PID, "tid": tid, "args": {"name": value}}


def _plain(args: Mapping[str, Any] | None) -> dict[str, Any]:
    """``args`` as the JSON object it reads back as (``{}`` for none)."""
    return json.loads(json.dumps(dict(args), default=_json_default)) if args else {}


def _json_default(value: Any) -> Any:
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist()
    return str(value)
