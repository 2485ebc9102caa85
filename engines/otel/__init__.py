"""OpenTelemetry: a span per generation request, exported over OTLP/HTTP (protobuf) to a collector.

Off unless an endpoint is configured: ``serve --otlp-traces-endpoint URL``, or the standard
variables (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, a full URL; ``OTEL_EXPORTER_OTLP_ENDPOINT``, a
base that ``/v1/traces`` is appended to, as the OTLP spec says). Off, nothing of OpenTelemetry is
imported and a request costs one check (:func:`begin` returns None); the SDK and the exporter
load in :func:`configure` (:mod:`engines.otel.export`, which builds the spans).

This module is the face the server uses: :func:`configure` at start, :func:`begin` per request,
:func:`shutdown` at exit (:func:`force_flush` for tests and benches).
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from django.http import HttpRequest

    from engines.otel.export import RequestSpan, SpanExport
    from engines.protocol import ChatCompletionRequest, CompletionRequest
    from engines.runtime import GenerationRequest

__all__ = ["ENDPOINT_VARIABLES", "TRACE_CONTEXT_HEADERS", "begin", "configure", "endpoint_from", "exporting",
           "force_flush", "shutdown", "trace_context"]

#: The standard variables, in the order the OTLP exporter spec reads them.
ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")

_export: SpanExport | None = None


def endpoint_from(flag: str | None, env: Mapping[str, str] | None = None) -> str | None:
    """The traces URL to export to, or None (off): ``flag`` as given; else
    ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` as given; else ``OTEL_EXPORTER_OTLP_ENDPOINT`` with
    ``/v1/traces`` appended. ``OTEL_SDK_DISABLED=true`` turns the variables off (not the flag).
    Raises ValueError for a URL that is not ``http(s)://host[:port][/path]``."""
    env = os.environ if env is None else env
    url = (flag or "").strip()
    source = "--otlp-traces-endpoint"
    if not url and env.get("OTEL_SDK_DISABLED", "").strip().lower() != "true":
        if traces := env.get(ENDPOINT_VARIABLES[0], "").strip():
            url, source = traces, ENDPOINT_VARIABLES[0]
        elif base := env.get(ENDPOINT_VARIABLES[1], "").strip():
            url, source = base.rstrip("/") + "/v1/traces", ENDPOINT_VARIABLES[1]
    if not url:
        return None
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{source} {url!r} is not an OTLP/HTTP URL: give http(s)://HOST:PORT/v1/traces "
                         "(a collector's OTLP/HTTP port is 4318 by default)")
    return url


def configure(endpoint: str | None, service_name: str | None = None) -> str | None:
    """Export request spans to ``endpoint`` (:func:`endpoint_from`'s URL; None: off, as before).
    Replaces any earlier export (shut down first). Returns the endpoint. ``service_name``: the
    resource's ``service.name`` (default ``$OTEL_SERVICE_NAME``, else ``llm-debugsite``)."""
    global _export
    shutdown()
    if endpoint is None:
        return None
    from engines.otel.export import SpanExport  # the SDK loads here, never on a request

    _export = SpanExport(endpoint, service_name)
    return endpoint


def exporting() -> str | None:
    """The endpoint spans go to, or None when off."""
    return _export.endpoint if _export is not None else None


def begin(request: HttpRequest, body: ChatCompletionRequest | CompletionRequest,
          generation: GenerationRequest, model: str) -> RequestSpan | None:
    """The span of one generation request, joined to the client's ``traceparent``; None when off
    (the one cost of a request then). The serving layer feeds it the engine's outputs."""
    if _export is None:
        return None
    return _export.begin(request.headers, body, generation, model)


#: The W3C trace-context headers (``traceparent``, ``tracestate``) a hop passes on.
TRACE_CONTEXT_HEADERS = ("traceparent", "tracestate")


def trace_context(request: HttpRequest) -> dict[str, str]:
    """The client's W3C trace-context headers, to send on (a router to its decode server), exporting or not:
    the hop that makes the spans is the one that decides."""
    return {name: value for name in TRACE_CONTEXT_HEADERS if (value := request.headers.get(name))}


def force_flush() -> bool:
    """Export every span ended so far, now (tests, benches); True when off."""
    return _export.force_flush() if _export is not None else True


def shutdown() -> None:
    """Export what is left and stop (at once when the endpoint is failing); a no-op when off."""
    global _export
    export, _export = _export, None
    if export is not None:
        export.shutdown()
