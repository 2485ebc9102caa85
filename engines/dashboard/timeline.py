"""The timeline viewer's pages and data: a saved trace record, or an engine's trace as it is recorded.

Both pages render one template; ``static/engines/js/timeline/`` draws it from the URLs in its
``timeline-source`` script. A saved trace's events come from :func:`trace_data` (the stored gzip,
inflated by the browser) with its requests from :func:`trace_requests`; a live one's over
``/ws/engines/<name>/timeline/`` (``consumers.TimelineConsumer``).
"""
from __future__ import annotations

import asyncio
import time
from urllib.parse import quote

import orjson
from django.contrib.admin.views.decorators import staff_member_required
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse, StreamingHttpResponse
from django.shortcuts import render
from django.urls import reverse

from engines.dashboard.frame import data_error, page_context, record_payload
from engines.history.columns import REQUEST_COLUMNS
from engines.history.downloads import attachment
from engines.history.payload import compress_json
from engines.models import RequestSummary, TraceRecord
from engines.registry import registry

__all__ = ["engine_timeline", "engine_trace", "trace_data", "trace_requests", "trace_timeline"]


def _record(request: HttpRequest, pk: int) -> TraceRecord | None:
    """The trace record ``pk`` without its payload and statistics (the pages need neither), or None."""
    if not request.user.has_perm("engines.view_tracerecord"):
        raise PermissionDenied
    return TraceRecord.objects.defer("payload", "stats").filter(pk=pk).first()


def _missing_text(pk: int) -> str:
    return (f"There is no trace record #{pk}: it was never saved, or deleted (retention keeps each engine's "
            f"newest traces). Trace records lists those kept.")


@staff_member_required
def trace_timeline(request: HttpRequest, pk: int) -> HttpResponse:
    """``/dashboard/traces/<id>/timeline/``: a saved trace record on the timeline."""
    record = _record(request, pk)
    if record is None:
        raise Http404(_missing_text(pk))
    source = {
        "mode": "saved",
        "record": record.pk,
        "engine": record.engine,
        "data_url": reverse("dashboard-trace-data", args=[record.pk]),
        "requests_url": reverse("dashboard-trace-requests", args=[record.pk]),
        "download_json": reverse("admin:engines_tracerecord_download_json", args=[record.pk]),
        "download_gzip": reverse("admin:engines_tracerecord_download_gzip", args=[record.pk]),
        "record_url": reverse("admin:engines_tracerecord_change", args=[record.pk]),
        "events": record.event_count,
    }
    return render(request, "dashboard/timeline.html",
                  page_context(request, f"Timeline of trace #{record.pk}", source=source, record=record))


@staff_member_required
def trace_data(request: HttpRequest, pk: int) -> HttpResponse | StreamingHttpResponse:
    """``data.json``: the stored trace for the viewer, gzip on the wire, with its event count in
    ``X-Trace-Events`` (the page says how many it is loading)."""
    record = _record(request, pk)
    response = record_payload(request, record, "data", _missing_text(pk))
    if record is not None and response.status_code == 200:
        response["X-Trace-Events"] = str(record.event_count)
    return response


@staff_member_required
def trace_requests(request: HttpRequest, pk: int) -> HttpResponse:
    """``requests.json``: the record's request summaries, for the timeline's lane panel and
    filters: one row per request id, and the admin URL of a row (``ID`` for its id)."""
    record = _record(request, pk)
    if record is None:
        return data_error(_missing_text(pk), 404)
    fields = ["id", "request_id"] + [c.field for c in REQUEST_COLUMNS if c.field != "request_id"]
    rows = RequestSummary.objects.filter(trace=record).order_by("id").values_list(*fields)
    change_url = reverse("admin:engines_requestsummary_change", args=["ID"])  # the browser puts each row's id in
    # orjson: a saved trace may hold many thousand requests.
    return HttpResponse(orjson.dumps({"fields": fields, "rows": list(rows), "change_url": change_url}),
                        content_type="application/json")


@staff_member_required
def engine_timeline(request: HttpRequest, name: str) -> HttpResponse:
    """``/dashboard/engines/<name>/timeline/``: the engine's trace, live as it is recorded."""
    engine = registry.get(name)
    if engine is None:
        raise Http404(f"No engine {name!r} is served here.")
    source = {
        "mode": "live",
        "engine": engine.name,
        "ws": "/ws/engines/" + quote(engine.name, safe="") + "/timeline/",
        "engine_url": reverse("dashboard-engine", args=[engine.name]),
        # A request lane links the request's page (the browser puts its id in).
        "request_url": reverse("dashboard-request", args=[engine.name, "REQUEST_ID"]),
        "download_json": reverse("dashboard-engine-trace", args=[engine.name]),
        "download_gzip": reverse("dashboard-engine-trace", args=[engine.name]) + "?gzip=1",
        "tracing": engine.tracing_enabled,
    }
    return render(request, "dashboard/timeline.html",
                  page_context(request, f"Timeline of {engine.name}", source=source, engine_name=engine.name))


@staff_member_required
async def engine_trace(request: HttpRequest, name: str) -> HttpResponse:
    """``/dashboard/engines/<name>/trace.json``: the engine's trace now, as ``/debug/dump_event_trace``
    answers it, for the dashboard's session (no API key, no ``--enable-debug``); ``?gzip=1`` compresses it."""
    engine = registry.get(name)
    if engine is None:
        return data_error(f"No engine {name!r} is served here.", 404)
    if not engine.tracing_enabled:
        return data_error(f"Engine {name!r} records no trace: serve it with --enable-tracing.", 409)
    data = await engine.dump_trace()
    assert data is not None  # None only for an empty trace with skip_empty, not asked for here
    filename = f"trace-{name}-{time.strftime('%Y%m%dT%H%M%S')}.json"
    if request.GET.get("gzip") == "1":
        payload = await asyncio.to_thread(compress_json, data)
        response = HttpResponse(payload.data, content_type="application/gzip")
        filename += ".gz"
    else:
        response = HttpResponse(data, content_type="application/json")
    response["Content-Disposition"] = attachment(filename)
    return response
