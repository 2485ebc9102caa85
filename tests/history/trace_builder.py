"""Build traces in the documented export format (docs/interfaces.md, "Event trace").

A stand-in for ``engines.runtime.telemetry.trace_recorder.TraceRecorder`` with explicit timestamps, so
a test states exactly when each event happened and knows every derived number.
Same rules: "start X"/"finish X" open and close span ``X (n)`` (n counts spans of
that name per request), anything else is an instant; request lanes get tids 1, 2,
... in first-seen order, the engine lane is tid 0; events sorted by ts per lane with
E before B at an equal ts.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any


class TraceBuilder:
    def __init__(self, engine: str = "eng-a", model: str = "demo", backend: str = "cpu") -> None:
        self.engine, self.model, self.backend = engine, model, backend
        self._lanes: dict[str, int] = {}
        self._events: list[tuple[int, float, int, int, dict[str, Any]]] = []  # (tid, ts, E-first, seq, event)
        self._counters: dict[tuple[str, str], int] = defaultdict(int)
        self._open: dict[tuple[str, str], str] = {}

    def add(self, request_ids: str | list[str], event: str, ts: int, args: dict | None = None,
            engine_lane: bool = False) -> "TraceBuilder":
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            tid = self._lanes.setdefault(rid, len(self._lanes) + 1)
            self._emit(rid, tid, event, ts, {"request_id": rid, **(args or {})})
        if engine_lane:
            self._emit("<engine>", 0, event, ts, dict(args or {}))
        return self

    def _emit(self, lane: str, tid: int, event: str, ts: int, args: dict) -> None:
        if event.startswith("start "):
            base = event[len("start "):]
            name = f"{base} ({self._counters[(lane, base)]})"
            self._counters[(lane, base)] += 1
            self._open[(lane, base)] = name
            ev = {"name": name, "cat": "request", "ph": "B", "ts": ts, "pid": 1, "tid": tid, "args": args}
        elif event.startswith("finish ") and (lane, event[len("finish "):]) in self._open:
            name = self._open.pop((lane, event[len("finish "):]))
            ev = {"name": name, "cat": "request", "ph": "E", "ts": ts, "pid": 1, "tid": tid, "args": args}
        else:
            ev = {"name": event, "cat": "request", "ph": "i", "s": "t", "ts": ts, "pid": 1, "tid": tid,
                  "args": args}
        self._events.append((tid, ts, 0 if ev["ph"] == "E" else 1, len(self._events), ev))

    def export(self) -> dict[str, Any]:
        meta = [{"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": self.engine}},
                {"name": "thread_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "engine"}}]
        meta += [{"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": rid}}
                 for rid, tid in self._lanes.items()]
        events = [e[-1] for e in sorted(self._events, key=lambda e: e[:4])]
        stamps = [e["ts"] for e in events]
        return {
            "traceEvents": meta + events,
            "displayTimeUnit": "ms",
            "otherData": {"engine": self.engine, "model": self.model, "backend": self.backend, "version": "test",
                          "window": {"first_ts": min(stamps, default=None), "last_ts": max(stamps, default=None)},
                          "event_count": len(events), "dropped_events": 0, "request_count": len(self._lanes)},
        }


T0 = 1_700_000_000_000_000


def serving_trace(engine: str = "eng-a", num_requests: int = 3, prompt_tokens: int = 10,
                  completion_tokens: int = 4, t0: int = T0) -> dict[str, Any]:
    """``num_requests`` requests with round numbers for every derived value.

    All are added (and start queueing) at ``t0``. Request i (0-based) leaves the queue
    at ``t0 + 100 (i + 1)``, prefills for 1000 µs, gets its first token 1 µs later,
    decodes ``completion_tokens - 1`` steps of 500 µs (one every 600 µs) and finishes
    ("length") at the end of the last step's slot. So, in µs:
    queue = 100 (i + 1), ttft = queue + 1001, prefill = 1000,
    decode = 500 (completion_tokens - 1), e2e = ttft + 600 (completion_tokens - 1).
    """
    b = TraceBuilder(engine=engine)
    ids = [f"req-{i}" for i in range(num_requests)]
    for rid in ids:
        b.add(rid, "request added to engine", t0, {"prompt_tokens": prompt_tokens})
        b.add(rid, "start queue", t0)
    for i, rid in enumerate(ids):
        start = t0 + 100 * (i + 1)
        b.add(rid, "finish queue", start)
        b.add(rid, "start prefill", start, {"batch_size": 1})
        b.add(rid, "finish prefill", start + 1000, {"batch_size": 1, "tokens": prompt_tokens})
        b.add(rid, "first token", start + 1001)
        ts = start + 1001
        for _ in range(completion_tokens - 1):
            b.add(rid, "start decode", ts, {"batch_size": 1})
            b.add(rid, "finish decode", ts + 500, {"batch_size": 1})
            ts += 600
        b.add(rid, "finish", ts, {"finish_reason": "length", "prompt_tokens": prompt_tokens,
                                  "completion_tokens": completion_tokens, "prefill_tokens": prompt_tokens})
    return b.export()
