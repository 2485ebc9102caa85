"""Statistics of saved traces as the admin shows them: one trace, or two side by side.

Built from the statistics stored on each record at save time (``TraceRecord.stats``),
so neither page opens a payload. Durations are converted from microseconds to
milliseconds here, once, so templates only print numbers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from engines.history.columns import STATISTIC_COLUMNS
from engines.models import TraceRecord

PHASE_STATS = ("count", "total", "mean", "p50", "p90", "p99", "max")
REQUEST_STATS = ("count", "mean", "p50", "p90", "p99", "max")
# Side by side, fewer statistics keep the page scannable; the detail pages have the rest.
COMPARE_PHASE_STATS = ("count", "total", "p50", "p99")
COMPARE_REQUEST_STATS = ("mean", "p50", "p90", "p99")
COUNT_STATS = frozenset({"count", "events", "requests"})


@dataclass(frozen=True, slots=True)
class StatRow:
    """One named group of statistics of one trace, e.g. ``decode`` on request lanes, in ms."""

    label: str
    unit: str  # "ms" or "tokens"
    values: dict[str, float | None]


@dataclass(frozen=True, slots=True)
class Change:
    """One statistic of two traces and the relative change from ``a`` to ``b``."""

    stat: str
    a: float | None
    b: float | None
    change: float | None  # (b - a) / a; None where undefined

    @property
    def is_count(self) -> bool:
        return self.stat in COUNT_STATS

    @property
    def change_percent(self) -> float | None:
        return None if self.change is None else self.change * 100.0


@dataclass(frozen=True, slots=True)
class ChangeRow:
    label: str
    unit: str
    changes: list[Change]


@dataclass(frozen=True)
class TraceReport:
    """What the detail page shows about one trace's statistics."""

    phases: list[StatRow]
    requests: list[StatRow]


@dataclass(frozen=True)
class TraceComparison:
    """Two traces' statistics side by side: ``a`` is the baseline, ``b`` the candidate."""

    a: TraceRecord
    b: TraceRecord
    overview: list[ChangeRow]
    phases: list[ChangeRow]
    requests: list[ChangeRow]


def trace_report(record: TraceRecord) -> TraceReport:
    """Phase and request-latency tables for one record."""
    requests = _request_map(record)
    return TraceReport(
        phases=[StatRow(label, "ms", _scaled(stats, PHASE_STATS, True))
                for label, stats in _phase_map(record).items()],
        requests=[StatRow(c.statistic, c.unit, _scaled(requests[c.field], REQUEST_STATS, c.is_duration))
                  for c in STATISTIC_COLUMNS if c.statistic is not None and c.field in requests],
    )


def compare_records(a: TraceRecord, b: TraceRecord) -> TraceComparison:
    """Per-phase durations, request latency percentiles and throughput of ``a`` and ``b``."""
    phases_a, phases_b = _phase_map(a), _phase_map(b)
    phases = [
        _change_row(label, "ms", phases_a.get(label), phases_b.get(label), COMPARE_PHASE_STATS, True)
        for label in sorted(phases_a.keys() | phases_b.keys(), key=_phase_sort_key)
    ]
    req_a, req_b = _request_map(a), _request_map(b)
    requests = [
        _change_row(c.statistic, c.unit, req_a.get(c.field), req_b.get(c.field), COMPARE_REQUEST_STATS,
                    c.is_duration)
        for c in STATISTIC_COLUMNS
        if c.statistic is not None and (c.field in req_a or c.field in req_b)
    ]
    return TraceComparison(a=a, b=b, overview=[_overview_row(a, b)], phases=phases, requests=requests)


def relative_change(a: float | None, b: float | None) -> float | None:
    """``(b - a) / a``, or ``None`` when either is missing or ``a`` is 0."""
    if a is None or b is None or a == 0:
        return None
    return (b - a) / a


def _overview_row(a: TraceRecord, b: TraceRecord) -> ChangeRow:
    def figures(r: TraceRecord) -> dict[str, float | None]:
        seconds = r.duration_us / 1e6 if r.duration_us else None
        tokens = (_request_map(r).get("completion_tokens") or {}).get("total")
        tokens = tokens if isinstance(tokens, (int, float)) else None
        return {
            "events": float(r.event_count),
            "requests": float(r.request_count),
            "window (s)": seconds,
            "requests/s": r.request_count / seconds if seconds else None,
            "output tokens/s": tokens / seconds if seconds and tokens is not None else None,
        }
    fa, fb = figures(a), figures(b)
    return ChangeRow("whole trace", "", [Change(k, fa[k], fb[k], relative_change(fa[k], fb[k])) for k in fa])


def _change_row(label: str, unit: str, a: Mapping[str, Any] | None, b: Mapping[str, Any] | None,
                stats: tuple[str, ...], duration: bool) -> ChangeRow:
    va, vb = _scaled(a, stats, duration), _scaled(b, stats, duration)
    return ChangeRow(label, unit, [Change(s, va[s], vb[s], relative_change(va[s], vb[s])) for s in stats])


def _scaled(stats: Mapping[str, Any] | None, names: tuple[str, ...], duration: bool) -> dict[str, float | None]:
    """Pick ``names`` from stored statistics, microseconds -> milliseconds for durations."""
    out: dict[str, float | None] = {}
    for name in names:
        value = stats.get(name) if stats else None
        if isinstance(value, (int, float)) and duration and name != "count":
            value = value / 1000.0
        out[name] = value if isinstance(value, (int, float)) else None
    return out


def _phase_map(record: TraceRecord) -> dict[str, Mapping[str, Any]]:
    """Stored phase statistics keyed by their display label (engine-lane phases marked)."""
    stats = record.stats if isinstance(record.stats, Mapping) else {}
    out: dict[str, Mapping[str, Any]] = {}
    for entry in stats.get("phases") or ():
        if isinstance(entry, Mapping) and entry.get("phase") is not None:
            label = str(entry["phase"]) if entry.get("lane") != "engine" else f"{entry['phase']} (engine step)"
            out[label] = entry
    return dict(sorted(out.items(), key=lambda item: _phase_sort_key(item[0])))


def _phase_sort_key(label: str) -> tuple[int, str]:
    # Request-lane phases first, then the engine lane's steps; alphabetical within.
    return (1 if label.endswith("(engine step)") else 0, label)


def _request_map(record: TraceRecord) -> Mapping[str, Mapping[str, Any]]:
    stats = record.stats if isinstance(record.stats, Mapping) else {}
    requests = stats.get("requests")
    if not isinstance(requests, Mapping):
        return {}
    # Stored JSON is read defensively: a damaged entry is left out, never a 500 page.
    return {key: value for key, value in requests.items() if isinstance(value, Mapping)}
