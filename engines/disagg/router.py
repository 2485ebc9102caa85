"""The disaggregating router (``manage.py serve --router disagg``): ordinary OpenAI requests in,
MicroServing's three calls behind them, so any client gets prefill/decode disaggregation. The
models and vLLM's ``/tokenize`` and ``/detokenize`` are the first decode server's, relayed.

For each request, as MLC's router does: pick the least loaded decode server; ``prep_recv``
there for the whole prompt but its last token; ``remote_send`` on a prefill server for what
the decode side's prefix cache lacks (skipped when it holds it all); ``start_generate`` on the
decode server, whose reply (JSON or SSE) goes back to the client as it comes. A request the
decode engine preempted (finish reason ``preempt``) is run again once, if no text of it reached
the client yet (always so for a non-streaming one).

Each request gets a fresh request id on the engines (the client's ``user``, else its ``X-Request-Id``,
plus a suffix): the three calls are tied by it, and two clients sending one ``user`` must not
collide. Every upstream call also carries the client's ``X-Request-Id`` (one minted here when it
sent none: :func:`mint_request_id`), which the router's reply echoes, so one id names the request on
the router, the prefill and the decode servers (their replies echo it, their live tables show it).
"""
from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx
import orjson

from engines.disagg.router_trace import RouterTrace
from engines.request_arrival import age_headers
from engines.request_ids import MAX_REQUEST_ID_CHARS, REQUEST_ID_HEADER
from engines.protocol import ErrorResponse

logger = logging.getLogger("engines.disagg")

__all__ = ["DisaggRouter", "RouterError", "RoutedReply", "mint_request_id"]

#: Connect, and each read or write, may take this long (a long prefill answers late).
UPSTREAM_TIMEOUT = httpx.Timeout(300.0, connect=10.0)
#: What an engine request id adds to its base: ``-<12 hex>`` for the request, ``-<attempt>``.
_ENGINE_ID_SUFFIX_CHARS = 13 + 2


def mint_request_id() -> str:
    """An ``X-Request-Id`` for a request whose client sent none."""
    return f"disagg-{uuid.uuid4().hex}"


def _id_header(request_id: str | None) -> dict[str, str]:
    return {REQUEST_ID_HEADER: request_id} if request_id else {}


class RouterError(Exception):
    """An upstream call failed: ``status`` and ``body`` are what the client gets (the upstream's
    own error object when it sent one)."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(body.get("message", ""))
        self.status = status
        self.body = body


@dataclass
class RoutedReply:
    """The decode server's reply: one JSON body, or an SSE stream to relay."""

    status: int
    content_type: str
    body: bytes = b""
    stream: AsyncIterator[bytes] | None = None


