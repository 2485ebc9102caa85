"""The engine metrics' clock under a test's control: ``EngineMetrics`` reads ``time.perf_counter``
(its ``now`` window, when counting began), and so do its latency distributions (when each
observation came), and a test that builds a history of steps moves it."""
from __future__ import annotations

import pytest

import engines.runtime.telemetry.latency_distribution as latency_module
import engines.runtime.telemetry.metrics as metrics_module


class MetricsClock:
    """``time`` as the metrics modules see it: ``perf_counter()`` is :attr:`now`, set by the test."""

    def __init__(self, start: float) -> None:
        self.now = start

    def perf_counter(self) -> float:
        return self.now


def metrics_clock(monkeypatch: pytest.MonkeyPatch, start: float) -> MetricsClock:
    """Put a :class:`MetricsClock` at ``start`` in place of the metrics modules' clock (undone
    after the test)."""
    clock = MetricsClock(start)
    monkeypatch.setattr(metrics_module, "time", clock)
    monkeypatch.setattr(latency_module, "time", clock)
    return clock
