"""``GET /fleet.json``: the whole fleet as JSON, for scripts and tests, behind the same API key as
``/stats`` (``engines.api_routes``): every server (ours and attached) with its id, URL, kind, state
and last-seen age, every engine with its current figures, and the fleet's totals."""
from __future__ import annotations

from django.http import HttpRequest, HttpResponse

from engines.fleet.service import fleet_service
from engines.protocol.errors import ProtocolError
from engines.views.api import api_view, error_response

__all__ = ["fleet_json"]


@api_view("GET")
async def fleet_json(request: HttpRequest) -> HttpResponse:
    """The fleet's view (``engines.fleet.rows.FleetView``; engine rows without their histograms)."""
    service = fleet_service()
    service.start()
    try:
        text = await service.board.view_text()
    except Exception as exc:  # noqa: BLE001 - the store (Redis) is down: a 503 that says so
        return error_response(ProtocolError(503, f"the fleet's store does not answer: {exc}"))
    return HttpResponse(text, content_type="application/json")