@dataclass
class DisaggRouter:
    """Routes completion and chat requests over prefill and decode servers (their base URLs).

    ``api_key`` is sent upstream (a cluster shares one key).
    """

    prefill_urls: list[str]
    decode_urls: list[str]
    api_key: str | None = None
    #: httpx's default (the network) unless given: tests put a mock here.
    transport: httpx.AsyncBaseTransport | None = None
    #: Requests this router has in flight on each decode server (what "least loaded" means).
    in_flight: dict[str, int] = field(init=False)
    #: The router's own spans of each request's calls, for the fleet's merged timeline.
    trace: RouterTrace = field(init=False, repr=False)
    _next_prefill: Iterator[str] = field(init=False, repr=False)
    _client: httpx.AsyncClient | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.prefill_urls or not self.decode_urls:
            raise ValueError("a disaggregating router needs at least one prefill URL and one decode URL")
        self.prefill_urls = [u.rstrip("/") for u in self.prefill_urls]
        self.decode_urls = [u.rstrip("/") for u in self.decode_urls]
        self.in_flight = {u: 0 for u in self.decode_urls}
        self.trace = RouterTrace()
        self._next_prefill = itertools.cycle(self.prefill_urls)

    @property
    def client(self) -> httpx.AsyncClient:
        """One pooled client (keep-alive to every upstream); made on first use, on the serving loop."""
        if self._client is None:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._client = httpx.AsyncClient(timeout=UPSTREAM_TIMEOUT, headers=headers, transport=self.transport)
        return self._client

    async def aclose(self) -> None:
        """Close the upstream connections."""
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def pick_decode(self) -> str:
        """The decode server with the fewest requests in flight from this router (first on a tie)."""
        return min(self.decode_urls, key=lambda u: self.in_flight[u])

    async def models(self, request_id: str | None = None) -> RoutedReply:
        """The first decode server's ``/v1/models``."""
        reply = await self._post_or_get("GET", self.decode_urls[0] + "/v1/models", None, _id_header(request_id))
        return RoutedReply(reply.status_code, "application/json", reply.content)

    async def model(self, model_id: str, request_id: str | None = None) -> RoutedReply:
        """The first decode server's ``/v1/models/{model_id}`` (its 404 for a model it does not serve)."""
        reply = await self._post_or_get("GET", self.decode_urls[0] + "/v1/models/" + quote(model_id), None,
                                        _id_header(request_id))
        return RoutedReply(reply.status_code, "application/json", reply.content)

    async def tokenizer_call(self, path: str, payload: dict[str, Any], request_id: str | None = None) -> RoutedReply:
        """vLLM's ``POST /tokenize`` or ``/detokenize`` (``path``), asked of the first decode server
        and its answer relayed; a refusal comes back as a :class:`RouterError` in the error shape.

        A decode server, because its tokenizer makes the token ids that count: ``start_generate``
        tokenizes the prompt there, its ``max_model_len`` bounds prompt plus output, and its prefix
        cache is what the ids match (a prefill server serves the same model: the K/V's identity
        check holds them to it). The first, as for the models, so one client sees one answer."""
        reply = await self._post_or_get("POST", self.decode_urls[0] + path, payload, _id_header(request_id))
        if reply.status_code != 200:
            raise RouterError(reply.status_code, _upstream_error(reply.status_code, reply.content))
        return RoutedReply(200, "application/json", reply.content)

    async def route(self, payload: dict[str, Any], arrival: float | None = None,
                    request_id: str | None = None, trace_context: Mapping[str, str] | None = None) -> RoutedReply:
        """Serve one completion or chat request (``payload`` is the client's JSON object), which
        arrived at ``arrival`` (``perf_counter`` seconds; default now): the servers it calls are
        told its age with each call, so their engines count its life from the client's arrival.
        ``request_id`` is the client's ``X-Request-Id`` (a fresh one when None), sent with every call;
        ``trace_context`` its W3C ``traceparent`` and ``tracestate``, sent on to the decode server's
        start_generate, whose span (``engines.otel``) then joins the client's trace."""
        arrival = time.perf_counter() if arrival is None else arrival
        request_id = request_id or mint_request_id()
        # The engines' id: the user's, else the client's X-Request-Id, cut to leave the suffixes
        # room within the length a user may have (longer, the upstream servers refuse it).
        base = str(payload.get("user") or request_id)[:MAX_REQUEST_ID_CHARS - _ENGINE_ID_SUFFIX_CHARS]
        rid = f"{base}-{uuid.uuid4().hex[:12]}"
        for attempt in (1, 2):
            decode = self.pick_decode()
            self.in_flight[decode] += 1
            try:
                reply = await self._run(decode, {**payload, "user": f"{rid}-{attempt}"}, arrival, request_id,
                                        dict(trace_context or {}))
            except BaseException:
                self.in_flight[decode] -= 1
                raise
            if reply.stream is None:
                self.in_flight[decode] -= 1
                if attempt == 1 and _preempted(reply.body):
                    logger.info("request %s was preempted on %s; running it again", rid, decode)
                    continue
                return reply
            head = await _head_events(reply.stream)
            if attempt == 1 and any(_preempted_event(e) for e in head):
                self.in_flight[decode] -= 1
                await reply.stream.aclose()  # type: ignore[attr-defined]
                logger.info("request %s was preempted on %s; running it again", rid, decode)
                continue
            reply.stream = self._relay(head, reply.stream, decode)
            return reply
        raise AssertionError("unreachable")

    async def _run(self, decode: str, payload: dict[str, Any], arrival: float, request_id: str,
                   trace_context: dict[str, str]) -> RoutedReply:
        """The three calls for one attempt, each carrying the client's ``X-Request-Id``."""
        user = payload["user"]
        ids = _id_header(request_id)
        routed = self.trace.now_us()
        # prep_recv and remote_send answer plain JSON: the client's streaming options are for start_generate.
        quiet = {k: v for k, v in payload.items() if k not in ("stream", "stream_options")}
        started = self.trace.now_us()
        prep = await self._call(decode, "/microserving/prep_recv", {**quiet, "end": -1}, ids)
        matched, length = prep["prefix_matched_length"], prep["prompt_length"]
        self.trace.span(user, "prep_recv", started, {"server": decode, "prefix_matched": matched, "prompt": length})
        if matched < length - 1:
            prefill = next(self._next_prefill)
            started = self.trace.now_us()
            await self._call(prefill, "/microserving/remote_send", {
                **quiet, "begin": matched, "end": -1, "kv_addr_info": prep["kv_append_metadata"], "recv_rank": 0},
                {**ids, **age_headers(arrival)})
            self.trace.span(user, "remote_send", started, {"server": prefill, "begin": matched})
        logger.debug("request %s: prefix %d of %d on %s", user, matched, length, decode)
        request = self.client.build_request("POST", decode + "/microserving/start_generate",
                                            content=orjson.dumps({**payload, "begin": length - 1}),
                                            headers={"Content-Type": "application/json", **ids, **age_headers(arrival),
                                                     **trace_context})
        started = self.trace.now_us()
        try:
            response = await self.client.send(request, stream=True)
            self.trace.span(user, "start_generate", started, {"server": decode, "status": response.status_code})
            self.trace.span("", "route", routed, {"request": user, "decode": decode, "x_request_id": request_id})
        except httpx.HTTPError as exc:
            raise RouterError(
                502, _error_body(502, f"the decode server {decode} could not be reached: {exc!r}")) from exc
        content_type = response.headers.get("content-type", "application/json")
        if response.status_code != 200 or not content_type.startswith("text/event-stream"):
            body = await response.aread()
            await response.aclose()
            if response.status_code != 200:
                raise RouterError(response.status_code, _upstream_error(response.status_code, body))
            return RoutedReply(200, content_type, body)
        return RoutedReply(200, content_type, stream=_lines(response))

    async def _relay(self, head: list[bytes], rest: AsyncIterator[bytes], decode: str) -> AsyncIterator[bytes]:
        try:
            for event in head:
                yield event
            async for event in rest:
                yield event
        finally:
            self.in_flight[decode] -= 1
            await rest.aclose()  # type: ignore[attr-defined]

    async def _call(self, base: str, path: str, payload: dict[str, Any],
                    headers: dict[str, str] | None = None) -> dict[str, Any]:
        reply = await self._post_or_get("POST", base + path, payload, headers)
        if reply.status_code != 200:
            raise RouterError(reply.status_code, _upstream_error(reply.status_code, reply.content))
        return reply.json()

    async def _post_or_get(self, method: str, url: str, payload: dict[str, Any] | None,
                           headers: dict[str, str] | None = None) -> httpx.Response:
        try:
            if method == "GET":
                return await self.client.get(url, headers=headers)
            return await self.client.post(url, content=orjson.dumps(payload),
                                          headers={"Content-Type": "application/json", **(headers or {})})
        except httpx.HTTPError as exc:
            raise RouterError(502, _error_body(502, f"{url} could not be reached: {exc!r}")) from None


