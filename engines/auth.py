"""API-key gate for the machine-facing routes that need the key (``engines.api_routes``:
``/v1``, ``/debug``, ``/microserving``, ``/metrics``, ``/stats``).

It is ASGI middleware around the whole HTTP app rather than a view decorator so
that no route under those prefixes can forget it (views added later included),
and a refused request never reaches Django. ``/health`` stays open for load
balancers; the dashboard and admin use Django's staff login instead.

The key is read from the registry's options on every request, so tests (and
``serve``) can configure it after the app was imported.
"""
from __future__ import annotations

import hmac

import orjson
from django.core.handlers.asgi import get_script_prefix

from engines.api_routes import api_route
from engines.protocol.errors import ErrorResponse
from engines.registry import registry
from engines.server.asgi_types import ASGIApp, Receive, Scope, Send


INVALID_KEY_MESSAGE = "Invalid API key: send it as the header 'Authorization: Bearer <key>'."


def is_protected(path: str) -> bool:
    """True for the routes that need the key (prefix match on whole path segments)."""
    route = api_route(path)
    return route is not None and route.needs_key


def routed_path(scope: Scope) -> str:
    """The path Django routes a request on: ``path`` less the root path (Django's ``path_info``).

    The gate must judge this path, not ``path`` alone: the root path is not only the
    server's setting, Daphne takes it from any client's ``Daphne-Root-Path`` header, so
    ``/x/v1/models`` with root path ``/x`` reaches the ``/v1/models`` view.
    """
    return scope["path"].removeprefix(get_script_prefix(scope))


def bearer_token(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The token from ``Authorization: Bearer <token>``, or None if absent or another scheme."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
            return None
    return None


def key_matches(presented: bytes | None, expected: str) -> bool:
    """Constant-time comparison, so response timing does not leak how much of a guess was right."""
    if presented is None:
        return False
    return hmac.compare_digest(presented, expected.encode())


class APIKeyMiddleware:
    """Answer 401 (OpenAI-shaped JSON) to protected HTTP requests without the right key."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = registry.options.api_key
        if (
            key
            and scope["type"] == "http"
            and (is_protected(scope["path"]) or is_protected(routed_path(scope)))
            and not key_matches(bearer_token(scope.get("headers", [])), key)
        ):
            await _send_unauthorized(send)
            return
        await self.app(scope, receive, send)


async def _send_unauthorized(send: Send) -> None:
    body = orjson.dumps(ErrorResponse.from_status(401, INVALID_KEY_MESSAGE).model_dump())
    await send(
        {
            "type": "http.response.start",
            "status": 401,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"www-authenticate", b'Bearer realm="api"'),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
