"""Websocket routes: the dashboard's engine sockets; any other path is refused cleanly."""
from django.urls import path, re_path

from engines.consumers import DashboardConsumer, RefusedSocket, TimelineConsumer

websocket_urlpatterns = [
    path("ws/engines/", DashboardConsumer.as_asgi()),
    path("ws/engines/<str:engine>/", DashboardConsumer.as_asgi()),
    path("ws/engines/<str:engine>/timeline/", TimelineConsumer.as_asgi()),
    re_path(r"^.*$", RefusedSocket.as_asgi()),
]
