"""The watchdog at work: polls every engine's progress board from a thread of its own, feeds
each engine's :class:`~engines.watchdog.detector.StallDetector`, and captures the evidence of an
incident the moment one opens, before anyone restarts anything.

A thread, not a task of the event loop: the loop may be what is stuck (one of the three rules).
Each poll reads the board (``AsyncEngine.progress``, no question to the engine) and the loop's
current lag (``LoopLagMonitor.current_lag``), so it works against an engine process that is
stopped or wedged. The evidence (what :class:`StallIncident` ``.evidence`` holds) is taken on a
thread per incident, each part with a timeout, and a part that could not be taken names why under
``evidence["missing"]``: stacks of every thread of the server process (an engine thread's among
them), the engine process's stacks read from outside (py-spy), its requests in flight with their
states (the scheduler's queues), the KV pool, its metrics and its last trace events when it still
answers, the board, the configuration and the thresholds.

``/health`` answers 503 ``stalled`` with the reason while an incident is open (``serve
--stall-health-ok`` keeps 200), ``/metrics`` counts the stalls, ``POST /debug/list_incidents``
lists them (docs/dashboard.md, "Stalls").
"""
from __future__ import annotations

import dataclasses
import logging
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import orjson

from engines.server.loop_lag import LoopLagMonitor, loop_lag
from engines.registry import registry
from engines.watchdog.stack_capture import outside_stacks
from engines.watchdog.detector import ProgressReading, StallDetector, StallIncident, StallThresholds

if TYPE_CHECKING:
    from engines.runtime import AsyncEngine

__all__ = ["INCIDENTS_KEPT", "POLL_S", "StallWatch", "stall_watch"]

logger = logging.getLogger(__name__)

#: Seconds between polls: a stall is seen within its threshold plus this.
POLL_S = 0.5
#: Incidents kept per engine in memory (open and closed, newest first).
INCIDENTS_KEPT = 50
#: Seconds the evidence may wait for an engine that may never answer.
ANSWER_TIMEOUT_S = 3.0
#: Trace events kept with an incident (the newest).
TRACE_EVENTS_KEPT = 500

Listener = Callable[[StallIncident], None]


class StallWatch:
    """Every served engine's stall state; :meth:`start` polls them on a daemon thread."""

    def __init__(self, lag: LoopLagMonitor = loop_lag, poll_s: float = POLL_S) -> None:
        self.lag = lag
        self.poll_s = poll_s
        self.thresholds = StallThresholds()
        #: ``serve --stall-health-ok``: ``/health`` says ``stalled`` but answers 200.
        self.health_ok = False
        self._engines: Callable[[], Iterable[AsyncEngine]] = lambda: ()
        self._detectors: dict[str, StallDetector] = {}
        self._incidents: dict[str, deque[StallIncident]] = {}
        self._listeners: list[Listener] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def configure(self, thresholds: StallThresholds, health_ok: bool = False) -> None:
        """Set the rules' limits (for detectors made from now on: call before :meth:`start`)."""
        self.thresholds, self.health_ok = thresholds, health_ok
        with self._lock:
            self._detectors.clear()

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(incident)`` on the watch's threads when an incident opens, when its
        evidence has been taken (the two may come after its close) and when it closes."""
        self._listeners.append(listener)

    def start(self, engines: Callable[[], Iterable[AsyncEngine]]) -> None:
        """Poll ``engines()`` (the served ones, read each poll) until :meth:`stop`."""
        self._engines = engines
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="stall-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - the watchdog must outlive what it watches
                logger.exception("stall watch: a poll failed")

    def poll(self) -> list[StallIncident]:
        """One look at every engine; the incidents this poll opened (their evidence is being taken)."""
        opened = []
        lag_s = self.lag.current_lag()
        for engine in list(self._engines()):
            if not engine.is_alive:  # dead is not stalled: /health says dead already
                continue
            counts = engine.progress()
            reading = ProgressReading(at=time.monotonic(), steps=counts.steps, work=counts.work,
                                      step_started_at=counts.step_started_at, loop_lag_s=lag_s)
            with self._lock:
                detector = self._detectors.get(engine.name)
                if detector is None:
                    detector = self._detectors[engine.name] = StallDetector(engine.name, self.thresholds)
                before = detector.incident
                incident = detector.observe(reading)
                if incident is not None:
                    self._incidents.setdefault(engine.name, deque(maxlen=INCIDENTS_KEPT)).appendleft(incident)
            if incident is not None:
                opened.append(incident)
                logger.warning("engine %s stalled: %s (%s); taking the evidence", engine.name, incident.reason,
                               incident.detail)
                self._notify(incident)  # kept at once: the evidence may take tens of seconds (py-spy)
                threading.Thread(target=self._capture, args=(engine, incident, counts), daemon=True,
                                 name=f"stall-evidence-{engine.name}").start()
            elif before is not None and detector.incident is None:
                logger.warning("engine %s progresses again after %.1f s (%s)", engine.name,
                               before.duration_s or 0.0, before.reason)
                self._notify(before)
        return opened

    def open_incident(self, engine: str) -> StallIncident | None:
        with self._lock:
            detector = self._detectors.get(engine)
            return detector.incident if detector is not None else None

    def incidents(self, engine: str) -> list[StallIncident]:
        """``engine``'s incidents, newest first (open ones among them), at most :data:`INCIDENTS_KEPT`."""
        with self._lock:
            return list(self._incidents.get(engine, ()))

    def stalls_total(self, engine: str) -> int:
        with self._lock:
            detector = self._detectors.get(engine)
            return detector.stalls_total if detector is not None else 0

    def _notify(self, incident: StallIncident) -> None:
        for listener in self._listeners:
            try:
                listener(incident)
            except Exception:  # noqa: BLE001 - one listener's bug must not stop the watch
                logger.exception("stall watch: a listener failed")

    def _capture(self, engine: AsyncEngine, incident: StallIncident, counts: Any) -> None:
        incident.evidence = capture_evidence(engine, incident, counts, self.thresholds)
        self._notify(incident)


