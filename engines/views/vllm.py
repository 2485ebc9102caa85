"""vLLM's utility routes, in vLLM's shapes (``engines.protocol.vllm``): ``POST /tokenize``,
``POST /detokenize``, ``GET /version``. They need the API key, as ``/v1`` does (vLLM's guard only
``/v1``; ours guards every route but ``/health``).

``model`` names the engine whose tokenizer answers; left out, the first engine (vLLM serves one).
Under a disaggregating router (``serve --router disagg``) ``/tokenize`` and ``/detokenize`` are a
decode server's answer relayed (``DisaggRouter.tokenizer_call``), its errors as they came.
Statuses: 400 for a body that fails validation, a chat template that fails or an id outside the
vocabulary; 404 for an unknown model.
"""
from __future__ import annotations

from typing import Any, TypeVar

from django.http import HttpRequest, HttpResponseBase
from pydantic import BaseModel, ValidationError

import engines
from engines.disagg.router import DisaggRouter
from engines.protocol import ProtocolError
from engines.protocol.vllm import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeResponse,
    VersionResponse,
    tokenize_request_model,
)
from engines.registry import registry
from engines.runtime import AsyncEngine, ChatTemplateError
from engines.serving.request_mapping import lookup_engine
from engines.views.api import api_view, json_body, json_response, routed_response

Body = TypeVar("Body", bound=BaseModel)


def _validated(data: dict[str, Any], schema: type[Body]) -> Body:
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise ProtocolError.from_validation_error(exc, status=400) from None


def _engine(model: str | None) -> AsyncEngine:
    """The engine named ``model`` (404 for another), or the first one."""
    if model is not None:
        return lookup_engine(model)
    engine = registry.first()
    if engine is None:
        raise ProtocolError(404, "This server serves no model.", param="model")
    return engine


@api_view("POST")
async def tokenize(request: HttpRequest) -> HttpResponseBase:
    """A prompt's token ids, or a chat's as the chat route would prompt the model with them."""
    data = json_body(request)
    if registry.router is not None:
        return await _routed(registry.router, request, "/tokenize", data)
    body = _validated(data, tokenize_request_model(data))
    engine = _engine(body.model)
    tokenizer = engine.tokenizer
    if isinstance(body, TokenizeChatRequest):
        try:
            text = tokenizer.apply_chat_template(body.template_messages(),
                                                 add_generation_prompt=body.add_generation_prompt)
        except ChatTemplateError as exc:
            raise ProtocolError(400, str(exc), param="messages") from None
    else:
        text = body.prompt
    ids = tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
    strs = [tokenizer.id_to_token(t) or "" for t in ids] if body.return_token_strs else None
    reply = TokenizeResponse(count=len(ids), max_model_len=engine.max_seq_len, tokens=ids, token_strs=strs)
    return json_response(reply.model_dump())


@api_view("POST")
async def detokenize(request: HttpRequest) -> HttpResponseBase:
    """Token ids back to text, special tokens kept (so ``/tokenize``'s BOS comes back)."""
    data = json_body(request)
    if registry.router is not None:
        return await _routed(registry.router, request, "/detokenize", data)
    body = _validated(data, DetokenizeRequest)
    tokenizer = _engine(body.model).tokenizer
    outside = next((t for t in body.tokens if t >= tokenizer.vocab_size), None)
    if outside is not None:
        raise ProtocolError(400, f"token id {outside} is outside the vocabulary (size {tokenizer.vocab_size})",
                            param="tokens")
    return json_response(DetokenizeResponse(prompt=tokenizer.decode(body.tokens, skip_special_tokens=False))
                         .model_dump())


async def _routed(router: DisaggRouter, request: HttpRequest, path: str, data: dict[str, Any]) -> HttpResponseBase:
    """``path`` relayed to the router's decode server (the router has no tokenizer of its own)."""
    return await routed_response(request, lambda request_id: router.tokenizer_call(path, data, request_id))


@api_view("GET")
async def version(request: HttpRequest) -> HttpResponseBase:
    """``{"version": ...}``: this server's version."""
    return json_response(VersionResponse(version=engines.__version__).model_dump())
