"""Cumulative readings turned into recent ones: a counter's rate over the readings of the last few
seconds, and a histogram's observations over the last minute. Used for our own engines (their
metrics are cumulative since a reset) and for foreign servers' ``/metrics`` alike.

Both are over a window of readings, not between the last two: a rate between two polls a second
apart jumps by a step's worth of tokens (a 0.26 s step, one more or less in a second), and a
window of :data:`RATE_WINDOW_S` holds still, the same window as our engines' ``now`` figures.
"""
from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

from engines.fleet.quantiles import Buckets, window_delta
from engines.runtime import NOW_WINDOW_S

__all__ = ["RATE_WINDOW_S", "CounterRate", "HistogramWindow"]

#: Seconds of readings a counter's rate is over (at least; see :class:`CounterRate`).
RATE_WINDOW_S = NOW_WINDOW_S

_Reading = TypeVar("_Reading")


class _Readings(Generic[_Reading]):
    """The readings a window needs: the newest one at or before the window's start (the base a
    change is counted from), and every one since."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._ring: deque[tuple[float, _Reading]] = deque()

    def add(self, now: float, reading: _Reading) -> tuple[float, _Reading] | None:
        """Record a reading at ``now`` (monotonic seconds); the base, ``(time, reading)``: the
        newest at least ``window_s`` old, or the oldest kept until a window has passed, or None
        for the first reading."""
        ring = self._ring
        ring.append((now, reading))
        while len(ring) > 2 and ring[1][0] <= now - self.window_s:
            ring.popleft()
        return ring[0] if len(ring) > 1 else None

    @property
    def newest(self) -> tuple[float, _Reading] | None:
        """The last reading recorded, ``(time, reading)``."""
        return self._ring[-1] if self._ring else None

    def restart(self, now: float, reading: _Reading) -> None:
        """Forget every reading but this one (the source restarted: its counts began anew)."""
        self._ring.clear()
        self._ring.append((now, reading))


class CounterRate:
    """A cumulative counter's rate over the last ``window_s`` seconds of readings: its change since
    the newest reading at least that old (or the oldest kept, until a window has passed), per
    second of the time between. With readings ``p`` seconds apart the window is ``window_s`` to
    ``window_s + p``. None for the first reading, and for one where the counter went back (its
    source restarted in between: the window starts again there)."""

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self._readings: _Readings[float] = _Readings(window_s)

    def add(self, now: float, value: float) -> float | None:
        """Record ``value`` read at ``now`` (monotonic seconds); the rate per second over the window."""
        last = self._readings.newest
        if last is not None and (now <= last[0] or value < last[1]):
            self._readings.restart(now, value)
            return None
        base = self._readings.add(now, value)
        if base is None:
            return None
        return (value - base[1]) / (now - base[0])


class HistogramWindow:
    """The observations of a cumulative histogram within the last ``window_s`` seconds: the
    difference between the newest reading and the newest one at least ``window_s`` old (or the
    oldest kept, until a window has passed)."""

    def __init__(self, window_s: float = 60.0) -> None:
        self._readings: _Readings[Buckets] = _Readings(window_s)

    def add(self, now: float, buckets: Buckets) -> Buckets:
        """Record a reading; the window's observations (all the reading holds after a restart or
        a change of bounds)."""
        base = self._readings.add(now, buckets)
        delta = window_delta(buckets, base[1] if base is not None else None)
        if delta is None:
            self._readings.restart(now, buckets)
            return buckets
        return delta
