"""Background history capture while serving: trace windows and metrics snapshots, periodically.

``manage.py serve --trace-autosave SECONDS --metrics-snapshot-interval SECONDS`` starts a
:class:`HistoryAutosave` on Daphne's event loop before it serves, and stops it after Daphne
stopped and before the engines do; tests start one on their own loop. Each engine gets its own
tasks, so a slow save of one engine's large trace never delays another engine's.

Trace windows: every interval, each tracing engine's trace is taken and emptied in one step
(``TraceRecorder.dump_json(clear=True)``) and saved with source "automatic", so consecutive
records tile a long run without gaps or overlap. A window in which the engine recorded nothing
is skipped rather than saved as an empty record. Stopping saves the last, partial window.

Metrics: every interval, each engine's metrics are read and saved as a
:class:`~engines.models.MetricsSnapshot`, unless they equal the last snapshot this autosave saved
for that engine, fields that are timestamps aside (keys named ``timestamp``, ``time`` or ``now``,
or ending in ``_ts``, ``_at`` or ``_timestamp``, at any depth: they move while nothing else
does). An idle engine so adds no row per interval, yet one is still saved at least every
``metrics_heartbeat_s`` (:data:`METRICS_HEARTBEAT_S`, 10 minutes), so a chart of the history
shows the idle stretch and a gap longer than that means the server was not taking snapshots.
Read the other way: between two saved snapshots the metrics stayed those of the first until,
at most, one interval before the second (``engines.history.metrics_charts`` draws them so).

Dumping, saving and the database all run on worker threads (see
:func:`engines.history.capture.asave_engine_trace`): the event loop keeps serving, and the
engine thread waits only on the recorder's lock for a pointer swap. A failed save (database
down) is logged and the loop goes on; that trace window is lost, since it was already cleared
and keeping it would make the next record repeat it.
"""
from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from django.db import DatabaseError

from engines.history.capture import HistoryUnavailableError, asave_engine_trace, asave_metrics_snapshot
from engines.models import MetricsSnapshot, TraceRecord
from engines.server.cancellation import within

if TYPE_CHECKING:  # the runtime (numba and all) loads only where engines are built
    from engines.runtime import AsyncEngine

logger = logging.getLogger(__name__)

Action = Callable[["AsyncEngine"], Awaitable[object]]

#: The longest an engine goes without a metrics snapshot while its metrics stay the same.
METRICS_HEARTBEAT_S = 600.0

_TIMESTAMP_KEYS = frozenset({"timestamp", "time", "now"})
_TIMESTAMP_SUFFIXES = ("_ts", "_at", "_timestamp")


def is_timestamp_key(key: str) -> bool:
    """Whether a metrics field names a moment (which moves while the engine does nothing), not a
    measurement: ``engine_decode_time_sum`` is a measurement, ``sampled_at`` a moment."""
    return key in _TIMESTAMP_KEYS or key.endswith(_TIMESTAMP_SUFFIXES)


def comparable_metrics(metrics: Any) -> Any:
    """``metrics`` as stored (non-finite floats as ``None``), without its timestamp fields: two
    samples with equal comparable metrics say the same about the engine."""
    if isinstance(metrics, Mapping):
        return {str(k): comparable_metrics(v) for k, v in metrics.items() if not is_timestamp_key(str(k))}
    if isinstance(metrics, (list, tuple)):
        return [comparable_metrics(v) for v in metrics]
    if isinstance(metrics, float) and not math.isfinite(metrics):
        return None  # as the snapshot stores it (jsonb has no NaN), and NaN != NaN
    return metrics


class UnchangedMetricsGate:
    """Per engine, whether a metrics sample is worth a snapshot: it differs from the last one
    saved (timestamps aside), or that one is ``heartbeat_s`` old. Times are ``loop.time()``."""

    def __init__(self, heartbeat_s: float = METRICS_HEARTBEAT_S) -> None:
        self.heartbeat_s = heartbeat_s
        self._last: dict[str, tuple[Any, float]] = {}  # engine -> (comparable metrics, saved at)

    def wanted(self, engine: str, metrics: Mapping[str, Any], now: float) -> bool:
        last = self._last.get(engine)
        return last is None or now - last[1] >= self.heartbeat_s or comparable_metrics(metrics) != last[0]

    def saved(self, engine: str, metrics: Mapping[str, Any], now: float) -> None:
        """Record that ``metrics`` were saved for ``engine`` at ``now`` (a failed save is not)."""
        self._last[engine] = (comparable_metrics(metrics), now)


