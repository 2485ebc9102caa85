"""A latency's distribution (TTFT, inter-token latency, end-to-end, queue time) in bounded memory.

Count, sum, min and max are exact since the last reset; p50/p90/p99 are over the most recent
``latency_window`` requests (a ring buffer: a live server's "now" matters more than its first
hour), and ``last_60s`` / ``last_300s`` over those of them observed in the last minute and five
minutes (what the dashboard shows: an outage an hour ago no longer holds a p99 up); and bucket
counts over the distribution's bounds are exact since the reset (a :class:`HistogramSnapshot`, a
Prometheus histogram's). ``telemetry.metrics.EngineMetrics`` holds one per latency, with vLLM's
bounds, and guards them with its lock.

Times are ``time.perf_counter()`` seconds.
"""
from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["DEFAULT_LATENCY_WINDOW", "HistogramSnapshot", "LatencyDistribution", "RECENT_WINDOWS_S", "summarize"]

DEFAULT_LATENCY_WINDOW = 4096


@dataclass(frozen=True)
class HistogramSnapshot:
    """Bucket counts of one distribution, ready for a Prometheus histogram.

    ``bucket_counts[i]`` counts observations ``<= bounds[i]`` and ``> bounds[i-1]``; the last
    entry counts those above every bound (the ``+Inf`` bucket's own share).
    """

    bounds: tuple[float, ...]
    bucket_counts: tuple[int, ...]
    sum: float
    count: int

    def cumulative(self) -> list[tuple[float, int]]:
        """Prometheus ``(le, cumulative count)`` pairs, ending with ``(math.inf, count)``."""
        out = []
        total = 0
        for le, n in zip((*self.bounds, math.inf), self.bucket_counts, strict=True):
            total += n
            out.append((le, total))
        return out

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: ``le`` of the last bucket is the string ``"+Inf"`` (JSON has no inf)."""
        return {
            "buckets": [["+Inf" if math.isinf(le) else le, n] for le, n in self.cumulative()],
            "sum": self.sum,
            "count": self.count,
        }


class LatencyDistribution:
    """One latency's distribution in bounded memory.

    Exact since the last reset: count, sum, min, max and bucket counts over ``bounds``.
    Percentiles: over the most recent ``window`` observations (ring buffer). Not thread-safe
    on its own: :class:`EngineMetrics` guards it with its lock.
    """

    __slots__ = ("bounds", "window", "count", "sum", "min", "max", "_buckets", "_recent", "_recent_at")

    def __init__(self, bounds: Sequence[float], window: int = DEFAULT_LATENCY_WINDOW) -> None:
        if list(bounds) != sorted(bounds) or not all(math.isfinite(b) for b in bounds):
            raise ValueError(f"histogram bounds must be finite and increasing, got {bounds!r}")
        if window < 1:
            raise ValueError(f"latency window must be at least 1, got {window}")
        self.bounds = tuple(float(b) for b in bounds)
        self.window = window
        self._recent = np.zeros(window, np.float64)
        self._recent_at = np.zeros(window, np.float64)  # when each was observed (perf_counter seconds)
        self.reset()

    def reset(self) -> None:
        self.count = 0
        self.sum = 0.0
        self.min = 0.0
        self.max = 0.0
        self._buckets = [0] * (len(self.bounds) + 1)

    def observe(self, seconds: float, at: float | None = None) -> None:
        """Add one observation, made at ``at`` (``time.perf_counter()``, default now); non-finite
        values are ignored (they'd poison every statistic)."""
        if not math.isfinite(seconds):
            return
        if self.count == 0 or seconds < self.min:
            self.min = seconds
        if self.count == 0 or seconds > self.max:
            self.max = seconds
        self._recent[self.count % self.window] = seconds
        self._recent_at[self.count % self.window] = time.perf_counter() if at is None else at
        self.count += 1
        self.sum += seconds
        self._buckets[bisect_left(self.bounds, seconds)] += 1

    def snapshot(self) -> tuple[int, float, float, float, np.ndarray, np.ndarray]:
        """``(count, sum, min, max, recent, recent_at)``, copies of the (at most ``window``)
        observations the percentiles are over and of when each was made: cheap, under a lock."""
        held = min(self.count, self.window)
        return self.count, self.sum, self.min, self.max, self._recent[:held].copy(), self._recent_at[:held].copy()

    def summary(self, now: float | None = None) -> dict[str, Any]:
        """``count``, ``sum``, ``mean``, ``min``, ``max`` (since reset), ``p50``/``p90``/``p99``
        (numpy's linear interpolation over the recent window; 0.0 when empty), and ``last_60s`` /
        ``last_300s``: ``count``, ``p50``, ``p99`` of the observations made in the last minute and
        five minutes before ``now`` (``time.perf_counter()``, default now)."""
        return summarize(*self.snapshot(), now=now)

    def histogram(self) -> HistogramSnapshot:
        return HistogramSnapshot(self.bounds, tuple(self._buckets), self.sum, self.count)


#: The recent windows a distribution's summary gives percentiles over (seconds).
RECENT_WINDOWS_S = (60, 300)


def summarize(count: int, total: float, lo: float, hi: float, recent: np.ndarray, recent_at: np.ndarray,
              now: float | None = None) -> dict[str, Any]:
    """A :meth:`LatencyDistribution.snapshot`'s summary (what :meth:`LatencyDistribution.summary`
    says), computed outside the lock the snapshot was taken under."""
    if recent.size:
        p50, p90, p99 = (float(v) for v in np.percentile(recent, (50.0, 90.0, 99.0)))
    else:
        p50 = p90 = p99 = 0.0
    out: dict[str, Any] = {"count": count, "sum": total, "mean": total / count if count else 0.0,
                           "min": lo, "max": hi, "p50": p50, "p90": p90, "p99": p99}
    now = time.perf_counter() if now is None else now
    for seconds in RECENT_WINDOWS_S:
        window = recent[recent_at >= now - seconds]
        p50_w, p99_w = (float(v) for v in np.percentile(window, (50.0, 99.0))) if window.size else (0.0, 0.0)
        out[f"last_{seconds}s"] = {"count": int(window.size), "p50": p50_w, "p99": p99_w}
    return out
