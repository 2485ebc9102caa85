"""What every dashboard page stands in: the admin's frame around it (:func:`page_context`), and
how its data URLs answer for a saved record (:func:`record_payload`): the stored payload, or
JSON saying why not, which the page's script shows."""
from __future__ import annotations

import platform
from typing import Any

from django.contrib import admin
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse

from engines import __version__
from engines.history.downloads import PAYLOAD_ERROR_STATUS, PayloadForm, payload_response
from engines.history.payload import PayloadError
from engines.models import PayloadRecord
from engines.runtime import NOW_WINDOW_S

__all__ = ["data_error", "page_context", "record_payload"]


def page_context(request: HttpRequest, title: str, **extra: Any) -> dict[str, Any]:
    """What every dashboard page renders with: the admin's frame (header, sidebar), its title,
    the versions in the footer, the window of the "now" figures (``now_window_s``: seconds, as
    the labels say it), and ``extra``."""
    import numba  # for its version only: loaded when a page renders, not with the URLconf

    versions = [("server", __version__), ("numba", numba.__version__), ("python", platform.python_version())]
    return {**admin.site.each_context(request), "title": title, "versions": versions,
            "now_window_s": f"{NOW_WINDOW_S:g}", **extra}


def data_error(message: str, status: int) -> JsonResponse:
    """A data URL's refusal: the page's scripts show ``error``."""
    return JsonResponse({"error": message}, status=status)


def record_payload(request: HttpRequest, record: PayloadRecord | None, form: PayloadForm,
                   missing: str) -> HttpResponse | StreamingHttpResponse:
    """``record``'s stored payload as ``form``, or why not: ``missing`` (404) when there is no
    record, what is wrong with its bytes (409) when they are damaged."""
    if record is None:
        return data_error(missing, 404)
    try:
        return payload_response(request, record, form)
    except PayloadError as exc:
        return data_error(str(exc), PAYLOAD_ERROR_STATUS)
