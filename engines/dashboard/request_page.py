"""``/dashboard/engines/<name>/requests/<id>/``: one request, and where its time went.

Reached from the engine page's live and recent tables. What it shows comes from where the request
is: in the engine now (its live row; the page reloads itself when it ends), among the last that
ended (its anatomy, from the engine's memory), or in the saved history of this server (its request
summaries, each linking its admin page). The anatomy is drawn by the one template the history's
request page uses too (``admin/engines/includes/anatomy.html``).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from asgiref.sync import sync_to_async
from django.contrib.admin.views.decorators import staff_member_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render

from engines.dashboard.frame import page_context
from engines.dashboard.pages import engine_facts
from engines.dashboard.sampler import read_engine
from engines.dashboard.waterfall import waterfall
from engines.history.outage import OUTAGE_ERRORS
from engines.models import RequestSummary
from engines.registry import registry
from engines.server.server_identity import server_id

__all__ = ["request_page"]

#: How many of its saved summaries the page lists (a request id a client reuses has many).
SAVED_LISTED = 10


@staff_member_required
async def request_page(request: HttpRequest, name: str, request_id: str) -> HttpResponse:
    """The request ``request_id`` of engine ``name``: live, recently ended, or saved; 404 if none."""
    engine = registry.get(name)
    if engine is None:
        raise Http404(f"No engine {name!r} is served here.")
    _, reading, slow = await read_engine(engine) if engine.is_alive else (None, None, False)
    live = ended = None
    if reading is not None:
        live = next((dataclasses.asdict(r) for r in reading.live.requests if r.request_id == request_id), None)
        ended = next((r for r in reading.ended if r["request_id"] == request_id), None)
    saved: list[RequestSummary] = []
    history_error = ""
    try:
        query = RequestSummary.objects.filter(server=server_id(), engine=name, request_id=request_id)
        saved = [s async for s in query.order_by("-id")[:SAVED_LISTED]]
    except OUTAGE_ERRORS as exc:
        history_error = (f"The history's database does not answer ({exc.__class__.__name__}); "
                         "saved traces are not shown.")
    if live is None and ended is None and not saved and not slow and not history_error:
        raise Http404(f"Engine {name!r} holds no request {request_id!r}: not in it now, not among the last that "
                      "ended, not in this server's saved traces.")
    # The anatomy: the engine's own record of the request if it has one, else the newest saved one.
    newest_saved = next((s for s in saved if s.time_breakdown), None)
    source: dict[str, Any] | RequestSummary | None = ended if ended is not None else newest_saved
    breakdown, diagnosis = ((ended.get("time_breakdown"), ended.get("diagnosis")) if ended is not None
                            else (newest_saved.time_breakdown, newest_saved.diagnosis) if newest_saved is not None
                            else (None, None))
    # The admin's frame reads the session and the user (the database): off the event loop.
    return await sync_to_async(_render)(
        request, f"Request {request_id}", engine=engine_facts(engine), request_id=request_id, live=live,
        ended=ended, saved=saved, history_error=history_error, slow=slow,
        anatomy_from=("engine" if source is ended else "history") if source is not None else "",
        bars=waterfall(breakdown or {}), total_s=sum(breakdown.values()) if breakdown else None,
        diagnosis=list(diagnosis or []),
        missing_text="" if breakdown or live else "Where its time went was not recorded for it.")


def _render(request: HttpRequest, title: str, **context: Any) -> HttpResponse:
    return render(request, "dashboard/request.html", page_context(request, title, **context))
