"""When a request reached this server: the one clock a request's queue time, TTFT and end-to-end
latency are measured from (docs/metrics.md).

:class:`StampArrival` is the outermost ASGI layer: it stamps every HTTP request before the API-key
check, the routing, the body's parsing, the tokenizer and the wait for the engine's step in
flight, all of which a client's clock counts. The stamp is ``time.perf_counter()`` seconds
(``CLOCK_MONOTONIC`` on Linux: one clock for every process of a host), so it crosses into the
engine's process as it is. Across hosts a monotonic stamp means nothing: a disaggregating router
sends its request's age instead (:data:`AGE_HEADER`), and the server it calls counts the request's
metrics from that much earlier (its trace stays on its own time: its spans are what it ran).
"""
from __future__ import annotations

import math
import time
from typing import Any

from django.http import HttpRequest

from engines.server.asgi_types import ASGIApp, Receive, Scope, Send

__all__ = ["AGE_HEADER", "MAX_AGE_S", "StampArrival", "age_headers", "age_of", "arrival_of"]

#: The scope key the stamp is kept under.
ARRIVAL_KEY = "engines.arrival_s"
#: Seconds since the request reached the first server of ours (a router), sent with the calls that
#: server makes for it: the server called counts the request's life from there, not from the call.
AGE_HEADER = "X-Request-Age"
#: An age above this (an hour) is not believed: the stamp stays this server's own.
MAX_AGE_S = 3600.0


class StampArrival:
    """Stamps each HTTP request's scope with its arrival, once, before anything else runs."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and ARRIVAL_KEY not in scope:
            scope[ARRIVAL_KEY] = time.perf_counter()
        await self.app(scope, receive, send)


def arrival_of(request: HttpRequest) -> float:
    """When ``request`` arrived here (``time.perf_counter()`` seconds): its stamp, or now for a
    request that came another way (a test client)."""
    scope: dict[str, Any] = getattr(request, "scope", {})
    arrival = scope.get(ARRIVAL_KEY)
    return arrival if isinstance(arrival, float) else time.perf_counter()


def age_of(request: HttpRequest) -> float:
    """How old the request already was when it arrived (seconds): the :data:`AGE_HEADER` a router
    of ours sent with a MicroServing call, when it is a sane number; else 0."""
    try:
        age = float(request.headers.get(AGE_HEADER, ""))
    except ValueError:
        return 0.0
    return age if math.isfinite(age) and 0.0 < age <= MAX_AGE_S else 0.0


def age_headers(arrival: float) -> dict[str, str]:
    """The header that tells a server of ours how long ago this request arrived here."""
    return {AGE_HEADER: f"{max(time.perf_counter() - arrival, 0.0):.6f}"}
