"""The dashboard's websockets open only from the server's own pages.

A browser sends the session cookie (SameSite=Lax) with a websocket to any port of the same host,
and Channels' ``AllowedHostsOriginValidator`` compares host names only: a page served from
another port of the same machine could open the dashboard's socket with the user's staff
session and reset engines or save traces. :class:`SameOriginValidator` accepts a websocket only
when its ``Origin`` is the server itself (scheme, host and port of the request's ``Host``, the
host in ``ALLOWED_HOSTS``), or is listed in ``CSRF_TRUSTED_ORIGINS``, as Django's CSRF check
decides for a form post.
"""
from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from channels.security.websocket import WebsocketDenier
from django.conf import settings
from django.http.request import split_domain_port, validate_host

__all__ = ["SameOriginValidator", "same_origin"]

_DEFAULT_PORTS = {"http": 80, "https": 443}


def _header(scope: dict[str, Any], name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def same_origin(scope: dict[str, Any]) -> bool:
    """Whether a websocket ``scope`` comes from a page of this server (or a trusted origin)."""
    origin, host = _header(scope, b"origin"), _header(scope, b"host")
    if not origin or not host:
        return False
    if origin in getattr(settings, "CSRF_TRUSTED_ORIGINS", ()):
        return True
    domain, port = split_domain_port(host)
    if not domain or not validate_host(domain, settings.ALLOWED_HOSTS):
        return False
    scheme = "https" if scope.get("scheme") in ("wss", "https") else "http"
    try:
        parsed = urlsplit(origin)
        origin_port = parsed.port
    except ValueError:  # an unparseable origin, or a port past 65535
        return False
    if parsed.scheme != scheme or (parsed.hostname or "").lower() != domain.strip("[]").lower():
        return False
    return (origin_port or _DEFAULT_PORTS[scheme]) == (int(port) if port else _DEFAULT_PORTS[scheme])


class SameOriginValidator:
    """ASGI middleware for websockets: :func:`same_origin` or a 403 before the application runs."""

    def __init__(self, application: Any) -> None:
        self.application = application

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> Any:
        if scope["type"] == "websocket" and not same_origin(scope):
            # types-channels types a consumer's scope as Channels' own TypedDict; this is the
            # server's scope, the plain dict that Channels hands its consumers too.
            return await WebsocketDenier()(scope, receive, send)  # type: ignore[arg-type]
        return await self.application(scope, receive, send)
