"""The API views' base: how every API view reads a body and replies.

Views are parse, call, shape: :func:`json_body` reads a request's JSON the one way all of them
do (depth-bounded, an object); the view validates it with the protocol's models and calls the
registry, the engine or the serving layer (``engines.serving``); its reply is :func:`json_response`
or :func:`sse_response`. Refusals take the OpenAI/MLC error shape: the shape and the exception
are the protocol's (:class:`engines.protocol.errors.ProtocolError`, :class:`ErrorResponse`), and
:func:`api_view`, which every API view wears, turns them into HTTP replies, so no path can answer
an error in another shape (or as Django's HTML error page). Which paths are API routes, and
which of them need the key, is ``engines.api_routes``.

The one view module every API view module may import; they import no other.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import orjson
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse, HttpResponseBase, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt
from pydantic import BaseModel

from engines.disagg.router import RoutedReply, RouterError, mint_request_id
from engines.history.outage import OUTAGE_ERRORS, history_outage, request_message, said_once
from engines.protocol.errors import ErrorResponse, ProtocolError
from engines.protocol.json_body import JSONTooDeepError, loads_bounded
from engines.registry import registry
from engines.request_ids import client_request_id, use_request_id
from engines.runtime import EngineDeadError

logger = logging.getLogger(__name__)

__all__ = ["AsyncView", "InvalidBody", "api_not_found", "api_view", "counted_stream", "database_unavailable",
           "debug_gated", "error_response", "json_body", "json_response", "reply_response", "routed_response",
           "sse_response"]

#: An ``async def`` view (what Django's ``path()`` takes: a coroutine function, not any awaitable).
AsyncView = Callable[..., Coroutine[Any, Any, HttpResponseBase]]


class InvalidBody(ProtocolError):
    """A request body that is not a JSON object (or nests too deep): 400, saying which."""

    def __init__(self, message: str) -> None:
        super().__init__(400, message)


def json_body(request: HttpRequest, *, empty_ok: bool = False) -> dict[str, Any]:
    """The request's body as a JSON object, parsed the one way every API view parses one: with
    the bound on its depth (``loads_bounded``); ``{}`` for an empty body when ``empty_ok``.

    Raises :class:`InvalidBody` for a body that is not JSON, nests too deep or is not an object.
    """
    if empty_ok and not request.body.strip():
        return {}
    try:
        value = loads_bounded(request.body)
    except JSONTooDeepError as exc:
        raise InvalidBody(f"the request body is too deep: {exc}") from None
    except orjson.JSONDecodeError as exc:
        raise InvalidBody(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidBody("the request body must be a JSON object")
    return value


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> HttpResponse:
    """A JSON reply encoded with orjson: fast, and NaN/inf come out as ``null``, never invalid JSON."""
    return HttpResponse(
        orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY),
        status=status,
        content_type="application/json",
        headers=headers,
    )


def sse_response(events: AsyncIterator[bytes], content_type: str = "text/event-stream") -> StreamingHttpResponse:
    """A server-sent event stream, each event written as it comes (no cache, no proxy buffering)."""
    return StreamingHttpResponse(events, content_type=content_type,
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def reply_response(reply: BaseModel | AsyncIterator[bytes]) -> HttpResponseBase:
    """A generation's reply (``engines.serving.generation.Reply``): one JSON object, or its SSE stream."""
    return json_response(reply.model_dump()) if isinstance(reply, BaseModel) else sse_response(reply)


async def routed_response(request: HttpRequest, call: Callable[[str], Awaitable[RoutedReply]]) -> HttpResponseBase:
    """What a disaggregating router (``engines.disagg.router``) relays for ``request``: ``call`` gets
    the id that goes upstream (the client's ``X-Request-Id``, else a fresh one, which the reply's
    header then names); its reply goes back as it came, JSON or SSE, and a :class:`RouterError` as
    its status and body (the upstream's error object, or ours in the same shape)."""
    request_id = client_request_id(request) or mint_request_id()
    use_request_id(request, request_id)
    try:
        reply = await call(request_id)
    except RouterError as exc:
        return json_response(exc.body, status=exc.status)
    if reply.stream is None:
        return HttpResponse(reply.body, status=reply.status, content_type=reply.content_type)
    return sse_response(counted_stream(reply.stream), content_type=reply.content_type)


