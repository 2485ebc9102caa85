"""ASGI entry point.

Websockets (the dashboard, :mod:`engines.routing`) pass the origin check and the session
middleware. HTTP first passes the API-key gate (:mod:`engines.auth`), then goes to one of
two Django handlers over the same URLconf:

- the machine-facing routes (``/v1``, ``/debug``, ``/microserving``, ``/metrics``,
  ``/stats``, ``/health``) to :class:`APIHandler`, which runs no middleware and starts
  no thread per request (its few sync calls share one thread of its own);
- everything else (admin, dashboard) to Django's usual handler with
  ``settings.MIDDLEWARE``.

Why two: under ASGI every ``MiddlewareMixin`` hook runs through
``sync_to_async``, so the seven browser middleware (sessions, CSRF, auth,
messages, ...) cost about fourteen thread hops per request, each waiting for
the GIL against the busy engine thread. Under load that added ~100 ms to time
to first token and to ``/debug`` latency, for routes that use none of it: API
clients authenticate with a bearer key, and the views are CSRF-exempt JSON.

``manage.py serve`` fills the engine registry before handing this application to
Daphne. Under another ASGI server (``daphne debugsite.asgi:application``), set
``ENGINES_MODELS`` and the engines are built here, at import, from the
``ENGINES_*`` variables (see :func:`engines.registry.configure_from_env`).
"""
import os
from concurrent.futures import ThreadPoolExecutor

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "debugsite.settings")
# Django must be set up before anything imports models, consumers or routing.
django_asgi_app = get_asgi_application()

from asgiref.sync import ThreadSensitiveContext  # noqa: E402
from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.core.exceptions import DisallowedHost  # noqa: E402
from django.core.handlers.asgi import ASGIHandler  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402
from django.core.handlers.exception import convert_exception_to_response  # noqa: E402
from django.http import HttpRequest, HttpResponseBase  # noqa: E402
from django.http.request import split_domain_port  # noqa: E402

from engines import registry as engine_registry  # noqa: E402
from engines.auth import APIKeyMiddleware, routed_path  # noqa: E402
from engines.dashboard.same_origin import SameOriginValidator  # noqa: E402
from engines.protocol.errors import ProtocolError  # noqa: E402
from engines.routing import websocket_urlpatterns  # noqa: E402
from engines.views.errors import error_response  # noqa: E402

API_PREFIXES = ("/v1", "/debug", "/microserving", "/metrics", "/stats", "/health")
# The API requests' sync calls (Django's request signals, ``response.close``): one thread for all.
API_SYNC_EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="api-sync")


class APIHandler(ASGIHandler):
    """Django's ASGI handler without middleware, for the JSON API routes.

    It keeps the one check the API needs from the stack it skips: the Host header must be
    in ``ALLOWED_HOSTS`` (CommonMiddleware checked it), which is what stops a DNS-rebinding
    page in a browser from reaching a loopback server that has no API key.
    """

    async def __call__(self, scope, receive, send) -> None:
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
        self._view_middleware = []
        self._template_response_middleware = []
        self._exception_middleware = []
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
        return await self._get_response_async(request)


class PathRouter:
    """Send API paths to the bare handler and the rest to the full Django stack.

    Judged on the path Django will route (root path removed), as the API-key gate does.
    """

    def __init__(self, api_app, site_app) -> None:
        self.api_app = api_app
        self.site_app = site_app

    async def __call__(self, scope, receive, send) -> None:
        path = routed_path(scope)
        is_api = any(path == p or path.startswith(p + "/") for p in API_PREFIXES)
        await (self.api_app if is_api else self.site_app)(scope, receive, send)


if os.environ.get("ENGINES_MODELS") and not len(engine_registry.registry):
    engine_registry.configure_from_env()

application = ProtocolTypeRouter({
    # Static files (the admin's, the dashboard's, the vendored uPlot) straight from the app folders,
    # under serve and a bare Daphne alike, DEBUG on or off: no collectstatic, no CDN.
    "http": APIKeyMiddleware(PathRouter(APIHandler(), ASGIStaticFilesHandler(django_asgi_app))),
    # The dashboard's sockets: the browser's session (staff only, checked by the consumer), and
    # only from this server's own pages (scheme, host and port), so that no other site, nor a page
    # on another port of this machine, can open one with the user's cookie.
    "websocket": SameOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns))),
})
