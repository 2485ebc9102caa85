"""A saved trace's requests as a workload: what a trace records of each request (its arrival,
token counts, outcome and times: ``engines.history.analysis``'s request summaries) in the flight
recorder's format, so a trace saved last week replays like a workload saved today.

A trace keeps no sampling parameters: its requests replay greedy (temperature 0), which does the
same work and makes two runs' outputs comparable. Requests without an arrival time (their lane
began before the trace's window) are left out and counted in ``dropped``.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from engines.runtime import WORKLOAD_FORMAT, WORKLOAD_VERSION

__all__ = ["workload_from_summaries"]

_US = 1e-6


def _seconds(value: Any) -> float | None:
    return None if value is None else value * _US


def workload_from_summaries(engine: str, summaries: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """A workload (docs/interfaces.md, "Workload") from request summaries: mappings with
    ``request_id``, ``added_ts`` (µs since the epoch), ``prompt_tokens``, ``completion_tokens``,
    ``finish_reason``, ``queue_us``, ``ttft_us`` and ``e2e_us``."""
    rows = list(summaries)
    timed = [s for s in rows if s.get("added_ts") is not None and (s.get("prompt_tokens") or 0) >= 1]
    dropped = len(rows) - len(timed)
    timed.sort(key=lambda s: s["added_ts"])
    first = timed[0]["added_ts"] if timed else None
    requests = [{
        "request_id": s["request_id"], "offset_s": (s["added_ts"] - first) * _US,
        "prompt_tokens": s["prompt_tokens"], "completion_tokens": s.get("completion_tokens") or 0,
        "cached_tokens": 0, "max_tokens": s.get("completion_tokens") or None,
        "temperature": 0.0, "top_p": 1.0, "n": 1, "seed": None, "ignore_eos": True,
        "finish_reason": s.get("finish_reason") or "", "queue_s": _seconds(s.get("queue_us")),
        "ttft_s": _seconds(s.get("ttft_us")), "e2e_s": _seconds(s.get("e2e_us")) or 0.0,
    } for s in timed]
    return {"engine": engine, "first_arrival_unix": first * _US if first is not None else None,
            "capacity": len(requests), "dropped": dropped, "requests": requests, "text_captured": False,
            "format": WORKLOAD_FORMAT, "version": WORKLOAD_VERSION}