async def counted_stream(stream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A relayed stream, counted in flight while it is written (a draining shutdown waits for it,
    as for the engine servers' own streams); closing it closes the upstream stream."""
    with registry.response_in_flight():
        try:
            async for event in stream:
                yield event
        finally:
            await stream.aclose()  # type: ignore[attr-defined]


def error_response(error: ProtocolError) -> HttpResponse:
    """The HTTP reply for a refused request: the error object, once encoded (MLC encodes it twice)."""
    return json_response(error.response().model_dump(), status=error.status)


def database_unavailable(exc: BaseException) -> HttpResponse:
    """503 in the error shape for a request that found the history's database away (a profile
    saved, a session read): said in the log once an outage (``engines.history.outage``)."""
    response = error_response(ProtocolError(503, request_message(history_outage.failed(exc))))
    said_once(response)
    return response


def api_view(*methods: str) -> Callable[[AsyncView], AsyncView]:
    """Make an async view a JSON API endpoint.

    CSRF-exempt (API clients authenticate with a bearer key, not a session
    cookie), restricted to ``methods`` (405 in the error shape otherwise), and
    any :class:`ProtocolError` it raises becomes its error reply, as does a body over
    Django's ``DATA_UPLOAD_MAX_MEMORY_SIZE`` (413, raised on reading it) and an engine
    that died (503 with the runtime's message; any engine call may raise it, so views
    need not catch it), as is a database that does not answer (503, :func:`database_unavailable`).
    An unexpected exception is logged and answered 500 in the same shape, never as HTML.
    """
    allowed = frozenset(m.upper() for m in methods)
    if "GET" in allowed:  # HTTP requires HEAD wherever GET works (the server drops the body)
        allowed |= {"HEAD"}

    def decorate(view: AsyncView) -> AsyncView:
        @functools.wraps(view)
        async def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
            if request.method not in allowed:
                response = error_response(ProtocolError(
                    405, f"{request.method} is not allowed on {request.path}; use {', '.join(sorted(allowed))}"))
                response["Allow"] = ", ".join(sorted(allowed))
                return response
            try:
                return await view(request, *args, **kwargs)
            except ProtocolError as exc:
                return error_response(exc)
            except EngineDeadError as exc:
                return error_response(ProtocolError(503, str(exc)))
            except OUTAGE_ERRORS as exc:
                return database_unavailable(exc)
            except RequestDataTooBig:
                limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
                return error_response(ProtocolError(
                    413, f"The request body is larger than the {limit} bytes this server accepts; send a shorter one."))
            except Exception:
                logger.exception("%s %s failed", request.method, request.path)
                failed = ErrorResponse.from_status(500, "Internal server error; the server log has the details.")
                return json_response(failed.model_dump(), status=500)

        return csrf_exempt(wrapper)

    return decorate


def debug_gated(not_mounted: str) -> Callable[[AsyncView], AsyncView]:
    """POST-only JSON endpoints that exist only with ``--enable-debug`` (404 saying
    ``not_mounted`` for any method otherwise). The switch is read per request, so tests and
    ``serve`` can set it after the URLs were loaded."""
    def decorate(view: AsyncView) -> AsyncView:
        endpoint = api_view("POST")(view)

        @functools.wraps(view)
        async def gated(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
            if not registry.options.enable_debug:
                return error_response(ProtocolError(404, not_mounted))
            return await endpoint(request, *args, **kwargs)

        return csrf_exempt(gated)
    return decorate


@api_view("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS")
async def api_not_found(request: HttpRequest, path: str = "") -> HttpResponse:
    """404 in the error shape for API paths no route matches (Django's would be an HTML page)."""
    raise ProtocolError(404, f"No endpoint {request.method} {request.path} on this server.")
