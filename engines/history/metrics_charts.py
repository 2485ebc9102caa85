"""Metrics snapshots as chart series: what the admin's snapshot list draws above its table.

For the staff who keep that page open: one engine's snapshots over time as the engine page's
live charts show them (tokens/s, running and waiting requests, KV-cache use, TTFT and
inter-token latency, preemptions), from the history instead of the last five minutes.

:func:`snapshot_charts` reads the newest :data:`MAX_CHART_POINTS` snapshots of a filtered
queryset, only the metrics the charts use (JSON key lookups: never the whole metrics column),
and shapes them here, so the page's script (``static/engines/js/history/snapshots.js``) only
draws. The rules, which follow how ``engines.history.autosave`` saves snapshots:

* Rates (tokens/s) are the change of a counter (``*_tokens_processed``) between two points over
  the seconds between them; a counter that went down (a reset, a restart) gives no rate there.
* A gap longer than 1.5 intervals is a stretch the autosave skipped because the metrics did not
  change: the first snapshot's values held until one interval before the next, so a point with
  them is put there. The interval is not stored: it is the shortest usual gap between snapshots
  (the lowest tenth of the gaps; every gap is about a whole number of intervals, and at least
  the stretches of activity are one interval apart). Lines stay flat over
  an idle stretch, and the rate after it counts over one interval, not over the whole stretch.
* A gap longer than the autosave's heartbeat (plus an interval) means no snapshot was taken
  (the server was down, or snapshots off): the lines break there.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import pairwise
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db.models import QuerySet

from engines.history.autosave import METRICS_HEARTBEAT_S

__all__ = ["CHARTS", "MAX_CHART_POINTS", "ChartSeries", "MetricsChart", "chart_data", "snapshot_charts"]

#: The most snapshots one page charts: the newest ones (8 hours at the default 10 s).
MAX_CHART_POINTS = 3000


@dataclass(frozen=True)
class ChartSeries:
    """One line: its legend label, colour, and where its values come from: a metric (``path``,
    ``__``-separated keys into the snapshot's metrics) times ``scale``, or with ``rate`` the
    change of that counter per second."""

    label: str
    color: str
    path: str
    scale: float = 1.0
    rate: bool = False


@dataclass(frozen=True)
class MetricsChart:
    """One chart: its key and title, its lines, and whether its values are counts (``integer``:
    its axis ticks at whole numbers, never 0.5 requests)."""

    key: str
    title: str
    series: tuple[ChartSeries, ...]
    integer: bool = False


# The engine page's live charts (static/engines/js/engine.js), in its colours.
CHARTS: tuple[MetricsChart, ...] = (
    MetricsChart("rates", "Tokens/s", (
        ChartSeries("prefill tok/s", "#417690", "prefill_tokens_processed", rate=True),
        ChartSeries("decode tok/s", "#d46a00", "decode_tokens_processed", rate=True))),
    MetricsChart("requests", "Requests", (
        ChartSeries("running", "#417690", "num_running_requests"),
        ChartSeries("waiting", "#ba2121", "num_waiting_requests")), integer=True),
    MetricsChart("kv", "KV-cache use (%)", (
        ChartSeries("KV cache %", "#417690", "kv_cache_usage", scale=100),)),
    MetricsChart("latency", "TTFT and inter-token latency (ms)", (
        ChartSeries("TTFT p50", "#417690", "ttft_s__p50", scale=1000),
        ChartSeries("TTFT p99", "#79aec8", "ttft_s__p99", scale=1000),
        ChartSeries("ITL p50", "#d46a00", "inter_token_latency_s__p50", scale=1000),
        ChartSeries("ITL p99", "#f0a35e", "inter_token_latency_s__p99", scale=1000))),
    MetricsChart("preemptions", "Preemptions (since the engine started)", (
        ChartSeries("preemptions", "#ba2121", "num_preemptions"),), integer=True),
)

_PATHS = tuple(dict.fromkeys(s.path for chart in CHARTS for s in chart.series))


def snapshot_charts(snapshots: QuerySet, *, limit: int = MAX_CHART_POINTS) -> dict[str, Any]:
    """The chart data of the newest ``limit`` snapshots in ``snapshots`` (one engine's, filtered
    as the list is): one indexed query, ``limit`` rows of a few numbers each."""
    rows = list(snapshots.order_by("-taken_at", "-id")
                .values_list("taken_at", *(f"metrics__{path}" for path in _PATHS))[:limit])
    rows.reverse()
    return chart_data([(taken_at, dict(zip(_PATHS, values, strict=True))) for taken_at, *values in rows],
                      truncated=len(rows) == limit)


def chart_data(points: Sequence[tuple[datetime, dict[str, Any]]], *, truncated: bool = False,
               heartbeat_s: float = METRICS_HEARTBEAT_S) -> dict[str, Any]:
    """Chart series from ``points`` (taken at, {path: value}), oldest first, by the module's rules.

    Returns ``{"x": [epoch seconds], "charts": [{key, title, integer, series: [{label, color, values}]}],
    "count", "first", "last", "truncated", "interval_s"}``; a value is ``None`` where there is none.
    """
    times = [taken_at.timestamp() for taken_at, _ in points]
    interval = _interval(times, heartbeat_s)
    xs: list[float] = []
    rows: list[dict[str, Any] | None] = []  # None: a break in the lines
    for i, (t, (_, values)) in enumerate(zip(times, points, strict=True)):
        if i and interval:
            gap = t - times[i - 1]
            if gap > heartbeat_s + 1.5 * interval:
                xs.append(times[i - 1] + gap / 2)
                rows.append(None)
            elif gap > 1.5 * interval:
                xs.append(t - interval)
                rows.append(points[i - 1][1])  # the values held until then
        xs.append(t)
        rows.append(values)
    charts = [{"key": chart.key, "title": chart.title, "integer": chart.integer,
               "series": [{"label": s.label, "color": s.color, "values": _values(s, xs, rows)}
                          for s in chart.series]}
              for chart in CHARTS]
    return {"x": xs, "charts": charts, "count": len(points), "truncated": truncated,
            "interval_s": interval,
            "first": points[0][0].isoformat() if points else None,
            "last": points[-1][0].isoformat() if points else None}


def _interval(times: list[float], heartbeat_s: float) -> float | None:
    """The snapshots' interval, as the lowest tenth of the gaps between them shows it."""
    gaps = sorted(b - a for a, b in pairwise(times) if 0 < b - a <= heartbeat_s)
    return gaps[math.ceil(len(gaps) / 10) - 1] if gaps else None


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _values(series: ChartSeries, xs: list[float], rows: list[dict[str, Any] | None]) -> list[float | None]:
    raw = [None if row is None else _number(row.get(series.path)) for row in rows]
    if not series.rate:
        return [None if v is None else v * series.scale for v in raw]
    out: list[float | None] = [None] if raw else []
    for i in range(1, len(raw)):
        before, now, seconds = raw[i - 1], raw[i], xs[i] - xs[i - 1]
        if before is None or now is None or seconds <= 0 or now < before:
            out.append(None)
        else:
            out.append((now - before) / seconds * series.scale)
    return out
