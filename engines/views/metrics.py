"""``GET /metrics`` (Prometheus text exposition) and ``GET /health``.

Placeholder body until engines/runtime/metrics.py lands; replaced below.
"""
from __future__ import annotations

from django.http import HttpRequest, HttpResponse

from engines.registry import registry
from engines.views.errors import api_view, json_response


@api_view("GET")
async def prometheus_metrics(request: HttpRequest) -> HttpResponse:
    return HttpResponse("", content_type="text/plain")


@api_view("GET")
async def health(request: HttpRequest) -> HttpResponse:
    dead = [engine.name for engine in registry if not engine.is_alive]
    if dead:
        return json_response({"status": "unhealthy", "dead_engines": dead}, status=503)
    return json_response({"status": "ok"})
