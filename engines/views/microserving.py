"""MLC's MicroServing API (``/microserving/*``, with ``--enable-debug``): one engine prefills,
another decodes, the K/V travels between them. The three calls of a request share its ``user``
(the engine's request id); a router's ``X-Request-Id`` (the client's) goes on its live row.

* ``prep_recv``: reserve the decode engine's pages for ``prompt[0:end]``; answers the
  ``kv_append_metadata`` (where to send, see ``engines.protocol.microserving``) and
  ``prefix_matched_length``.
* ``remote_send``: prefill ``prompt[:end]`` here, send the K/V of ``[begin:end]`` to the
  metadata's receiver; ``{}`` once it has landed there.
* ``start_generate``: generate on the received K/V; a normal completion reply.
* ``kv_release`` (ours): where another server's ``remote_send`` says the K/V will not come.
  The K/V itself goes from the prefill engine's process to the receiving engine's own listener
  (``kv_url`` in the metadata; ``engines.runtime`` ``kv_http``), through neither web stack.
"""
from __future__ import annotations

from typing import TypeVar
from urllib.parse import urlsplit

from django.http import HttpRequest, HttpResponse, HttpResponseBase
from pydantic import ValidationError

from engines import otel
from engines.disagg.delivery import check_delivery, deliver, release, send_spec
from engines.protocol import ChatCompletionRequest, CompletionRequest, ProtocolError
from engines.protocol.microserving import ChatPrepRecvRequest, ChatRemoteSendRequest, ChatStartGenerateRequest, \
    KVAppendMetadata, KVReceiverAddress, PrepRecvRequest, RemoteSendRequest, StartGenerateRequest
from engines.registry import registry
from engines.request_arrival import age_of, arrival_of
from engines.request_ids import client_request_id
from engines.runtime import AsyncEngine, EngineRequestError, GenerationRequest, RequestOutput
from engines.serving.generation import generate
from engines.serving.request_mapping import lookup_engine, make_generation_request, prompt_ids, tokenize_chat, \
    validate_body
from engines.serving.shapers import ChatShaper, CompletionShaper, ResponseShaper
from engines.views.api import debug_gated, json_body, json_response, reply_response

NOT_MOUNTED = "Not found: the /microserving endpoints exist only when the server runs with --enable-debug."
#: How long prep_recv's pages wait for their K/V and start_generate before they are released.
RECEIVE_TIMEOUT_S = 60.0

microserving_view = debug_gated(NOT_MOUNTED)
CompletionT = TypeVar("CompletionT", bound=CompletionRequest)
ChatT = TypeVar("ChatT", bound=ChatCompletionRequest)


def _parse(request: HttpRequest, completion: type[CompletionT], chat: type[ChatT]) -> CompletionT | ChatT:
    """The body as the call's completion model, or its chat model when it carries ``messages``."""
    data = json_body(request)
    if "messages" in data:
        return validate_body(data, chat)
    return validate_body(data, completion)


def _prompt(engine: AsyncEngine, body: CompletionRequest | ChatCompletionRequest) -> list[int]:
    """The prompt's token ids: given, encoded, or the chat template's rendering."""
    if isinstance(body, ChatCompletionRequest):
        return tokenize_chat(engine.tokenizer, body)[0]
    return prompt_ids(engine.tokenizer, body.prompts[0])  # one prompt: takes_prompt_lists_and_echo is False


@microserving_view
async def prep_recv(request: HttpRequest) -> HttpResponse:
    """Reserve the pages; answer where the K/V must go."""
    body = _parse(request, PrepRecvRequest, ChatPrepRecvRequest)
    engine = lookup_engine(body.model)
    prompt = _prompt(engine, body)
    try:
        receipt = await engine.prepare_receive(body.user, prompt, body.end, RECEIVE_TIMEOUT_S)
    except EngineRequestError as exc:
        raise ProtocolError(400, str(exc)) from None
    receiver = KVReceiverAddress(url=request.build_absolute_uri("/"), server=registry.server_id,
                                 engine=engine.name, request_id=body.user, ticket=receipt.ticket,
                                 kv_url=_listener_url(request, engine))
    metadata = KVAppendMetadata.for_window(receipt.segments, receiver, receipt.identity.as_dict())
    # prompt_length (ours, as in MLC's usage extra) lets a router resolve a negative end.
    return json_response({"kv_append_metadata": metadata.encode(),
                          "prefix_matched_length": receipt.prefix_matched_length,
                          "prompt_length": len(prompt)})


