"""Stalls: an engine that is up but not progressing, seen as it happens.

A dead engine is easy (its process ended; ``/health`` already says so). The outages of hours
(vLLM #2731, the watchdog RFC #56816) are engines alive and answering nothing: a hung device,
a step that never ends, a server loop held by a blocking call. :class:`StallDetector` turns
readings taken every poll into a verdict by three rules, each with a stated threshold:

- ``no_progress``: work is waiting (requests running or queued) and no step finished for
  ``no_progress_s``;
- ``long_step``: the step in flight has run for longer than ``step_s``;
- ``loop_lag``: the server's event loop ran its timer later than ``loop_lag_s``
  (:mod:`engines.server.loop_lag`).

The detector is plain logic over :class:`ProgressReading` values (no clock of its own, no
process), so each rule is tested on constructed readings; a poller feeds it real ones.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["NO_PROGRESS_S", "STEP_S", "LOOP_LAG_S", "ProgressReading", "StallIncident",
           "StallThresholds", "StallDetector"]

#: Defaults. Generous on purpose: a cold numba compile or a 32k-token prefill chunk on two CPU
#: cores takes tens of seconds, and a false incident teaches operators to ignore the real one.
NO_PROGRESS_S = 60.0
STEP_S = 120.0
LOOP_LAG_S = 5.0


@dataclass(frozen=True)
class StallThresholds:
    """The three rules' limits in seconds (``serve --stall-*`` set them)."""

    no_progress_s: float = NO_PROGRESS_S
    step_s: float = STEP_S
    loop_lag_s: float = LOOP_LAG_S

    def __post_init__(self) -> None:
        for name in ("no_progress_s", "step_s", "loop_lag_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"stall threshold {name} must be > 0 seconds, got {getattr(self, name)}")


@dataclass(frozen=True)
class ProgressReading:
    """What one poll saw of one engine.

    ``steps`` is the engine's finished-step count, ``None`` when the engine did not answer
    the poll in time (a stopped or wedged process: the count is unknown, not zero);
    ``work`` the requests it holds (running + waiting) at its last answer; ``step_started_at``
    when its current step began (``None`` between steps); ``loop_lag_s`` the server loop's
    latest lag. Times are ``time.monotonic()`` seconds.
    """

    at: float
    steps: int | None
    work: int
    step_started_at: float | None = None
    loop_lag_s: float = 0.0


@dataclass
class StallIncident:
    """One stall, from the poll that saw it to the one that saw progress again.

    ``evidence`` holds what was captured when it opened (stacks, queues, KV pool, requests,
    trace, metrics, configuration); each part that could not be taken names why under
    ``evidence["missing"]`` rather than being silently absent.
    """

    engine: str
    reason: str
    detail: str
    opened_at: float
    opened_wall: float = field(default_factory=time.time)
    closed_at: float | None = None
    evidence: dict[str, Any] = field(default_factory=dict)

    @property
    def open(self) -> bool:
        return self.closed_at is None

    @property
    def duration_s(self) -> float | None:
        """Seconds from open to close; ``None`` while it lasts."""
        return None if self.closed_at is None else self.closed_at - self.opened_at

    def as_dict(self) -> dict[str, Any]:
        return {"engine": self.engine, "reason": self.reason, "detail": self.detail,
                "opened_at": self.opened_wall, "open": self.open, "duration_s": self.duration_s,
                "evidence": self.evidence}


class StallDetector:
    """One engine's stall state across polls: opens an incident on the first reading that
    breaks a rule, closes it on the first that shows progress (a step finished, the loop on
    time again), and counts the incidents opened (``/metrics``' stall counter)."""

    def __init__(self, engine: str, thresholds: StallThresholds | None = None) -> None:
        self.engine = engine
        self.thresholds = thresholds or StallThresholds()
        self.stalls_total = 0
        self.incident: StallIncident | None = None
        self._steps: int | None = None
        self._progress_at: float | None = None

    def observe(self, reading: ProgressReading) -> StallIncident | None:
        """Take one reading; return the incident it *opened* (to capture evidence for at
        once), else ``None``. :attr:`incident` is the open one, if any."""
        progressed = reading.steps is not None and reading.steps != self._steps
        if progressed or self._progress_at is None or (reading.work == 0 and reading.steps is not None):
            # Idle is not stalled: no work waiting restarts the clock too.
            self._progress_at = reading.at
        if reading.steps is not None:
            self._steps = reading.steps
        verdict = self._verdict(reading)
        if verdict is None:
            if self.incident is not None and (progressed or reading.work == 0):
                self.incident.closed_at = reading.at
                self.incident = None
            return None
        if self.incident is not None:
            return None
        reason, detail = verdict
        self.incident = StallIncident(self.engine, reason, detail, opened_at=reading.at)
        self.stalls_total += 1
        return self.incident

    def _verdict(self, r: ProgressReading) -> tuple[str, str] | None:
        t = self.thresholds
        if r.step_started_at is not None and r.at - r.step_started_at > t.step_s:
            return "long_step", f"one step has run {r.at - r.step_started_at:.1f} s (limit {t.step_s:g} s)"
        assert self._progress_at is not None
        idle_for = r.at - self._progress_at
        if r.work > 0 and idle_for > t.no_progress_s:
            answer = "" if r.steps is not None else "; the engine process does not answer"
            return ("no_progress", f"{r.work} request(s) waiting and no step finished for {idle_for:.1f} s "
                    f"(limit {t.no_progress_s:g} s){answer}")
        if r.loop_lag_s > t.loop_lag_s:
            return "loop_lag", f"the server's event loop ran {r.loop_lag_s:.2f} s late (limit {t.loop_lag_s:g} s)"
        return None
