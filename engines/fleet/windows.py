"""Cumulative readings turned into recent ones: a counter's rate since the previous reading, and
a histogram's observations over the last minute. Used for our own engines (their metrics are
cumulative since a reset) and for foreign servers' ``/metrics`` alike."""
from __future__ import annotations

from collections import deque

from engines.fleet.quantiles import Buckets, window_delta

__all__ = ["CounterRate", "HistogramWindow"]


class CounterRate:
    """The rate of a cumulative counter between successive readings (None for the first reading,
    and for one where the counter went back: its source restarted in between)."""

    def __init__(self) -> None:
        self._last: tuple[float, float] | None = None

    def add(self, now: float, value: float) -> float | None:
        """Record ``value`` read at ``now`` (monotonic seconds); the rate per second since the last."""
        last, self._last = self._last, (now, value)
        if last is None or now <= last[0] or value < last[1]:
            return None
        return (value - last[1]) / (now - last[0])


class HistogramWindow:
    """The observations of a cumulative histogram within the last ``window_s`` seconds: the
    difference between the newest reading and the newest one at least ``window_s`` old (or the
    oldest kept, until a window has passed)."""

    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self._ring: deque[tuple[float, Buckets]] = deque()

    def add(self, now: float, buckets: Buckets) -> Buckets:
        """Record a reading; the window's observations (all the reading holds after a restart or
        a change of bounds)."""
        ring = self._ring
        ring.append((now, buckets))
        while len(ring) > 2 and ring[1][0] <= now - self.window_s:
            ring.popleft()  # keep the newest reading at or before the window's start
        delta = window_delta(buckets, ring[0][1] if len(ring) > 1 else None)
        if delta is None:
            ring.clear()
            ring.append((now, buckets))
            return buckets
        return delta