def capture_evidence(engine: AsyncEngine, incident: StallIncident, counts: Any,
                     thresholds: StallThresholds) -> dict[str, Any]:
    """What an incident keeps (module docstring); ``missing`` names each part not taken, and why."""
    missing: dict[str, str] = {}
    evidence: dict[str, Any] = {
        "progress": dataclasses.asdict(counts),
        "thresholds": dataclasses.asdict(thresholds),
        "configuration": {"engine": engine.name, "mode": "process" if engine.process else "thread",
                          "backend": engine.backend_name, "dtype": engine.dtype,
                          "checkpoint": str(engine.checkpoint.path), **_plain(engine.config)},
        "server_stacks": server_stacks(),
        # What the server side knows of the requests, which a stopped engine cannot tell.
        "server_streams": engine.stream_ids(),
    }
    pid = engine.pid
    if pid is not None:
        outside = outside_stacks(pid)
        if outside.text is not None:
            evidence["engine_stacks"] = outside.text
        else:
            missing["engine_stacks"] = outside.missing or "py-spy read nothing"
    try:
        reading = engine.dashboard_reading_blocking(ANSWER_TIMEOUT_S, with_text=registry.options.capture_text)
    except Exception as exc:  # noqa: BLE001 - a timeout or a dead engine: both are findings
        why = f"the engine did not answer in {ANSWER_TIMEOUT_S:g} s" if _is_timeout(exc) else repr(exc)
        for part in ("requests", "kv_cache", "metrics"):
            missing[part] = why
    else:
        evidence["requests"] = [dataclasses.asdict(r) for r in reading.live.requests]
        evidence["requests_total"] = reading.live.total
        evidence["kv_cache"] = dataclasses.asdict(reading.kv)
        evidence["metrics"] = reading.metrics
    if not engine.tracing_enabled:
        missing["trace"] = "tracing is off (serve --enable-tracing records it)"
    else:
        try:
            raw = engine.dump_trace_blocking(timeout=ANSWER_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001
            missing["trace"] = (f"the engine did not answer in {ANSWER_TIMEOUT_S:g} s" if _is_timeout(exc)
                                else repr(exc))
        else:
            events = orjson.loads(raw).get("traceEvents", []) if raw else []
            evidence["trace_events"] = events[-TRACE_EVENTS_KEPT:]
    evidence["missing"] = missing
    return evidence


def server_stacks() -> str:
    """Every thread's Python stack in this (the server's) process, as ``faulthandler`` prints them."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"Thread {ident} ({names.get(ident, '?')}):\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


def _is_timeout(exc: BaseException) -> bool:
    return isinstance(exc, TimeoutError) or type(exc).__name__ == "TimeoutError"


def _plain(config: Any) -> dict[str, Any]:
    """A dataclass config as JSON-ready values (enums and paths as text)."""
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        return {}
    return {k: v if isinstance(v, (int, float, str, bool, type(None))) else str(v)
            for k, v in dataclasses.asdict(config).items()}


#: The server process's watch (``manage.py serve`` configures and starts it).
stall_watch = StallWatch()
