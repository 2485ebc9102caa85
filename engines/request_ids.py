"""``X-Request-Id``: the client's name for its request, taken, used and echoed on every reply.

:class:`EchoRequestId` is an outer ASGI layer (outside the API-key gate, so a 401 carries it too):
it reads the client's header once, keeps it in the scope if it is a sane id (:func:`valid_request_id`:
1 to :data:`MAX_REQUEST_ID_CHARS` visible ASCII characters; anything else is dropped, never an error),
and writes ``X-Request-Id`` on the reply's start, streams and errors alike: the client's id, else the
id the view ran the request under (:func:`use_request_id`), else a fresh one.

A generation names its engine request after it when no ``user`` is given
(``engines.serving.request_mapping.new_request_id``), so the id a client or a proxy sent names the
request's trace lane and its history rows; a client that sent none finds the id in the header.
"""
from __future__ import annotations

import re
import uuid
from typing import Any

from django.http import HttpRequest

from engines.server.asgi_types import ASGIApp, Receive, Scope, Send
from engines.runtime import REQUEST_LIMITS

__all__ = ["EchoRequestId", "MAX_REQUEST_ID_CHARS", "REQUEST_ID_HEADER", "client_request_id", "use_request_id",
           "valid_request_id"]

REQUEST_ID_HEADER = "X-Request-Id"
#: The scope keys: the client's valid id (or None), and the id a view ran the request under.
CLIENT_KEY = "engines.client_request_id"
USED_KEY = "engines.request_id"
#: As long as a ``user``, which becomes a request id the same way.
MAX_REQUEST_ID_CHARS = REQUEST_LIMITS.max_user_chars
_VALID = re.compile(r"[!-~]{1,%d}" % MAX_REQUEST_ID_CHARS)
_HEADER = REQUEST_ID_HEADER.lower().encode()


def valid_request_id(value: str | bytes | None) -> str | None:
    """``value`` if it can name a request (1 to 256 visible ASCII characters: no spaces, no control
    characters, which would break a log line or a header), else None."""
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    return value if value is not None and _VALID.fullmatch(value) else None


class EchoRequestId:
    """Keeps the client's valid ``X-Request-Id`` in the scope and writes one on every HTTP reply."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = next((value for name, value in scope.get("headers", []) if name.lower() == _HEADER), None)
        scope[CLIENT_KEY] = valid_request_id(sent)

        async def send_with_id(message: Any) -> None:
            if message["type"] == "http.response.start":
                # A used id may be a ``user``, any text: only a valid one goes into a header.
                request_id = scope[CLIENT_KEY] or valid_request_id(scope.get(USED_KEY)) or uuid.uuid4().hex
                headers = [(n, v) for n, v in message.get("headers", []) if n.lower() != _HEADER]
                message = {**message, "headers": [*headers, (_HEADER, request_id.encode())]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def client_request_id(request: HttpRequest) -> str | None:
    """The client's valid ``X-Request-Id``, or None (also for a request that came another way: a test
    client without the ASGI layers, whose header is checked here)."""
    scope: dict[str, Any] = getattr(request, "scope", {})
    if CLIENT_KEY in scope:
        return scope[CLIENT_KEY]
    return valid_request_id(request.headers.get(REQUEST_ID_HEADER))


def use_request_id(request: HttpRequest, request_id: str) -> None:
    """The request runs under ``request_id``: the reply's ``X-Request-Id`` when the client sent none."""
    scope: dict[str, Any] | None = getattr(request, "scope", None)
    if scope is not None:
        scope[USED_KEY] = request_id
