"""How late the server's event loop runs: the one number that says whether the process serves.

Every request, stream, websocket and background task of a server process shares one asyncio
loop; whatever holds it (a parse on the loop, a blocking call, the GIL held by a worker thread)
delays them all alike. :class:`LoopLagMonitor` asks the loop for a timer every
:data:`INTERVAL_S` and records how late it fires, the way Node's ``monitorEventLoopDelay`` and
uvloop users measure it. ``GET /metrics`` exports it as ``<prefix>event_loop_lag_seconds`` (a histogram)
and ``GET /stats`` as the last minute's p50/p99/max, which the soak (``bench/soak.py``) checks.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

from engines.runtime import HistogramSnapshot, LatencyDistribution

__all__ = ["LAG_BUCKETS", "LoopLagMonitor", "loop_lag"]

#: Seconds between probes: often enough to see a 100 ms stall, cheap (10 wake-ups a second).
INTERVAL_S = 0.1
#: Histogram bounds (seconds): a healthy loop sits in the first two, a stalled one past 0.1.
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
#: Probes kept for the percentiles: ten minutes' worth.
WINDOW = 6000


class LoopLagMonitor:
    """Probes one event loop's lag until stopped; readable from any thread of the loop's process."""

    def __init__(self, interval_s: float = INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.lag = LatencyDistribution(LAG_BUCKETS, WINDOW)
        self._task: asyncio.Task[None] | None = None
        #: When the probe last asked for its timer (perf_counter): a loop held now shows as this
        #: ageing, long before the late timer fires and is recorded (:meth:`current_lag`).
        self._asked: float | None = None

    def start(self) -> None:
        """Start probing the running loop (once: a second call does nothing)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="event-loop-lag")

    async def stop(self) -> None:
        """Stop probing (the figures so far are kept)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            asked = self._asked = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            fired = time.perf_counter()
            self.lag.observe(max(0.0, fired - asked - self.interval_s), at=fired)

    def current_lag(self) -> float:
        """Seconds the loop is late *now*, from any thread: how overdue the pending probe is
        (a blocked loop's lag grows while it is blocked); 0 while not probing."""
        asked = self._asked
        if asked is None or not self.running:
            return 0.0
        return max(0.0, time.perf_counter() - asked - self.interval_s)

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def histogram(self) -> HistogramSnapshot:
        """Every probe since the start, bucketed (Prometheus' ``<prefix>event_loop_lag_seconds``)."""
        return self.lag.histogram()

    def summary(self) -> dict[str, Any]:
        """The last minute's ``p50``/``p99``/``max`` and the whole run's ``max``, in milliseconds."""
        figures = self.lag.summary()
        count, _, _, _, recent, recent_at = self.lag.snapshot()
        minute = recent[recent_at >= time.perf_counter() - 60]
        return {"probes": count, "p50_ms_1m": figures["last_60s"]["p50"] * 1000,
                "p99_ms_1m": figures["last_60s"]["p99"] * 1000,
                "max_ms_1m": float(minute.max()) * 1000 if minute.size else 0.0, "max_ms": figures["max"] * 1000}


#: The server process's monitor (``manage.py serve`` starts it on Daphne's loop).
loop_lag = LoopLagMonitor()
