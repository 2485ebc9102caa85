"""The OpenAI routes of a disaggregating router (``serve --router disagg``): relay the decode
server's reply, JSON or SSE, as it comes (``engines.disagg.router``)."""
from __future__ import annotations

from collections.abc import AsyncIterator

import orjson
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse

from engines.disagg.router import DisaggRouter, RoutedReply, RouterError
from engines.protocol import ProtocolError
from engines.protocol.json_body import JSONTooDeepError, loads_bounded
from engines.registry import registry
from engines.views.errors import json_response


async def routed_generation(router: DisaggRouter, request: HttpRequest) -> HttpResponse:
    """A completion or chat request through the router; upstream errors come back as they were."""
    try:
        payload = loads_bounded(request.body)
    except (JSONTooDeepError, orjson.JSONDecodeError) as exc:
        raise ProtocolError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise ProtocolError(400, "the request body must be a JSON object")
    try:
        with registry.response_in_flight():
            return _response(await router.route(payload))
    except RouterError as exc:
        return json_response(exc.body, status=exc.status)


async def routed_models(router: DisaggRouter) -> HttpResponse:
    """The decode servers' models."""
    try:
        return _response(await router.models())
    except RouterError as exc:
        return json_response(exc.body, status=exc.status)


def _response(reply: RoutedReply) -> HttpResponse:
    if reply.stream is None:
        return HttpResponse(reply.body, status=reply.status, content_type=reply.content_type)
    return StreamingHttpResponse(_counted(reply.stream), content_type=reply.content_type,
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _counted(stream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A relayed stream, counted in flight while it is written (a draining shutdown waits for it,
    as for the engine servers' own streams); closing it closes the upstream stream."""
    with registry.response_in_flight():
        try:
            async for event in stream:
                yield event
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
