"""From an OpenAI request to the engine's: validate the body, find the engine, tokenize, and map
the parameters onto a :class:`GenerationRequest`. What every generating view calls
(``/v1/completions``, ``/v1/chat/completions``, ``/microserving/*``, the playground's).

MLC's debug extension rides along: ``debug_config`` is honoured only when the server runs with
``--enable-debug`` (:func:`validate_body` drops it otherwise), and its ``query_engine_metrics``
special request is recognised here (:func:`is_metrics_query`). Statuses: 400 for a body that
fails validation or a parameter the engine refuses; 422 for MLC's two special-request rules
(MLC's status for them); 404 for an unknown model; 503 while the server drains.
"""
from __future__ import annotations

import logging
import uuid
from typing import Any, TypeVar

from pydantic import ValidationError

from engines.protocol import ChatCompletionRequest, CompletionRequest, ProtocolError
from engines.protocol.openai import _GenerationRequest
from engines.registry import registry
from engines.runtime import (
    AsyncEngine,
    ChatTemplateError,
    GenerationRequest,
    GrammarMode,
    InvalidSamplingParams,
    SamplingParams,
    Tokenizer,
)

logger = logging.getLogger(__name__)

__all__ = ["is_metrics_query", "lookup_engine", "make_generation_request", "new_request_id", "prompt_ids",
           "prompt_request_ids", "tokenize_chat", "validate_body"]

# Bound to the requests' common base, not to the union of the two: only then does a type checker
# see that ``model_validate`` on a ``type[RequestT]`` returns a ``RequestT``.
RequestT = TypeVar("RequestT", bound=_GenerationRequest)

# MLC's two rules that it reports with 422 (pydantic validators in MLC, too).
_SPECIAL_REQUEST_RULE = "DebugConfig.special_request requires"


def new_request_id(engine: AsyncEngine, user: str | None, prefix: str, client_id: str | None = None) -> str:
    """MLC's request id: ``user`` if given, else the client's ``X-Request-Id`` (``client_id``,
    ``engines.request_ids``), else ``prefix-<uuid4 hex>``.

    OpenAI clients often send one ``user`` (an end-user id) on concurrent requests; MLC then
    refuses the second. Here a name already streaming gets a unique suffix instead, so its
    trace lanes stay apart and both requests run.
    """
    name = user or client_id
    if name and not engine.is_streaming(name):
        return name
    return f"{name or prefix}-{uuid.uuid4().hex}"


def validate_body(data: dict[str, Any], model: type[RequestT]) -> RequestT:
    """A request body (``json_body``'s object) validated as ``model``; ``debug_config`` dropped
    (with a warning) unless the server runs with ``--enable-debug``."""
    try:
        body = model.model_validate(data)
    except ValidationError as exc:
        special = any(e["msg"].startswith(_SPECIAL_REQUEST_RULE) for e in exc.errors(include_url=False))
        raise ProtocolError.from_validation_error(exc, status=422 if special else 400) from None
    if body.debug_config is not None and not registry.options.enable_debug:
        # MLC drops it silently; a warning tells the operator why a benchmark's ignore_eos did nothing.
        logger.warning("debug_config in a %s ignored: the server runs without --enable-debug", model.__name__)
        body.debug_config = None
    return body


def lookup_engine(model: str | None) -> AsyncEngine:
    """The engine serving ``model``; 400 when no model is named, 404 when it is not served."""
    served = ", ".join(registry.model_names()) or "none"
    if model is None:
        raise ProtocolError(400, f"model is required: name one of the served models ({served})", param="model")
    engine = registry.get(model)
    if engine is None:
        raise ProtocolError(404, f'The requested model "{model}" is not served. Served models: {served}.', "model")
    if registry.draining:
        raise ProtocolError(503, "The server is shutting down and takes no new requests; send this one to "
                                 "another server, or again once it is back.")
    return engine


def prompt_ids(tokenizer: Tokenizer, prompt: str | list[int]) -> list[int]:
    """A completion's prompt (one of ``CompletionRequest.prompts``) as token ids: given as ids,
    or the text encoded."""
    return prompt if isinstance(prompt, list) else tokenizer.encode(prompt)


def prompt_request_ids(engine: AsyncEngine, request_id: str, count: int) -> list[str]:
    """The engine request ids of a completion's ``count`` prompts: ``request_id`` for one,
    ``<request_id>-<i>`` for each of several (with a uuid between when one of those is still
    streaming: the same ``user`` sent another list)."""
    if count == 1:
        return [request_id]
    ids = [f"{request_id}-{i}" for i in range(count)]
    if any(engine.is_streaming(rid) for rid in ids):
        ids = [f"{request_id}-{uuid.uuid4().hex}-{i}" for i in range(count)]
    return ids


