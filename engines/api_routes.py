"""The machine-facing API's routes, declared once, each with its protection.

:data:`API_ROUTES` is the one list. Three places read it, none keeps a list of its own:

- the API-key gate (:mod:`engines.auth`) refuses the routes that need the key without it;
- the ASGI entry (:mod:`debugsite.asgi`) sends every API route to the bare handler, which runs
  none of the browser middleware;
- the URLconf (:mod:`debugsite.urls`) answers a path under an API route that no view serves
  with a 404 in the API's error shape, not Django's HTML page.

A route covers its path and every path below it (``/v1`` covers ``/v1/models``), on whole
segments (``/v1x`` is not under ``/v1``). Plain data, no Django: the gate runs before Django does.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["API_ROUTES", "APIRoute", "api_route"]


@dataclass(frozen=True, slots=True)
class APIRoute:
    """One API prefix: ``prefix`` (``"/v1"``), whether it needs the API key (when the server
    has one), and what is there."""

    prefix: str
    needs_key: bool
    serves: str

    def covers(self, path: str) -> bool:
        """Whether ``path`` (as Django routes it) is this route or below it."""
        return path == self.prefix or path.startswith(self.prefix + "/")


API_ROUTES: tuple[APIRoute, ...] = (
    APIRoute("/v1", True, "the OpenAI-compatible API (engines.views.openai)"),
    APIRoute("/debug", True, "MLC's debug endpoints, with --enable-debug (engines.views.debug)"),
    APIRoute("/microserving", True, "MLC's MicroServing API, with --enable-debug (engines.views.microserving)"),
    APIRoute("/metrics", True, "Prometheus exposition (engines.views.metrics)"),
    APIRoute("/stats", True, "the engines' metrics as JSON (engines.views.metrics)"),
    APIRoute("/fleet.json", True, "every server and engine of the fleet as JSON (engines.views.fleet)"),
    APIRoute("/tokenize", True, "vLLM's tokenize route (engines.views.vllm)"),
    APIRoute("/detokenize", True, "vLLM's detokenize route (engines.views.vllm)"),
    APIRoute("/version", True, "vLLM's version route (engines.views.vllm)"),
    APIRoute("/reset_prefix_cache", True, "vLLM's prefix cache reset, with --enable-debug (engines.views.debug)"),
    APIRoute("/start_profile", True, "vLLM's name for /debug/profile_start (engines.views.debug)"),
    APIRoute("/stop_profile", True, "vLLM's name for /debug/profile_stop (engines.views.debug)"),
    # Open: load balancers ask it without credentials.
    APIRoute("/health", False, "the health check (engines.views.metrics)"),
)


def api_route(path: str) -> APIRoute | None:
    """The API route ``path`` falls under, or None for a path of the site (dashboard, admin)."""
    return next((route for route in API_ROUTES if route.covers(path)), None)
