"""The site's answer while the history's database is away: a 503 that says so, not a 500 and a
traceback in the log a request.

Every admin and dashboard page reads the database, if only for its staff check (the session and
the user are stored there). Django's session and auth middleware read them lazily, in the view's
``staff_member_required`` or the admin's ``has_permission``, so a view is where a request meets
the outage, and :meth:`HistoryOutageMiddleware.process_exception` sees it wherever the middleware
stands in ``MIDDLEWARE`` (a template rendered after the view counts as the view). The API routes
run no middleware and answer in their own shape (``engines.views.api``).
"""
from __future__ import annotations

from django.contrib import admin
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.template.loader import render_to_string
from django.utils.deprecation import MiddlewareMixin

from engines.history.outage import OUTAGE_ERRORS, history_outage, page_message, request_message, said_once

__all__ = ["RETRY_AFTER_S", "HistoryOutageMiddleware"]

#: Seconds a browser waits before it asks for the page again (``Retry-After``, and the page reloads).
RETRY_AFTER_S = 5


class HistoryOutageMiddleware(MiddlewareMixin):
    """A request whose view found the database away gets a 503: the admin's look for a browser
    (a request that names ``text/html`` in ``Accept``, as every page load does), the dashboard's
    data-URL shape ``{"error": ...}`` for a script (``fetch``, curl). Said in the log once an
    outage (``history_outage``), not a line a request."""

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        """The 503 for an outage; None (Django's usual 500) for anything else."""
        if not isinstance(exception, OUTAGE_ERRORS):
            return None
        reason = history_outage.failed(exception)
        response: HttpResponse
        if "text/html" in request.headers.get("Accept", ""):
            response = HttpResponse(_page(reason, reload=request.method in ("GET", "HEAD")), status=503)
        else:
            response = JsonResponse({"error": request_message(reason)}, status=503)
        response["Retry-After"] = str(RETRY_AFTER_S)
        said_once(response)
        return response


def _page(reason: str, *, reload: bool) -> str:
    """The admin-look 503 page. Rendered without the request: its user and session are in the
    database too (the header's user tools would read them), so the page shows none."""
    return render_to_string("admin/history_unavailable.html", {
        "site_header": admin.site.site_header, "site_title": admin.site.site_title,
        "title": "History unavailable", "message": page_message(reason),
        "retry_after": RETRY_AFTER_S if reload else None,
    })
