"""ASGI entry point.

Websockets (the dashboard, :mod:`engines.dashboard.routing`) pass the origin check and the
session middleware. HTTP is first stamped with its arrival (:mod:`engines.request_arrival`: the clock of a request's
queue time and TTFT), has its ``X-Request-Id`` read and echoed on the reply (:mod:`engines.request_ids`),
then passes the API-key gate (:mod:`engines.auth`), then goes to one
of two Django handlers over the same URLconf:

- the machine-facing routes (``engines.api_routes``: ``/v1``, ``/debug``, ``/microserving``,
  ``/metrics``, ``/stats``, ``/health``) to :class:`APIHandler`, which runs no middleware and
  starts no thread per request (its few sync calls share one thread of its own);
- everything else (admin, dashboard) to Django's usual handler with
  ``settings.MIDDLEWARE``.

Why two: under ASGI every ``MiddlewareMixin`` hook runs through
``sync_to_async``, so the seven browser middleware (sessions, CSRF, auth,
messages, ...) cost two thread hops each per request, each waiting for the GIL
against the busy engine thread, which showed in time to first token under load
(docs/perf-log/code-comments.md#api-middleware), for routes that use none of it:
API clients authenticate with a bearer key, and the views are CSRF-exempt JSON.

``manage.py serve`` fills the engine registry before handing this application to
Daphne. Under another ASGI server (``daphne debugsite.asgi:application``), set
``ENGINES_MODELS`` and the engines are built here, at import, from the
``ENGINES_*`` variables (see :func:`engines.startup.configure_from_env`).
"""
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "debugsite.settings")
# Django must be set up before anything imports models, consumers or routing.
django_asgi_app = get_asgi_application()

from asgiref.sync import ThreadSensitiveContext  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.core.exceptions import DisallowedHost  # noqa: E402
from django.core.handlers.asgi import ASGIHandler  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402
from django.core.handlers.exception import convert_exception_to_response  # noqa: E402
from django.http import HttpRequest, HttpResponseBase  # noqa: E402
from django.http.request import split_domain_port  # noqa: E402

from engines import otel  # noqa: E402
from engines.registry import registry  # noqa: E402
from engines.startup import configure_from_env  # noqa: E402
from engines.api_routes import api_route  # noqa: E402
from engines.auth import APIKeyMiddleware, routed_path  # noqa: E402
from engines.server.asgi_types import ASGIApp, Receive, Scope, Send  # noqa: E402
from engines.dashboard.routing import websocket_urlpatterns  # noqa: E402
from engines.dashboard.same_origin import SameOriginValidator  # noqa: E402
from engines.dashboard.socket_auth import socket_auth_stack  # noqa: E402
from engines.protocol.errors import ProtocolError  # noqa: E402
from engines.request_arrival import StampArrival  # noqa: E402
from engines.request_ids import EchoRequestId  # noqa: E402
from engines.views.api import error_response  # noqa: E402

# The API requests' sync calls (Django's request signals, ``response.close``): one thread for all.
API_SYNC_EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="api-sync")


class APIHandler(ASGIHandler):
    """Django's ASGI handler without middleware, for the JSON API routes.

    It keeps the one check the API needs from the stack it skips: the Host header must be
    in ``ALLOWED_HOSTS`` (CommonMiddleware checked it), which is what stops a DNS-rebinding
    page in a browser from reaching a loopback server that has no API key.
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Django's handler opens a ThreadSensitiveContext per request whose executor starts a
        # thread for the request's first sync call and joins it at its end. The API views are
        # async and run their database work on threads of their own (thread_sensitive=False), so
        # the only sync calls left are the request signals' receivers and ``response.close``:
        # they run on one thread kept for the API. Not asgiref's global one, which Channels
        # shares with the websockets' session and user loads: a locked database there must not
        # hold up /v1 or /health.
        if scope["type"] != "http":
            raise ValueError(f"the API handler serves HTTP only, not {scope['type']}")
        async with ThreadSensitiveContext(executor=API_SYNC_EXECUTOR):
            await self.handle(scope, receive, send)

    def load_middleware(self, is_async: bool = False) -> None:
        # BaseHandler.load_middleware with MIDDLEWARE = [] plus the host check; other
        # exceptions still become Django's error responses.
        self._view_middleware: list[Callable[..., Any]] = []
        self._template_response_middleware: list[Callable[..., Any]] = []
        self._exception_middleware: list[Callable[..., Any]] = []
        self._middleware_chain = convert_exception_to_response(self._checked_response)

    async def _checked_response(self, request: HttpRequest) -> HttpResponseBase:
        try:
            request.get_host()
        except DisallowedHost:
            # Django's own answer is an HTML page with no reason; an API client gets the error shape.
            host, _ = split_domain_port(request.META.get("HTTP_HOST", ""))
            return error_response(ProtocolError(
                400, f"This server does not answer to the host name {host!r}: call it by a name in its "
                     "ALLOWED_HOSTS setting, or add this one to the ALLOWED_HOSTS environment variable "
                     "(comma-separated) and restart the server."))
        # Django's handler method that resolves and calls the view (what the middleware chain
        # wraps); private, so django-stubs leaves it out.
        return await self._get_response_async(request)  # type: ignore[attr-defined]


class PathRouter:
    """Send API paths to the bare handler and the rest to the full Django stack.

    Judged on the path Django will route (root path removed), as the API-key gate does.
    """

    def __init__(self, api_app: ASGIApp, site_app: ASGIApp) -> None:
        self.api_app = api_app
        self.site_app = site_app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        is_api = api_route(routed_path(scope)) is not None
        await (self.api_app if is_api else self.site_app)(scope, receive, send)


if os.environ.get("ENGINES_MODELS") and not len(registry):
    configure_from_env()
    # The standard variables, as under serve (no flag here); off without them.
    otel.configure(otel.endpoint_from(None))

application = ProtocolTypeRouter({
    # Static files (the admin's, the dashboard's, the vendored uPlot) straight from the app folders,
    # under serve and a bare Daphne alike, DEBUG on or off: no collectstatic, no CDN.
    # Stamped first: a request's queue time and TTFT count from here (engines.request_arrival).
    "http": StampArrival(EchoRequestId(APIKeyMiddleware(PathRouter(APIHandler(),
                                                                   ASGIStaticFilesHandler(django_asgi_app))))),
    # The dashboard's sockets: the browser's session (staff only, checked by the consumer; closed
    # with a code while the database that holds it does not answer), and only from this server's
    # own pages (scheme, host and port), so that no other site, nor a page on another port of this
    # machine, can open one with the user's cookie.
    # (The patterns are Django's URLPattern to a type checker: engines/dashboard/routing.py says why.)
    "websocket": SameOriginValidator(socket_auth_stack(URLRouter(websocket_urlpatterns))),  # type: ignore[arg-type]
})
