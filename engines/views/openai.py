"""The OpenAI-compatible API: ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/completions``,
``POST /v1/chat/completions``.

Each view is parse, call, shape: the body is read (``json_body``) and validated with the
protocol's pydantic models, the request is mapped onto the engine's and run by
``engines.serving``, and what comes back is one JSON reply or server-sent events
(``data: {...}`` ... ``data: [DONE]``); the streaming semantics are decided in
``engines.serving.generation``.

A generation runs under ``user``, else the client's ``X-Request-Id``, else a fresh
``cmpl-``/``chatcmpl-`` id, which the reply's ``X-Request-Id`` names (``engines.request_ids``).

MLC's debug extension rides along: ``debug_config`` is honoured (and ``usage.extra``
returned) only when the server runs with ``--enable-debug``, and the ``query_engine_metrics``
special request is answered at once from the engine's metrics without generating.

Under a disaggregating router (``serve --router disagg``) the same routes relay the decode
server's reply, JSON or SSE, as it comes (``engines.disagg.router``); the client's ``X-Request-Id``
(else one the router mints, which its reply then names) goes with every call upstream.

Statuses: 400 for a body that is not JSON, fails validation or that the engine
refuses; 422 for MLC's two special-request rules (MLC's status for them);
404 for an unknown model; 503 when the engine has died.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from django.http import HttpRequest, HttpResponseBase

from engines import otel
from engines.disagg.router import DisaggRouter, RoutedReply
from engines.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, ProtocolError
from engines.registry import registry
from engines.request_arrival import arrival_of
from engines.request_ids import client_request_id, use_request_id
from engines.runtime import AsyncEngine
from engines.serving.generation import generate, metrics_events
from engines.serving.request_mapping import (
    is_metrics_query,
    lookup_engine,
    make_generation_request,
    new_request_id,
    prompt_ids,
    prompt_request_ids,
    tokenize_chat,
    validate_body,
)
from engines.serving.shapers import ChatShaper, CompletionShaper
from engines.views.api import api_view, json_body, json_response, reply_response, routed_response


@api_view("GET")
async def list_models(request: HttpRequest) -> HttpResponseBase:
    """The served models, in the order the engines were added (a router's: its decode servers')."""
    if registry.router is not None:
        return await routed_models(registry.router, request)
    cards = [ModelCard(id=name, created=registry.created(name)) for name in registry.model_names()]
    return json_response(ModelList(data=cards).model_dump())


@api_view("GET")
async def retrieve_model(request: HttpRequest, model: str) -> HttpResponseBase:
    """``GET /v1/models/{model}`` (the openai client's ``models.retrieve``): one card, or a 404 in the
    error shape for a model this server does not serve."""
    if registry.router is not None:
        return await routed_models(registry.router, request, model)
    if registry.get(model) is None:
        served = ", ".join(registry.model_names()) or "none"
        raise ProtocolError(404, f'The model "{model}" does not exist on this server. Served models: {served}.',
                            param="model")
    return json_response(ModelCard(id=model, created=registry.created(model)).model_dump())


@api_view("POST")
async def completions(request: HttpRequest) -> HttpResponseBase:
    """``/v1/completions``: a text (or token-id) prompt continued, or each of a list of them;
    ``echo`` returns the prompt too (with its logprobs)."""
    return await _generation(request, CompletionRequest, "cmpl", CompletionShaper, _completion_prompts)


@api_view("POST")
async def chat_completions(request: HttpRequest) -> HttpResponseBase:
    """``/v1/chat/completions``: messages rendered with the checkpoint's chat template, then continued."""
    return await _generation(request, ChatCompletionRequest, "chatcmpl", ChatShaper, _chat_prompt)


#: A prompt as token ids, and how many of them are the system prompt (for pinning; None: none).
Tokenized = tuple[list[int], int | None]
BodyT = TypeVar("BodyT", CompletionRequest, ChatCompletionRequest)
ShaperT = TypeVar("ShaperT", CompletionShaper, ChatShaper)


@dataclass(frozen=True)
class _Prompt:
    """One engine request of a reply: its id, its prompt's tokenizing (traced as the request's
    tokenization) and what the reply's shaper keeps of the ids (a completion's ``echo``)."""

    request_id: str
    tokenize: Callable[[], Tokenized]
    tokenized: Callable[[list[int]], None] | None = None


async def _generation(request: HttpRequest, schema: type[BodyT], prefix: str,
                      shaper_type: Callable[[str, AsyncEngine, BodyT], ShaperT],
                      prompts: Callable[[AsyncEngine, BodyT, str, ShaperT], list[_Prompt]]) -> HttpResponseBase:
    """The one recipe of both generation routes: validate the body as ``schema``, name the request
    (``prefix``-<uuid> unless the client or ``user`` named it), answer MLC's metrics query at once,
    or tokenize each of ``prompts``' engine requests (each traced on its lane) and run them as one
    reply, shaped by ``shaper_type``; under a router, relay instead."""
    if registry.router is not None:
        return await routed_generation(registry.router, request)
    body = validate_body(json_body(request), schema)
    engine = lookup_engine(body.model)
    client_id = client_request_id(request)
    request_id = new_request_id(engine, body.user, prefix, client_id)
    use_request_id(request, request_id)
    shaper = shaper_type(request_id, engine, body)
    if is_metrics_query(body):
        return reply_response(await metrics_events(engine, shaper))
    arrival = arrival_of(request)
    generations = []
    for prompt in prompts(engine, body, request_id, shaper):
        _trace(engine, prompt.request_id, "receive request", at=arrival)
        _trace(engine, prompt.request_id, "start tokenization")
        ids, system_tokens = prompt.tokenize()
        _trace(engine, prompt.request_id, "finish tokenization", {"prompt_tokens": len(ids)})
        generation = make_generation_request(prompt.request_id, ids, body, arrival, client_id)
        generation.system_prompt_tokens = system_tokens
        generations.append(generation)
        if prompt.tokenized is not None:
            prompt.tokenized(ids)
    # One span for the reply, named by its first engine request (a completion list's usage is summed).
    span = otel.begin(request, body, generations[0], engine.name)  # None unless spans are exported
    return reply_response(await generate(engine, body, generations, shaper, span))


def _completion_prompts(engine: AsyncEngine, body: CompletionRequest, request_id: str,
                        shaper: CompletionShaper) -> list[_Prompt]:
    """One engine request per prompt of a list (each its own trace lane); the reply is one."""
    request_ids = prompt_request_ids(engine, request_id, len(body.prompts))
    return [_Prompt(rid, functools.partial(_prompt_ids, engine, prompt),
                    tokenized=functools.partial(shaper.add_prompt, rid, prompt))
            for rid, prompt in zip(request_ids, body.prompts, strict=True)]


def _prompt_ids(engine: AsyncEngine, prompt: str | list[int]) -> Tokenized:
    """A completion's prompt as token ids (no system prompt to pin)."""
    return prompt_ids(engine.tokenizer, prompt), None


def _chat_prompt(engine: AsyncEngine, body: ChatCompletionRequest, request_id: str,
                 shaper: ChatShaper) -> list[_Prompt]:
    """The messages, rendered with the chat template: one engine request."""
    return [_Prompt(request_id, functools.partial(tokenize_chat, engine.tokenizer, body))]


def _trace(engine: AsyncEngine, request_id: str, event: str, args: dict[str, Any] | None = None,
           at: float | None = None) -> None:
    """Record a server-side event on the request's lane (MLC's Python-side events), now or ``at``
    (``perf_counter`` seconds)."""
    engine.record_server_event(request_id, event, args, at_ns=None if at is None else round(at * 1e9))


# ------------------------------------------------------------------- under a disagg router


async def routed_generation(router: DisaggRouter, request: HttpRequest) -> HttpResponseBase:
    """A completion or chat request through the router; upstream errors come back as they were."""
    payload = json_body(request)

    async def route(request_id: str) -> RoutedReply:
        with registry.response_in_flight():
            return await router.route(payload, arrival_of(request), request_id, otel.trace_context(request))

    return await routed_response(request, route)


async def routed_models(router: DisaggRouter, request: HttpRequest, model: str | None = None) -> HttpResponseBase:
    """The decode servers' models, or the one named ``model`` (their 404 for another)."""
    return await routed_response(request, lambda request_id: (
        router.models(request_id) if model is None else router.model(model, request_id)))
