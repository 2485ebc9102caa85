"""Websocket routes: the dashboard's engine sockets and its fleet socket; any other path is refused cleanly."""
from django.urls import path, re_path

from engines.dashboard.consumers import DashboardConsumer, RefusedSocket, TimelineConsumer
from engines.dashboard.fleet_socket import FleetConsumer

# Channels routes its consumers with Django's path(), whose stubs (django-stubs) take views only,
# not ASGI applications: hence the ignores (and the one where debugsite.asgi hands the list on).
websocket_urlpatterns = [
    path("ws/engines/", DashboardConsumer.as_asgi()),  # type: ignore[arg-type]
    path("ws/fleet/", FleetConsumer.as_asgi()),  # type: ignore[arg-type]
    path("ws/engines/<str:engine>/", DashboardConsumer.as_asgi()),  # type: ignore[arg-type]
    path("ws/engines/<str:engine>/timeline/", TimelineConsumer.as_asgi()),  # type: ignore[arg-type]
    re_path(r"^.*$", RefusedSocket.as_asgi()),  # type: ignore[arg-type]
]