class HistoryAutosave:
    """Periodic trace windows and metrics snapshots of a fixed set of engines.

    An interval of 0 turns that kind of capture off. Use it as
    ``autosave.start()`` (on the loop that serves) ... ``await autosave.stop()``.
    """

    def __init__(self, engines: Iterable["AsyncEngine"], *, trace_interval_s: float = 0,
                 metrics_interval_s: float = 0, metrics_heartbeat_s: float = METRICS_HEARTBEAT_S) -> None:
        for name, value, zero in (("trace_interval_s", trace_interval_s, "off"),
                                  ("metrics_interval_s", metrics_interval_s, "off"),
                                  ("metrics_heartbeat_s", metrics_heartbeat_s, "save every snapshot")):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a number of seconds >= 0 (0: {zero}), not {value!r}")
        self.engines = list(engines)
        self.trace_interval_s = float(trace_interval_s)
        self.metrics_interval_s = float(metrics_interval_s)
        self.metrics_gate = UnchangedMetricsGate(float(metrics_heartbeat_s))
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping: asyncio.Event | None = None

    @property
    def traced_engines(self) -> list["AsyncEngine"]:
        """The engines whose trace is autosaved: those recording one, when trace autosave is on."""
        if not self.trace_interval_s:
            return []
        return [engine for engine in self.engines if engine.tracing_enabled]

    @property
    def tasks(self) -> tuple[asyncio.Task[None], ...]:
        """The running tasks (``serve`` spares them when it cancels what Daphne left behind)."""
        return tuple(self._tasks)

    @property
    def running(self) -> bool:
        """True between :meth:`start` and the end of :meth:`stop`."""
        return self._stopping is not None

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start one task per engine and kind on ``loop`` (default: the running loop).

        ``serve`` passes Daphne's loop before it runs; the tasks begin when it does.
        """
        if self.running:
            raise RuntimeError("this HistoryAutosave is already running")
        loop = loop or asyncio.get_running_loop()
        stopping = self._stopping = asyncio.Event()
        for engine in self.traced_engines:
            self._tasks.append(loop.create_task(
                _every(self.trace_interval_s, self.save_trace_window, engine, stopping),
                name=f"trace-autosave-{engine.name}"))
        if self.metrics_interval_s:
            for engine in self.engines:
                self._tasks.append(loop.create_task(
                    _every(self.metrics_interval_s, self.save_metrics_snapshot, engine, stopping),
                    name=f"metrics-snapshot-{engine.name}"))

    async def stop(self, *, save_last_window: bool = True) -> None:
        """Stop the tasks, letting a save in progress finish, then (by default) save each
        engine's last trace window, so a shutdown loses none of the run. Safe to call twice."""
        if self._stopping is None:
            return
        self._stopping.set()
        tasks, self._tasks = self._tasks, []
        await asyncio.gather(*tasks, return_exceptions=True)
        self._stopping = None
        if save_last_window:
            for engine in self.traced_engines:
                await _logged(self.save_trace_window, engine)

    async def save_trace_window(self, engine: "AsyncEngine") -> TraceRecord | None:
        """Save ``engine``'s trace since the last window and empty it; ``None`` (and nothing
        saved) when the engine recorded nothing meanwhile."""
        if not engine.tracing_enabled:
            return None
        return await asave_engine_trace(engine, clear=True, source=TraceRecord.Source.AUTOMATIC, skip_empty=True)

    async def save_metrics_snapshot(self, engine: "AsyncEngine") -> MetricsSnapshot | None:
        """Save one sample of ``engine``'s metrics; ``None`` (and nothing saved) when they equal the
        last one saved and that is younger than the heartbeat (see the module's docstring)."""
        metrics = await engine.metrics()
        now = asyncio.get_running_loop().time()
        if not self.metrics_gate.wanted(engine.name, metrics, now):
            return None
        snapshot = await asave_metrics_snapshot(engine.name, engine.checkpoint.name, metrics)
        self.metrics_gate.saved(engine.name, metrics, now)
        return snapshot


async def _every(interval_s: float, action: Action, engine: "AsyncEngine", stopping: asyncio.Event) -> None:
    """Run ``action(engine)`` every ``interval_s`` seconds until ``stopping`` is set.

    Deadlines are fixed (start + k * interval), so saves don't drift by their own duration;
    one that overran its interval is followed by the next at once. The loop checks
    ``stopping`` only between actions, so stopping never cuts a save off halfway.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + interval_s
    while True:
        try:
            await within(stopping.wait(), max(0.0, deadline - loop.time()))
            return
        except asyncio.TimeoutError:
            pass
        await _logged(action, engine)
        deadline = max(deadline + interval_s, loop.time())


async def _logged(action: Action, engine: "AsyncEngine") -> None:
    # One failed save (database down, disk full) must not end the capture of the whole run.
    from engines.runtime import EngineDeadError  # the runtime is loaded by now; this module stays cheap

    if not engine.is_alive:
        return  # dead or restarting: the engine's supervisor has said so, once
    try:
        await action(engine)
    except EngineDeadError:
        pass  # died mid-action: the same
    except HistoryUnavailableError as exc:  # the database is away: said once a try, resumes by itself
        logger.warning("history autosave: %s of engine %s waits for the database: %s", action.__name__,
                       engine.name, exc)
    except DatabaseError as exc:  # it went away between the check and the save
        logger.warning("history autosave: %s of engine %s failed, the database went away: %s", action.__name__,
                       engine.name, exc)
    except Exception:
        logger.exception("history autosave: %s of engine %s failed", action.__name__, engine.name)