def tokenize_chat(tokenizer: Tokenizer, body: ChatCompletionRequest) -> tuple[list[int], int | None]:
    """Prompt ids from the chat template, and how many of them are the system prompt (for pinning).

    The template text already holds any BOS token it wants, so it is encoded without
    adding special tokens (as transformers' ``apply_chat_template(tokenize=True)`` does).
    """
    messages = body.template_messages()
    try:
        prompt = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
        system_tokens = None
        if body.debug_config is not None and body.debug_config.pinned_system_prompt:
            system = [m for m in messages[:1] if m["role"] == "system"]
            if system:
                text = tokenizer.apply_chat_template(system, add_generation_prompt=False)
                ids = tokenizer.encode(text, add_special_tokens=False)
                # Pin only what really is a prefix of the prompt (a template may render differently alone).
                system_tokens = len(ids) if prompt[: len(ids)] == ids else None
    except ChatTemplateError as exc:
        raise ProtocolError(400, str(exc), param="messages") from None
    return prompt, system_tokens


def make_generation_request(
    request_id: str, prompt: list[int], body: ChatCompletionRequest | CompletionRequest, arrival_time: float,
    client_request_id: str | None = None,
) -> GenerationRequest:
    """Map the OpenAI parameters, and MLC's ``debug_config`` options, onto the engine's fields
    (the pydantic ``DebugConfig`` never crosses into the runtime). ``arrival_time``: when the HTTP
    request arrived (``engines.request_arrival.arrival_of``). The client's ids go along for the
    live table: ``user`` from the body, ``client_request_id`` the client's ``X-Request-Id`` as the
    view read it (``engines.request_ids``; behind a router, the router's client's).

    ``SamplingParams`` is where the sampling ranges are checked (``REQUEST_LIMITS``): a value
    out of range is a 400 naming the parameter the client sent.
    """
    prompt_logprobs = None
    if isinstance(body, ChatCompletionRequest):
        logprobs, top_logprobs = body.logprobs, body.top_logprobs or 0
    else:
        logprobs, top_logprobs = body.logprobs is not None, body.logprobs or 0
        if body.echo:
            prompt_logprobs = body.logprobs  # echo with logprobs: the prompt's tokens' too
    if body.max_tokens == 0 and not (isinstance(body, CompletionRequest) and body.echo):
        # The engine takes 0 (the prompt only); without echo the reply would hold nothing (vLLM refuses it too).
        name = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) is not None else "max_tokens"
        hint = "" if isinstance(body, ChatCompletionRequest) else \
            " (0, no completion, goes with echo: the prompt and, with logprobs, its logprobs)"
        raise ProtocolError(400, f"{name} must be a positive integer, got 0{hint}", param=name)
    debug = body.debug_config  # None unless the server runs with --enable-debug (validate_body)
    try:
        # "is None", not "or": a 0 the client sent must reach the range check, not become the default.
        sampling = SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=-1 if body.top_k is None else body.top_k,
            seed=body.seed,
            frequency_penalty=0.0 if body.frequency_penalty is None else body.frequency_penalty,
            presence_penalty=0.0 if body.presence_penalty is None else body.presence_penalty,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            logit_bias=body.logit_bias,
            stop=tuple(body.stop or ()),
            max_tokens=body.max_tokens,
            min_tokens=body.min_tokens,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            n=body.n,
            # vLLM's top-level field or MLC's debug one: asking either way is asking.
            ignore_eos=body.ignore_eos or (debug is not None and debug.ignore_eos),
            prompt_logprobs=prompt_logprobs,
        )
    except InvalidSamplingParams as exc:
        param, reason = exc.field, exc.reason
        # Chat's max_completion_tokens (OpenAI's newer name) reaches the engine as max_tokens.
        if getattr(body, "max_completion_tokens", None) is not None:
            param = "max_completion_tokens" if param == "max_tokens" else param
            reason = reason.replace("max_tokens", "max_completion_tokens")
        raise ProtocolError(400, f"{param} {reason}", param=param) from None
    return GenerationRequest(
        request_id=request_id,
        prompt=prompt,
        sampling=sampling,
        response_format=body.response_format.as_openai_dict() if body.response_format else None,
        pin_system_prompt=debug is not None and debug.pinned_system_prompt,
        grammar_mode=GrammarMode(debug.grammar_execution_mode) if debug is not None else GrammarMode.JUMP_FORWARD,
        arrival_time=arrival_time,
        user=body.user,
        client_request_id=client_request_id,
    )


def is_metrics_query(body: ChatCompletionRequest | CompletionRequest) -> bool:
    """MLC's ``query_engine_metrics`` special request (only seen when debug is on: see validate_body)."""
    return body.debug_config is not None and body.debug_config.special_request == "query_engine_metrics"


