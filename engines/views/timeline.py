"""The timeline viewer's pages: a saved trace record, or an engine's trace as it is recorded.

Both render one template; ``static/engines/js/timeline/`` draws it. A saved trace's events come
from the admin's ``timeline-data.json`` (the stored gzip, inflated by the browser), a live one's
over ``/ws/engines/<name>/timeline/`` (``engines.consumers.TimelineConsumer``).
"""
from __future__ import annotations

import asyncio
import time
from urllib.parse import quote

from django.contrib.admin.views.decorators import staff_member_required
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.utils.http import content_disposition_header
from django.shortcuts import get_object_or_404, render
from django.urls import reverse

from engines.history.payload import compress_json
from engines.models import TraceRecord
from engines.registry import registry
from engines.views.dashboard import page_context


@staff_member_required
def trace_timeline(request: HttpRequest, pk: int) -> HttpResponse:
    """``/dashboard/traces/<id>/timeline/``: a saved trace record on the timeline."""
    if not request.user.has_perm("engines.view_tracerecord"):
        raise PermissionDenied
    record = get_object_or_404(TraceRecord.objects.defer("payload", "stats"), pk=pk)
    source = {
        "mode": "saved",
        "record": record.pk,
        "engine": record.engine,
        "data_url": reverse("admin:engines_tracerecord_timeline_data", args=[record.pk]),
        "requests_url": reverse("admin:engines_tracerecord_requests_json", args=[record.pk]),
        "download_json": reverse("admin:engines_tracerecord_download_json", args=[record.pk]),
        "download_gzip": reverse("admin:engines_tracerecord_download_gzip", args=[record.pk]),
        "record_url": reverse("admin:engines_tracerecord_change", args=[record.pk]),
        "events": record.event_count,
    }
    return render(request, "dashboard/timeline.html",
                  page_context(request, f"Timeline of trace #{record.pk}", source=source, record=record))


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
        return JsonResponse({"error": f"No engine {name!r} is served here."}, status=404)
    if not engine.tracing_enabled:
        return JsonResponse({"error": f"Engine {name!r} records no trace: serve it with --enable-tracing."},
                            status=409)
    data = await engine.dump_trace()
    filename = f"trace-{name}-{time.strftime('%Y%m%dT%H%M%S')}.json"
    if request.GET.get("gzip") == "1":
        payload = await asyncio.to_thread(compress_json, data)
        response = HttpResponse(payload.data, content_type="application/gzip")
        filename += ".gz"
    else:
        response = HttpResponse(data, content_type="application/json")
    response["Content-Disposition"] = content_disposition_header(as_attachment=True, filename=filename)
    return response