async def _lines(response: httpx.Response) -> AsyncIterator[bytes]:
    """The SSE events of a streamed reply, one ``data: ...\\n\\n`` block each."""
    try:
        buffer = b""
        async for chunk in response.aiter_bytes():
            buffer += chunk
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                yield event + b"\n\n"
        if buffer.strip():
            yield buffer
    finally:
        await response.aclose()


async def _head_events(stream: AsyncIterator[bytes]) -> list[bytes]:
    """The events up to the first that carries text or a finish reason: until then nothing of
    the request has reached the client, so a preemption can still be retried unseen."""
    head: list[bytes] = []
    async for event in stream:
        head.append(event)
        data = event.removeprefix(b"data: ").strip()
        if data == b"[DONE]":
            break
        try:
            choices = orjson.loads(data).get("choices") or []
        except (orjson.JSONDecodeError, AttributeError):
            break
        if any(c.get("text") or (c.get("delta") or {}).get("content") or c.get("finish_reason") for c in choices):
            break
    return head


def _preempted(body: bytes) -> bool:
    try:
        choices = orjson.loads(body).get("choices") or []
    except (orjson.JSONDecodeError, AttributeError):
        return False
    return any(c.get("finish_reason") == "preempt" for c in choices)


def _preempted_event(event: bytes) -> bool:
    """A first SSE event that already ends the request with ``preempt`` (no token was sent)."""
    data = event.removeprefix(b"data: ").strip()
    return data != b"[DONE]" and _preempted(data)


def _error_body(status: int, message: str) -> dict[str, Any]:
    return ErrorResponse.from_status(status, message).model_dump()


def _upstream_error(status: int, body: bytes) -> dict[str, Any]:
    try:
        data = orjson.loads(body)
        if isinstance(data, dict) and "message" in data:
            return data
    except orjson.JSONDecodeError:
        pass
    return _error_body(status, f"upstream answered {status}: {body[:300].decode('utf-8', 'replace')}")
