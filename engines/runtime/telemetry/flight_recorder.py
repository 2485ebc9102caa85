"""The flight recorder: the engine's last requests as a workload another server can be sent.

Always on and bounded (:data:`CAPACITY` requests an engine, about 300 bytes each: a few hundred
kB, stated in docs/interfaces.md, "Workload"): each request that ends is kept with what a replay
needs (when it came relative to the others, its sampling parameters, its prompt's and output's
token counts) and what it measured (outcome, queue, TTFT, E2E). No text and no token ids: a replay
sends prompts of the same token lengths. :meth:`FlightRecorder.dump` is the versioned
:class:`Workload` that ``POST /debug/dump_workload`` answers.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["CAPACITY", "WORKLOAD_FORMAT", "WORKLOAD_VERSION", "FlightRecorder", "Workload", "WorkloadRequest"]

#: Requests kept an engine (the newest).
CAPACITY = 2000
#: What a workload's JSON names itself, and its format's version (docs/interfaces.md, "Workload").
WORKLOAD_FORMAT = "llm-debugsite.workload"
WORKLOAD_VERSION = 1


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    """One request as recorded. ``arrival`` is ``perf_counter`` seconds (a dump turns it into
    ``offset_s``, from the workload's first arrival); times are seconds, None where the moment never came."""

    request_id: str
    arrival: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    max_tokens: int | None
    temperature: float
    top_p: float
    n: int
    seed: int | None
    ignore_eos: bool
    finish_reason: str
    queue_s: float | None
    ttft_s: float | None
    e2e_s: float


@dataclass(frozen=True)
class Workload:
    """The recorder's requests, oldest arrival first: the JSON of ``/debug/dump_workload``."""

    engine: str
    first_arrival_unix: float | None
    capacity: int
    #: Requests that ended since the start or reset but fell out of the window.
    dropped: int
    requests: list[dict[str, Any]] = field(default_factory=list)
    format: str = WORKLOAD_FORMAT
    version: int = WORKLOAD_VERSION

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class FlightRecorder:
    """The last :data:`CAPACITY` requests of one engine (engine thread writes, any thread reads)."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        self._requests: deque[WorkloadRequest] = deque(maxlen=capacity)
        self._recorded = 0
        self._lock = threading.Lock()

    def record(self, request: WorkloadRequest) -> None:
        with self._lock:
            self._requests.append(request)
            self._recorded += 1

    def clear(self) -> None:
        with self._lock:
            self._requests.clear()
            self._recorded = 0

    def dump(self, engine: str) -> Workload:
        """The window as a :class:`Workload`: arrivals as offsets from the first, the first on the wall clock."""
        with self._lock:
            held = sorted(self._requests, key=lambda r: r.arrival)
            dropped = self._recorded - len(held)
        if not held:
            return Workload(engine, None, self.capacity, dropped)
        first = held[0].arrival
        first_unix = time.time() - (time.perf_counter() - first)
        rows = []
        for r in held:
            row = asdict(r)
            row["offset_s"] = row.pop("arrival") - first
            rows.append(row)
        return Workload(engine, first_unix, self.capacity, dropped, rows)
