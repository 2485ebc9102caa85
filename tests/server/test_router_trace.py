"""The router's own lane: each request's calls as spans named by the engines' request id, bounded."""
from __future__ import annotations

from engines.disagg.router_trace import RouterTrace


def test_the_router_lane_and_its_requests_export_as_a_chrome_trace() -> None:
    trace = RouterTrace(max_spans=4)
    start = trace.now_us()
    trace.span("req-1", "prep_recv", start, {"server": "http://d"})
    trace.span("req-1", "remote_send", start + 5)
    trace.span("", "route", start, {"request": "req-1"})
    events = trace.export()["traceEvents"]
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert lanes == {(1, 0): "router", (1, 1): "req-1"}
    spans = [(e["tid"], e["name"]) for e in events if e["ph"] == "X"]
    assert spans == [(0, "route"), (1, "prep_recv"), (1, "remote_send")]  # the router's lane first
    assert all(e["dur"] >= 0 and e["ts"] >= start for e in events if e["ph"] == "X")
    for i in range(5):
        trace.span("req-2", f"call {i}", start)
    assert len(trace) == 4 and trace.clear() == 4 and len(trace) == 0
