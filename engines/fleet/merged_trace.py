"""Traces captured on several servers over the same window, as one Chrome trace.

Each part (one engine's trace from one server) becomes its own process, named
``<engine> @ <server>`` (a process lane group per server and engine in Perfetto; lanes grouped
the same way in our viewer), and its timestamps move onto one clock: the fleet's Redis server's.

**Clocks.** Each member measures its offset to Redis's clock at every heartbeat, as NTP does
with one server: read the local clock (t0), ask Redis for ``TIME`` (r), read the local clock
again (t1); the offset is ``(t0 + t1) / 2 - r`` and it is known to within half the round trip,
``(t1 - t0) / 2``; the member keeps the measurement with the smallest round trip of the last
few (``clock.ClockOffset``). A part's events are shifted by minus its server's offset, so two
servers' events are ordered right to within the sum of their uncertainties (a loopback round
trip: tens of µs; across a LAN: a fraction of a millisecond), which the merged trace states in
its ``metadata``.

**Requests across servers.** A request that went through ``--router disagg`` has one id on the
prefill and the decode server (the router makes it); its lanes in the parts are joined by flow
arrows (Chrome trace ``s``/``f`` events) wherever, in time order, its next event is on another
server: decode (prepare to receive) -> prefill (compute, send K/V) -> decode (adopt, generate).
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["TracePart", "merge_traces"]


@dataclass(frozen=True)
class TracePart:
    """One engine's trace from one server, with that server's clock offset (µs; its clock minus
    the reference clock) and the offset's uncertainty."""

    server: str
    engine: str
    trace: dict[str, Any] | list[Any]
    offset_us: float = 0.0
    uncertainty_us: float | None = None


def _events(trace: dict[str, Any] | list[Any]) -> list[Any]:
    events = trace if isinstance(trace, list) else trace.get("traceEvents", [])
    return events if isinstance(events, list) else []


def merge_traces(parts: Sequence[TracePart]) -> dict[str, Any]:
    """The parts as one trace on the reference clock, their requests joined by id."""
    out: list[dict[str, Any]] = []
    pids: dict[tuple[int, Any], int] = {}
    # request id -> its events on request lanes, as (ts, pid, tid), from every part
    visits: dict[str, list[tuple[float, int, Any]]] = {}
    for index, part in enumerate(parts):
        events = _events(part.trace)
        names = {(ev.get("pid"), ev.get("tid")): str(ev["args"]["name"]) for ev in events
                 if isinstance(ev, dict) and ev.get("ph") == "M" and ev.get("name") == "thread_name"
                 and isinstance(ev.get("args"), dict) and "name" in ev["args"]}
        for ev in events:
            if not isinstance(ev, dict):
                continue
            key = (index, ev.get("pid"))
            pid = pids.get(key)
            if pid is None:
                pid = pids[key] = len(pids) + 1
                out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                            "args": {"name": f"{part.engine} @ {part.server}"}})
                out.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
            if ev.get("ph") == "M" and ev.get("name") in ("process_name", "process_sort_index"):
                continue  # named above
            moved = dict(ev)
            moved["pid"] = pid
            if ev.get("ph") == "M" and ev.get("name") == "thread_name" and ev.get("tid") == 0:
                moved["args"] = {"name": f"{part.engine} @ {part.server}"}
            if ev.get("ph") != "M" and isinstance(ev.get("ts"), (int, float)):
                moved["ts"] = ev["ts"] - part.offset_us
                label = names.get((ev.get("pid"), ev.get("tid")))
                if ev.get("tid") not in (0, None) and label is not None:
                    visits.setdefault(label, []).append((moved["ts"], pid, ev.get("tid")))
            out.append(moved)
    flow = 0
    for request_id, seen in visits.items():
        if len({pid for _, pid, _ in seen}) < 2:
            continue
        seen.sort(key=lambda visit: visit[0])
        for (a_ts, a_pid, a_tid), (b_ts, b_pid, b_tid) in itertools.pairwise(seen):
            if a_pid == b_pid:
                continue  # the hand-offs only: where the request's next event is on another server
            flow += 1
            common = {"name": f"request {request_id}", "cat": "fleet", "id": flow}
            out.append({**common, "ph": "s", "pid": a_pid, "tid": a_tid, "ts": a_ts})
            out.append({**common, "ph": "f", "bp": "e", "pid": b_pid, "tid": b_tid, "ts": b_ts})
    clocks = {f"{p.engine} @ {p.server}": {"offset_us": p.offset_us, "uncertainty_us": p.uncertainty_us}
              for p in parts}
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "metadata": {"clock": "the fleet's Redis server (TIME); each part shifted by minus its offset",
                         "parts": clocks, "joined_requests": flow}}
