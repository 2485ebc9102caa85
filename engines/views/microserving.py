"""MLC's MicroServing API (``/microserving/*``, with ``--enable-debug``): one engine prefills,
another decodes, the K/V travels between them. The three calls of a request share its ``user``.

* ``prep_recv``: reserve the decode engine's pages for ``prompt[0:end]``; answers the
  ``kv_append_metadata`` (where to send, see ``engines.protocol.microserving``) and
  ``prefix_matched_length``.
* ``remote_send``: prefill ``prompt[:end]`` here, send the K/V of ``[begin:end]`` to the
  metadata's receiver; ``{}`` once it has landed there.
* ``start_generate``: generate on the received K/V; a normal completion reply.
* ``kv_release`` (ours): where another server's ``remote_send`` says the K/V will not come.
  The K/V itself goes to the receiving engine's own listener (``kv_url`` in the metadata;
  ``engines.runtime`` ``kv_http``), not through this web stack.
"""
from __future__ import annotations

from typing import TypeVar
from urllib.parse import urlsplit

import orjson
from django.http import HttpRequest, HttpResponse
from pydantic import ValidationError

from engines.disagg.delivery import deliver, on_device, release
from engines.protocol import ChatCompletionRequest, CompletionRequest, ProtocolError
from engines.protocol.microserving import ChatPrepRecvRequest, ChatRemoteSendRequest, ChatStartGenerateRequest, \
    KVAppendMetadata, KVReceiverAddress, PrepRecvRequest, RemoteSendRequest, StartGenerateRequest
from engines.registry import registry
from engines.runtime import AsyncEngine, EngineRequestError, GenerationRequest, KVBlock, KVSend
from engines.views.debug import debug_gated
from engines.views.errors import json_response
from engines.views.openai import ChatShaper, CompletionShaper, generate_reply, lookup_engine, \
    make_generation_request, parse_body, tokenize_chat

NOT_MOUNTED = "Not found: the /microserving endpoints exist only when the server runs with --enable-debug."
#: How long prep_recv's pages wait for their K/V and start_generate before they are released.
RECEIVE_TIMEOUT_S = 60.0

microserving_view = debug_gated(NOT_MOUNTED)
RequestT = TypeVar("RequestT", bound=CompletionRequest | ChatCompletionRequest)


def _parse(request: HttpRequest, completion: type[RequestT], chat: type[RequestT]) -> RequestT:
    """The body as the call's completion model, or its chat model when it carries ``messages``."""
    try:
        is_chat = "messages" in orjson.loads(request.body)
    except (orjson.JSONDecodeError, TypeError):
        is_chat = False  # parse_body says what is wrong with it
    return parse_body(request, chat if is_chat else completion)


def _prompt(engine: AsyncEngine, body: CompletionRequest | ChatCompletionRequest) -> list[int]:
    """The prompt's token ids: given, encoded, or the chat template's rendering."""
    if isinstance(body, ChatCompletionRequest):
        return tokenize_chat(engine.tokenizer, body)[0]
    return body.prompt if isinstance(body.prompt, list) else engine.tokenizer.encode(body.prompt)


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
        generation = make_generation_request(body.user, _prompt(engine, body), body)
        generation.kv_send = KVSend(body.begin, body.end, receiver.ticket, on_device(engine, receiver))
        block = await _prefill(engine, generation)
    except ProtocolError:
        await release(receiver)  # its K/V will not come: the receiver's pages are freed now
        raise
    engine.record_server_event(body.user, "start kv transfer", {"bytes": block.nbytes, "to": receiver.url})
    try:
        await deliver(block, receiver)
    finally:
        engine.record_server_event(body.user, "finish kv transfer")
    return json_response({})


async def _prefill(engine: AsyncEngine, generation: GenerationRequest) -> KVBlock:
    """Run a ``kv_send`` request to its end; the block its last output carries."""
    last = None
    try:
        async for output in engine.generate(generation):
            last = output
    except EngineRequestError as exc:
        raise ProtocolError(400, str(exc)) from None
    if last is None or last.kv_block is None:
        reason = ",".join(c.finish_reason or "" for c in last.choices) if last else "none"
        raise ProtocolError(503, f"the prefill of request {generation.request_id!r} ended without its K/V "
                                 f"(finish reason {reason}); send the request again")
    return last.kv_block


@microserving_view
async def start_generate(request: HttpRequest) -> HttpResponse:
    """Generate on the received K/V: the rest of the prompt, then the completion."""
    body = _parse(request, StartGenerateRequest, ChatStartGenerateRequest)
    engine = lookup_engine(body.model)
    generation = make_generation_request(body.user, _prompt(engine, body), body)
    generation.kv_window_begin = body.begin
    shaper = (ChatShaper if isinstance(body, ChatCompletionRequest) else CompletionShaper)(body.user, engine, body)
    return await generate_reply(engine, body, generation, shaper)


@microserving_view
async def kv_release(request: HttpRequest) -> HttpResponse:
    """Free a reservation whose K/V will not come (another server's prefill failed)."""
    try:
        receiver = KVReceiverAddress.model_validate_json(request.body)
    except ValidationError as exc:
        raise ProtocolError(400, f"a KV release names the receiver (url, server, engine, request_id, ticket): "
                                 f"{exc.errors(include_url=False)[0]['msg']}") from None
    engine = lookup_engine(receiver.engine)
    return json_response({"released": await engine.release_receive(receiver.request_id, receiver.ticket)})
