"""``/dashboard/fleet/history/``: the fleet over time from its rollups (``engines.fleet.rollups``):
SLO figures (TTFT and ITL p50/p90/p99 and the share of requests within the targets the user
sets) for the fleet, each server and each engine over the window, and charts of the fleet per
minute (per hour past six hours) marked with the jobs run across the fleet meanwhile, each saying
how many periods of data it holds (a lone one is drawn as a dot)."""
from __future__ import annotations

import datetime as dt
from typing import Any

from django.contrib.admin.views.decorators import staff_member_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import reverse

from engines.dashboard.frame import page_context
from engines.fleet.rollups import SloFigures, slo_figures

__all__ = ["fleet_history"]

#: The windows offered, in hours.
WINDOWS_H = (1, 6, 24, 24 * 7, 24 * 30)
#: Each chart's columns in a row of the charts' series (``fleet_history.js`` draws the same).
CHART_COLUMNS = {"latency": (1, 2), "within": (3, 4)}


def _number(raw: str | None, default: float, low: float, high: float) -> float:
    try:
        value = float(raw) if raw else default
    except ValueError:
        return default
    return min(high, max(low, value))


@staff_member_required
def fleet_history(request: HttpRequest) -> HttpResponse:
    from engines.models import FleetJob, FleetRollup

    hours = int(_number(request.GET.get("hours"), 1, 1, WINDOWS_H[-1]))
    ttft_ms = _number(request.GET.get("ttft_ms"), 500.0, 1.0, 600_000.0)
    itl_ms = _number(request.GET.get("itl_ms"), 100.0, 1.0, 60_000.0)
    period = "minute" if hours <= 6 else "hour"
    now = dt.datetime.now(dt.timezone.utc)
    since = now - dt.timedelta(hours=hours)
    rows = list(FleetRollup.objects.filter(period=period, start__gte=since).order_by("start"))
    figures = slo_figures(rows, ttft_ms / 1000, itl_ms / 1000)
    # The charts: the fleet, or one server ("server:NAME") or one model ("model:NAME").
    servers = sorted({r.server_name or r.server for r in rows})
    models = sorted({r.model or r.engine for r in rows})
    choices = [("", "the fleet"), *((f"server:{n}", f"server {n}") for n in servers),
               *((f"model:{n}", f"model {n}") for n in models)]
    of = request.GET.get("of", "")
    of = of if of in dict(choices) else ""
    kind, _, name = of.partition(":")
    charted = [r for r in rows if not of or (kind == "server" and (r.server_name or r.server) == name)
               or (kind == "model" and (r.model or r.engine) == name)]
    by_start: dict[dt.datetime, list[Any]] = {}
    for row in charted:
        by_start.setdefault(row.start, []).append(row)
    seconds = 60.0 if period == "minute" else 3600.0
    series: list[list[float | None]] = []
    for start, part in sorted(by_start.items()):
        fleet = slo_figures(part, ttft_ms / 1000, itl_ms / 1000)["fleet"]
        series.append([start.timestamp(), _ms(fleet.ttft["p99"]), _ms(fleet.itl["p99"]),
                       _percent(fleet.ttft["within"]), _percent(fleet.itl["within"]),
                       fleet.generation_tokens / seconds])
    jobs = [{"at": job.created_at.timestamp(), "label": f"{job.action} by {job.requested_by}",
             "url": reverse("admin:engines_fleetjob_change", args=[job.pk])}
            for job in FleetJob.objects.filter(created_at__gte=since).order_by("created_at")[:500]]
    shown = {"fleet": _display(figures["fleet"]), "models": [_display(f) for f in figures["models"]],
             "servers": [_display(f) for f in figures["servers"]],
             "engines": [_display(f) for f in figures["engines"]]}
    holds = {name: _holds(sum(1 for row in series if any(row[i] is not None for i in columns)), period)
             for name, columns in CHART_COLUMNS.items()}
    context = page_context(request, "Fleet history and SLOs", figures=shown, hours=hours, windows=WINDOWS_H,
                           ttft_ms=ttft_ms, itl_ms=itl_ms, period=period, rollups=len(rows), jobs=jobs,
                           choices=choices, of=of, charted=dict(choices)[of], holds=holds,
                           chart={"window": hours * 3600, "end": now.timestamp(), "series": series, "jobs": jobs})
    return render(request, "dashboard/fleet_history.html", context)


def _holds(periods: int, period: str) -> str:
    """What a chart holds: "3 minutes of data", "1 hour of data", "no data in this range"."""
    if not periods:
        return "no data in this range"
    return f"{periods} {period}{'' if periods == 1 else 's'} of data"


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def _percent(share: float | None) -> float | None:
    return None if share is None else 100 * share


def _latency(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    return f"{seconds * 1000:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def _share(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f} %"


def _display(f: SloFigures) -> dict[str, str]:
    """One row of the SLO table, as it reads."""
    return {"label": f.label, "requests": f"{f.requests:,.0f}",
            "ttft": " / ".join(_latency(f.ttft[p]) for p in ("p50", "p90", "p99")),
            "ttft_within": _share(f.ttft["within"]),
            "itl": " / ".join(_latency(f.itl[p]) for p in ("p50", "p90", "p99")),
            "itl_within": _share(f.itl["within"]), "tokens": f"{f.generation_tokens:,.0f}"}