def _listener_url(request: HttpRequest, engine: AsyncEngine) -> str | None:
    """The engine's K/V listener, on the host name the caller reached this server by."""
    if engine.kv_port is None:
        return None
    host = urlsplit(request.build_absolute_uri("/")).hostname or "127.0.0.1"
    return f"http://{f'[{host}]' if ':' in host else host}:{engine.kv_port}"


@microserving_view
async def remote_send(request: HttpRequest) -> HttpResponse:
    """Prefill without sampling, then deliver the window's K/V to the receiver."""
    body = _parse(request, RemoteSendRequest, ChatRemoteSendRequest)
    metadata = KVAppendMetadata.decode(body.kv_addr_info)
    receiver = metadata.receiver
    if receiver.request_id != body.user:
        raise ProtocolError(400, f"kv_addr_info was made for request {receiver.request_id!r}, not for user "
                                 f"{body.user!r}: the three calls of a request share its user", param="user")
    try:
        engine = lookup_engine(body.model)
        generation = make_generation_request(body.user, _prompt(engine, body), body, arrival_of(request),
                                             client_request_id(request))
        generation.age_at_arrival_s = age_of(request)
        generation.kv_send = send_spec(engine, receiver, body.begin, body.end)
        last = await _prefill(engine, generation)
    except ProtocolError:
        await release(receiver)  # its K/V will not come: the receiver's pages are freed now
        raise
    if last.kv_delivery is not None:  # posted by the engine's process to the receiver's listener
        sent = last.kv_delivery
        engine.record_server_event(body.user, "start kv transfer", {"bytes": sent.nbytes, "to": receiver.url},
                                   at_ns=sent.started_ns)
        engine.record_server_event(body.user, "finish kv transfer", at_ns=sent.finished_ns)
        check_delivery(sent, receiver)
        return json_response({})
    block = last.kv_block
    assert block is not None  # _prefill's last output carries the block when it has no delivery
    engine.record_server_event(body.user, "start kv transfer", {"bytes": block.nbytes, "to": receiver.url})
    try:
        await deliver(block, receiver)
    finally:
        engine.record_server_event(body.user, "finish kv transfer")
    return json_response({})


async def _prefill(engine: AsyncEngine, generation: GenerationRequest) -> RequestOutput:
    """Run a ``kv_send`` request to its end; its last output, which carries the block (or how
    posting it went)."""
    last = None
    try:
        async for output in engine.generate(generation):
            last = output
    except EngineRequestError as exc:
        raise ProtocolError(400, str(exc)) from None
    if last is None or (last.kv_block is None and last.kv_delivery is None):
        reason = ",".join(c.finish_reason or "" for c in last.choices) if last else "none"
        raise ProtocolError(503, f"the prefill of request {generation.request_id!r} ended without its K/V "
                                 f"(finish reason {reason}); send the request again")
    return last


@microserving_view
async def start_generate(request: HttpRequest) -> HttpResponseBase:
    """Generate on the received K/V: the rest of the prompt, then the completion."""
    body = _parse(request, StartGenerateRequest, ChatStartGenerateRequest)
    engine = lookup_engine(body.model)
    generation = make_generation_request(body.user, _prompt(engine, body), body, arrival_of(request),
                                         client_request_id(request))
    generation.age_at_arrival_s = age_of(request)
    generation.kv_window_begin = body.begin
    shaper: ResponseShaper = (ChatShaper(body.user, engine, body) if isinstance(body, ChatCompletionRequest)
                              else CompletionShaper(body.user, engine, body))
    # The decode half's span, joined to the client's trace when a router passed its traceparent on.
    span = otel.begin(request, body, generation, engine.name)  # None unless spans are exported
    return reply_response(await generate(engine, body, generation, shaper, span))


@microserving_view
async def kv_release(request: HttpRequest) -> HttpResponse:
    """Free a reservation whose K/V will not come (another server's prefill failed)."""
    data = json_body(request)
    try:
        receiver = KVReceiverAddress.model_validate(data)
    except ValidationError as exc:
        raise ProtocolError(400, f"a KV release names the receiver (url, server, engine, request_id, ticket): "
                                 f"{exc.errors(include_url=False)[0]['msg']}") from None
    engine = lookup_engine(receiver.engine)
    return json_response({"released": await engine.release_receive(receiver.request_id, receiver.ticket)})
