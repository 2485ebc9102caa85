"""How the API views reply: JSON bodies, and refusals in the OpenAI/MLC error shape.

The error shape and the exception itself are the protocol's
(:class:`engines.protocol.errors.ProtocolError`, :class:`ErrorResponse`); this module
only turns them into HTTP replies, in one decorator every API view wears, so no path
can answer an error in another shape (or as Django's HTML error page).
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Awaitable, Callable

import orjson
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from django.views.decorators.csrf import csrf_exempt

from engines.protocol.errors import ErrorResponse, ProtocolError
from engines.runtime import EngineDeadError

logger = logging.getLogger(__name__)

AsyncView = Callable[..., Awaitable[HttpResponseBase]]


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> HttpResponse:
    """A JSON reply encoded with orjson: fast, and NaN/inf come out as ``null``, never invalid JSON."""
    return HttpResponse(
        orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY),
        status=status,
        content_type="application/json",
        headers=headers,
    )


def error_response(error: ProtocolError) -> HttpResponse:
    """The HTTP reply for a refused request: the error object, once encoded (MLC encodes it twice)."""
    return json_response(error.response().model_dump(), status=error.status)


def api_view(*methods: str) -> Callable[[AsyncView], AsyncView]:
    """Make an async view a JSON API endpoint.

    CSRF-exempt (API clients authenticate with a bearer key, not a session
    cookie), restricted to ``methods`` (405 in the error shape otherwise), and
    any :class:`ProtocolError` it raises becomes its error reply, as does a body over
    Django's ``DATA_UPLOAD_MAX_MEMORY_SIZE`` (413, raised on reading it) and an engine
    that died (503 with the runtime's message; any engine call may raise it, so views
    need not catch it). An unexpected exception is logged and answered 500 in the same
    shape, never as HTML.
    """
    allowed = frozenset(m.upper() for m in methods)
    if "GET" in allowed:  # HTTP requires HEAD wherever GET works (the server drops the body)
        allowed |= {"HEAD"}

    def decorate(view: AsyncView) -> AsyncView:
        @functools.wraps(view)
        async def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
            if request.method not in allowed:
                response = error_response(
                    ProtocolError(405, f"{request.method} is not allowed on {request.path}; use {', '.join(sorted(allowed))}")
                )
                response["Allow"] = ", ".join(sorted(allowed))
                return response
            try:
                return await view(request, *args, **kwargs)
            except ProtocolError as exc:
                return error_response(exc)
            except EngineDeadError as exc:
                return error_response(ProtocolError(503, str(exc)))
            except RequestDataTooBig:
                limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
                return error_response(ProtocolError(
                    413, f"The request body is larger than the {limit} bytes this server accepts; send a shorter one."))
            except Exception:
                logger.exception("%s %s failed", request.method, request.path)
                return json_response(
                    ErrorResponse.from_status(500, "Internal server error; the server log has the details.").model_dump(),
                    status=500,
                )

        return csrf_exempt(wrapper)

    return decorate


@api_view("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS")
async def api_not_found(request: HttpRequest, path: str = "") -> HttpResponse:
    """404 in the error shape for API paths no route matches (Django's would be an HTML page)."""
    raise ProtocolError(404, f"No endpoint {request.method} {request.path} on this server.")
