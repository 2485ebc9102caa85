"""The disaggregating router's own lane on a fleet's timeline: each request's three MicroServing
calls as spans, kept in a bounded ring and exported as a Chrome trace whose request lanes are named
by the id the engines use (the router's ``user`` for the attempt), so that a merged trace
(``engines.fleet.merged_trace``) joins router, prefill and decode on one request."""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

__all__ = ["RouterTrace"]

#: Spans kept (the oldest go first): three or four a request.
MAX_SPANS = 100_000


class RouterTrace:
    """Spans of the router's calls, per request id, in a bounded ring."""

    def __init__(self, max_spans: int = MAX_SPANS) -> None:
        self._spans: deque[tuple[str, str, int, int, dict[str, Any]]] = deque(maxlen=max_spans)
        self._lock = threading.Lock()

    @staticmethod
    def now_us() -> int:
        """Unix time in µs (the engines' traces use the same clock)."""
        return time.time_ns() // 1000

    def span(self, request_id: str, name: str, start_us: int, args: dict[str, Any] | None = None) -> None:
        """A call of ``request_id`` from ``start_us`` to now (``request_id`` "": the router's lane)."""
        with self._lock:
            self._spans.append((request_id, name, start_us, self.now_us(), args or {}))

    def clear(self) -> int:
        """Forget every span; how many there were."""
        with self._lock:
            count = len(self._spans)
            self._spans.clear()
            return count

    def __len__(self) -> int:
        return len(self._spans)

    def export(self) -> dict[str, Any]:
        """A Chrome trace: the router's lane (tid 0, "router") and a lane per request id."""
        with self._lock:
            spans = list(self._spans)
        spans.sort(key=lambda span: span[0] != "")  # the router's lane first: a viewer groups lanes under it
        events: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "router"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 0, "args": {"name": "router"}}]
        tids: dict[str, int] = {}
        for request_id, name, start, end, args in spans:
            tid = 0 if not request_id else tids.get(request_id)
            if tid is None:
                tid = tids[request_id] = len(tids) + 1
                events.append({"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": request_id}})
            events.append({"ph": "X", "name": name, "pid": 1, "tid": tid, "ts": start, "dur": max(0, end - start),
                           "args": args})
        return {"traceEvents": events, "displayTimeUnit": "ms"}
