"""Traces of several servers as one: a process per server and engine, every timestamp moved onto
the reference clock by its server's offset, and one request's lanes on two servers joined."""
from __future__ import annotations

import asyncio

import pytest

from engines.fleet.clock import ClockTracker, measure_offset
from engines.fleet.merged_trace import TracePart, merge_traces


def engine_trace(engine: str, request: str, start_us: int) -> dict:
    """A trace as our exporter writes one: the engine lane (tid 0) and a request's lane."""
    return {"traceEvents": [
        {"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": engine}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 0, "args": {"name": "engine"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": request}},
        {"ph": "B", "name": "step", "pid": 1, "tid": 0, "ts": start_us},
        {"ph": "E", "name": "step", "pid": 1, "tid": 0, "ts": start_us + 50},
        {"ph": "B", "name": "request", "pid": 1, "tid": 1, "ts": start_us + 10},
        {"ph": "E", "name": "request", "pid": 1, "tid": 1, "ts": start_us + 40},
    ]}


def test_parts_become_processes_on_one_clock_and_a_request_is_joined_across_them() -> None:
    # The decode server's clock runs 2 s ahead: its events, shifted back, land after the prefill's.
    prefill = TracePart("prefill:1", "demo", engine_trace("demo", "req-7", 1_000_000), offset_us=0.0)
    decode = TracePart("decode:2", "demo", engine_trace("demo", "req-7", 3_000_100), offset_us=2_000_000.0,
                       uncertainty_us=40.0)
    other = TracePart("decode:2", "other", engine_trace("other", "req-9", 3_000_000), offset_us=2_000_000.0)
    merged = merge_traces([prefill, decode, other])
    events = merged["traceEvents"]
    names = {ev["pid"]: ev["args"]["name"] for ev in events if ev.get("name") == "process_name"}
    assert names == {1: "demo @ prefill:1", 2: "demo @ decode:2", 3: "other @ decode:2"}
    engine_lanes = {ev["pid"]: ev["args"]["name"] for ev in events
                    if ev.get("name") == "thread_name" and ev["tid"] == 0}
    assert engine_lanes == names                      # each engine lane says where it ran
    steps = sorted((ev["ts"], ev["pid"]) for ev in events if ev.get("name") == "step" and ev["ph"] == "B")
    assert steps == [(1_000_000, 1), (1_000_000, 3), (1_000_100, 2)]
    flows = [ev for ev in events if ev["ph"] in ("s", "f")]
    assert [(f["ph"], f["pid"], f["tid"], f["ts"]) for f in flows] == [("s", 1, 1, 1_000_040), ("f", 2, 1, 1_000_110)]
    assert flows[0]["id"] == flows[1]["id"] and flows[1]["bp"] == "e" and flows[0]["name"] == "request req-7"
    assert merged["metadata"]["joined_requests"] == 1
    assert merged["metadata"]["parts"]["demo @ decode:2"] == {"offset_us": 2_000_000.0, "uncertainty_us": 40.0}
    # Nothing lost: every event of every part, plus a name and a sort index per process and the flows.
    assert len(events) == 3 * 7 - 3 + 3 * 2 + 2


def test_an_offset_is_the_midpoint_of_the_round_trip_and_the_shortest_round_trip_wins() -> None:
    local = iter([100.0, 100.2, 200.0, 200.02])

    async def reference() -> float:
        return 90.05

    first = asyncio.run(measure_offset(reference, lambda: next(local)))
    assert first.offset_s == pytest.approx(10.05) and first.uncertainty_s == pytest.approx(0.1)
    second = asyncio.run(measure_offset(reference, lambda: next(local)))
    tracker = ClockTracker()
    tracker.add(first)
    assert tracker.add(second) == second and second.uncertainty_s == pytest.approx(0.01)
