"""The OpenAI-compatible API: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``.

Each view validates the body with the protocol's pydantic models, finds the
engine in the registry, tokenizes, and hands a :class:`GenerationRequest` to
``AsyncEngine.generate``; what comes back is shaped into OpenAI's objects, as
one JSON reply or as server-sent events (``data: {...}`` ... ``data: [DONE]``).

MLC's debug extension rides along: ``debug_config`` is honoured (and
``usage.extra`` returned) only when the server runs with ``--enable-debug``, and
the ``query_engine_metrics`` special request is answered at once from the engine's
metrics without generating. A client that goes away mid-request (Django cancels
the view or the stream) aborts the request in its engine, freeing its KV pages.

Statuses: 400 for a body that is not JSON, fails validation or that the engine
refuses; 422 for MLC's two special-request rules (MLC's status for them);
404 for an unknown model; 503 when the engine has died.
"""
from __future__ import annotations

import logging
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import orjson
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from pydantic import BaseModel, ValidationError

from engines.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    ProtocolError,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from engines.protocol.json_body import JSONTooDeepError, loads_bounded
from engines.registry import registry
from engines.runtime import (
    AsyncEngine,
    ChatTemplateError,
    ChoiceDelta,
    EngineDeadError,
    EngineRequestError,
    GenerationRequest,
    GrammarMode,
    InvalidSamplingParams,
    RequestOutput,
    SamplingParams,
    Tokenizer,
    TokenLogprob as EngineTokenLogprob,
)
from engines.views.errors import api_view, json_response
from engines.views.router import routed_generation, routed_models

logger = logging.getLogger(__name__)

RequestT = TypeVar("RequestT", ChatCompletionRequest, CompletionRequest)

SSE_DONE = b"data: [DONE]\n\n"
# MLC's two rules that it reports with 422 (pydantic validators in MLC, too).
_SPECIAL_REQUEST_RULE = "DebugConfig.special_request requires"


# ------------------------------------------------------------------------------------ views


@api_view("GET")
async def list_models(request: HttpRequest) -> HttpResponse:
    """The served models, in the order the engines were added (a router's: its decode servers')."""
    if registry.router is not None:
        return await routed_models(registry.router)
    cards = [ModelCard(id=name, created=registry.created(name)) for name in registry.model_names()]
    return json_response(ModelList(data=cards).model_dump())


@api_view("POST")
async def completions(request: HttpRequest) -> HttpResponse:
    """``/v1/completions``: a text (or token-id) prompt continued."""
    if registry.router is not None:
        return await routed_generation(registry.router, request)
    body = parse_body(request, CompletionRequest)
    engine = lookup_engine(body.model)
    request_id = new_request_id(engine, body.user, "cmpl")
    shaper = CompletionShaper(request_id, engine, body)
    if is_metrics_query(body):
        return await metrics_reply(engine, shaper)
    _trace(engine, request_id, "receive request")
    _trace(engine, request_id, "start tokenization")
    prompt = body.prompt if isinstance(body.prompt, list) else engine.tokenizer.encode(body.prompt)
    _trace(engine, request_id, "finish tokenization", {"prompt_tokens": len(prompt)})
    return await generate_reply(engine, body, make_generation_request(request_id, prompt, body), shaper)


@api_view("POST")
async def chat_completions(request: HttpRequest) -> HttpResponse:
    """``/v1/chat/completions``: messages rendered with the checkpoint's chat template, then continued."""
    if registry.router is not None:
        return await routed_generation(registry.router, request)
    body = parse_body(request, ChatCompletionRequest)
    engine = lookup_engine(body.model)
    request_id = new_request_id(engine, body.user, "chatcmpl")
    shaper = ChatShaper(request_id, engine, body)
    if is_metrics_query(body):
        return await metrics_reply(engine, shaper)
    _trace(engine, request_id, "receive request")
    _trace(engine, request_id, "start tokenization")
    prompt, system_tokens = tokenize_chat(engine.tokenizer, body)
    _trace(engine, request_id, "finish tokenization", {"prompt_tokens": len(prompt)})
    generation = make_generation_request(request_id, prompt, body)
    generation.system_prompt_tokens = system_tokens
    return await generate_reply(engine, body, generation, shaper)


# --------------------------------------------------------------------------- parse, look up


def new_request_id(engine: AsyncEngine, user: str | None, prefix: str) -> str:
    """MLC's request id: ``user`` if given, else ``prefix-<uuid4 hex>``.

    OpenAI clients often send one ``user`` (an end-user id) on concurrent requests; MLC then
    refuses the second. Here a ``user`` already streaming gets a unique suffix instead, so its
    trace lanes stay apart and both requests run.
    """
    if user and not engine.is_streaming(user):
        return user
    return f"{user or prefix}-{uuid.uuid4().hex}"


def parse_body(request: HttpRequest, model: type[RequestT]) -> RequestT:
    """Validate the JSON body; drop ``debug_config`` (with a warning) unless debug is enabled."""
    try:
        data = loads_bounded(request.body)
    except JSONTooDeepError as exc:
        raise ProtocolError(400, f"the request body is too deep: {exc}") from None
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ProtocolError(400, "the request body must be a JSON object")
    try:
        body = model.model_validate(data)
    except ValidationError as exc:
        special = any(e["msg"].startswith(_SPECIAL_REQUEST_RULE) for e in exc.errors(include_url=False))
        raise ProtocolError.from_validation_error(exc, status=422 if special else 400) from None
    if body.debug_config is not None and not registry.options.enable_debug:
        # MLC drops it silently; a warning tells the operator why a benchmark's ignore_eos did nothing.
        logger.warning("debug_config in a %s request ignored: the server runs without --enable-debug", request.path)
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
    request_id: str, prompt: list[int], body: ChatCompletionRequest | CompletionRequest
) -> GenerationRequest:
    """Map the OpenAI parameters, and MLC's ``debug_config`` options, onto the engine's fields
    (the pydantic ``DebugConfig`` never crosses into the runtime).

    ``SamplingParams`` is where the sampling ranges are checked (``REQUEST_LIMITS``): a value
    out of range is a 400 naming the parameter the client sent.
    """
    if isinstance(body, ChatCompletionRequest):
        logprobs, top_logprobs = body.logprobs, body.top_logprobs or 0
    else:
        logprobs, top_logprobs = body.logprobs is not None, body.logprobs or 0
    debug = body.debug_config  # None unless the server runs with --enable-debug (parse_body)
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
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            n=body.n,
            ignore_eos=debug is not None and debug.ignore_eos,
        )
    except InvalidSamplingParams as exc:
        param = exc.field
        # Chat's max_completion_tokens (OpenAI's newer name) reaches the engine as max_tokens.
        if param == "max_tokens" and getattr(body, "max_completion_tokens", None) is not None:
            param = "max_completion_tokens"
        raise ProtocolError(400, f"{param} {exc.reason}", param=param) from None
    return GenerationRequest(
        request_id=request_id,
        prompt=prompt,
        sampling=sampling,
        response_format=body.response_format.as_openai_dict() if body.response_format else None,
        pin_system_prompt=debug is not None and debug.pinned_system_prompt,
        grammar_mode=GrammarMode(debug.grammar_execution_mode) if debug is not None else GrammarMode.JUMP_FORWARD,
    )


def is_metrics_query(body: ChatCompletionRequest | CompletionRequest) -> bool:
    """MLC's ``query_engine_metrics`` special request (only seen when debug is on: see parse_body)."""
    return body.debug_config is not None and body.debug_config.special_request == "query_engine_metrics"


def _trace(engine: AsyncEngine, request_id: str, event: str, args: dict[str, Any] | None = None) -> None:
    """Record a server-side event on the request's lane (MLC's Python-side events)."""
    engine.record_server_event(request_id, event, args)


# ----------------------------------------------------------------------------- generation


async def generate_reply(
    engine: AsyncEngine,
    body: ChatCompletionRequest | CompletionRequest,
    generation: GenerationRequest,
    shaper: "ResponseShaper",
) -> HttpResponse:
    """Start the request; stream it, or wait for its end and answer once.

    The first output is awaited before any reply is made, so a request the
    engine refuses still gets a proper 400 instead of a broken stream.

    A client that leaves meanwhile needs nothing here: Django cancels the view while it
    awaits ``outputs``, so the cancellation lands inside ``AsyncEngine.generate``, whose
    ``finally`` aborts the request (once) and frees its KV pages.
    """
    # Counted for a draining shutdown; a stream counts again while its body is written.
    with registry.response_in_flight():
        outputs = engine.generate(generation)
        try:
            first = await anext(outputs)
        except EngineRequestError as exc:
            raise ProtocolError(400, str(exc)) from None
        if not body.stream:
            return json_response((await collect(outputs, first, shaper)).model_dump())
    return StreamingHttpResponse(
        sse_events(outputs, first, shaper, body.include_usage),
        content_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def sse_events(
    outputs: AsyncIterator[RequestOutput],
    first: RequestOutput,
    shaper: "ResponseShaper",
    include_usage: bool,
) -> AsyncIterator[bytes]:
    """The SSE body: one chunk per engine output, the usage chunk if asked, then ``[DONE]``.

    When the client disconnects Django cancels this generator at its current ``await``
    (or closes it at a ``yield``); ``finally`` then closes the engine's stream, whose own
    ``finally`` aborts the request so its KV pages are freed at once.
    """
    # Counted while it is written, so a draining shutdown waits for its [DONE].
    with registry.response_in_flight():
        finished = False
        try:
            output: RequestOutput | None = first
            while output is not None:
                chunk = shaper.chunk(output)
                if chunk is not None:
                    yield _sse(chunk)
                if output.finished:
                    break
                output = await anext(outputs, None)
            finished = True
            if include_usage:
                yield _sse(shaper.usage_chunk())
            yield SSE_DONE
        except EngineDeadError as exc:
            # Headers are gone already: report in-band, as OpenAI's streams do.
            finished = True
            yield b"data: " + orjson.dumps(ErrorResponse.from_status(503, str(exc)).stream_event()) + b"\n\n"
            yield SSE_DONE
        finally:
            if not finished:
                # Cancelled inside ``anext(outputs)``, the stream has closed itself and this is a no-op;
                # closed at our ``yield``, the stream waits at its own and must be closed to abort.
                await outputs.aclose()  # type: ignore[attr-defined]


def _sse(model: BaseModel) -> bytes:
    """One SSE event; the serializer writes JSON bytes directly (no str round trip per token)."""
    return b"data: " + model.__pydantic_serializer__.to_json(model) + b"\n\n"


async def collect(
    outputs: AsyncIterator[RequestOutput], first: RequestOutput, shaper: "ResponseShaper"
) -> BaseModel:
    """Gather every output of a non-streaming request into its one reply."""
    shaper.absorb(first)
    if not first.finished:
        async for output in outputs:
            shaper.absorb(output)
    return shaper.response()


async def metrics_reply(engine: AsyncEngine, shaper: "ResponseShaper") -> HttpResponse:
    """MLC's ``query_engine_metrics``: one usage chunk (zero tokens, ``extra`` = engine metrics), then ``[DONE]``.

    Never queued and never traced (MLC traces these and litters the trace with
    ``chatcmpl-`` lanes; we don't).
    """
    usage = Usage(extra=await engine.metrics())
    return StreamingHttpResponse(
        _aiter([_sse(shaper.usage_chunk(usage)), SSE_DONE]),
        content_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
    )


async def _aiter(items: list[bytes]) -> AsyncIterator[bytes]:
    # Django consumes a sync iterator on a worker thread (with a warning); this stays on the loop.
    for item in items:
        yield item


# ------------------------------------------------------------------------------- shaping


class ResponseShaper(ABC):
    """Turns one request's engine outputs into OpenAI objects (chunks, or one final response).

    Keeps what a reply needs across outputs: per-choice text and logprobs for the
    non-streaming reply, which choices already sent their role, the final usage.
    """

    def __init__(self, request_id: str, engine: AsyncEngine, body: ChatCompletionRequest | CompletionRequest) -> None:
        self.request_id = request_id
        self.model = engine.name
        self.tokenizer = engine.tokenizer
        self.created = int(time.time())
        # Chat asks with logprobs=true; completions with logprobs=0..5 (0: the chosen token only).
        self.want_logprobs = body.logprobs is not None and body.logprobs is not False
        self.usage: Usage | None = None
        self._texts: dict[int, list[str]] = {}
        self._logprobs: dict[int, list[EngineTokenLogprob]] = {}
        self._finish: dict[int, str | None] = {}

    # -- shared

    def _record_usage(self, output: RequestOutput) -> None:
        if output.usage is not None:
            usage = dict(output.usage)
            if not registry.options.enable_debug:
                usage.pop("extra", None)  # request metrics are a debug feature, as in MLC
            self.usage = Usage(**usage)

    def absorb(self, output: RequestOutput) -> None:
        """Accumulate an output for the non-streaming reply."""
        for delta in output.choices:
            self._texts.setdefault(delta.index, []).append(delta.text)
            if delta.logprobs:
                self._logprobs.setdefault(delta.index, []).extend(delta.logprobs)
            if delta.finish_reason is not None or delta.index not in self._finish:
                self._finish[delta.index] = delta.finish_reason
        self._record_usage(output)

    def token_text(self, token_id: int) -> str:
        """A token's text for logprobs; OpenAI's ``bytes:\\xNN`` form for a partial UTF-8 character."""
        raw = self.tokenizer.token_bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def _skip(self, delta: ChoiceDelta) -> bool:
        # Text held back (a possible stop string, half a UTF-8 character) leaves an empty delta;
        # sending it would only cost the client a parse (MLC: "skip empty delta text").
        return not delta.text and delta.finish_reason is None and not delta.logprobs

    @abstractmethod
    def chunk(self, output: RequestOutput) -> BaseModel | None:
        """The stream chunk for one output, or None when it carries nothing to send."""

    @abstractmethod
    def usage_chunk(self, usage: Usage | None = None) -> BaseModel:
        """The closing chunk with ``choices: []`` and the usage (the request's, unless given)."""

    @abstractmethod
    def response(self) -> BaseModel:
        """The whole non-streaming reply, from everything :meth:`absorb` saw."""


class ChatShaper(ResponseShaper):
    """``chat.completion`` and ``chat.completion.chunk`` objects."""

    def __init__(self, request_id: str, engine: AsyncEngine, body: ChatCompletionRequest) -> None:
        super().__init__(request_id, engine, body)
        self._role_sent: set[int] = set()

    def _logprobs_of(self, items: list[EngineTokenLogprob] | None) -> ChatLogprobs | None:
        if not self.want_logprobs:
            return None
        content = []
        for item in items or ():
            top = [
                TopLogprob(token=self.token_text(tid), logprob=lp, bytes=list(self.tokenizer.token_bytes(tid)))
                for tid, lp in item.top_logprobs
            ]
            content.append(
                TokenLogprob(
                    token=self.token_text(item.token_id),
                    logprob=item.logprob,
                    bytes=list(self.tokenizer.token_bytes(item.token_id)),
                    top_logprobs=top,
                )
            )
        return ChatLogprobs(content=content)

    def chunk(self, output: RequestOutput) -> ChatCompletionChunk | None:
        self._record_usage(output)
        choices = []
        for delta in output.choices:
            if self._skip(delta):
                continue
            role = None
            if delta.index not in self._role_sent:
                self._role_sent.add(delta.index)
                role = "assistant"
            choices.append(
                ChatStreamChoice(
                    index=delta.index,
                    delta=ChatDelta(role=role, content=delta.text or ("" if role else None)),
                    logprobs=self._logprobs_of(delta.logprobs),
                    finish_reason=delta.finish_reason,
                )
            )
        if not choices:
            return None
        return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model, choices=choices)

    def usage_chunk(self, usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.request_id, created=self.created, model=self.model, choices=[], usage=usage or self.usage or Usage()
        )

    def response(self) -> ChatCompletionResponse:
        choices = [
            ChatChoice(
                index=index,
                message=ChatResponseMessage(content="".join(self._texts[index])),
                logprobs=self._logprobs_of(self._logprobs.get(index)),
                finish_reason=self._finish.get(index),
            )
            for index in sorted(self._texts)
        ]
        return ChatCompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=self.usage
        )


class CompletionShaper(ResponseShaper):
    """``text_completion`` objects, streamed or whole."""

    def __init__(self, request_id: str, engine: AsyncEngine, body: CompletionRequest) -> None:
        super().__init__(request_id, engine, body)
        # Logprob text offsets continue across chunks: each choice's text length so far.
        self._offsets: dict[int, int] = {}

    def _logprobs_of(self, items: list[EngineTokenLogprob] | None, offset: int) -> CompletionLogprobs | None:
        if not self.want_logprobs:
            return None
        out = CompletionLogprobs()
        for item in items or ():
            text = self.token_text(item.token_id)
            out.tokens.append(text)
            out.token_logprobs.append(item.logprob)
            out.top_logprobs.append({self.token_text(tid): lp for tid, lp in item.top_logprobs})
            out.text_offset.append(offset)
            offset += len(text)
        return out

    def chunk(self, output: RequestOutput) -> CompletionResponse | None:
        self._record_usage(output)
        choices = []
        for delta in output.choices:
            if self._skip(delta):
                continue
            offset = self._offsets.get(delta.index, 0)
            choices.append(
                CompletionChoice(
                    index=delta.index,
                    text=delta.text,
                    logprobs=self._logprobs_of(delta.logprobs, offset),
                    finish_reason=delta.finish_reason,
                )
            )
            self._offsets[delta.index] = offset + len(delta.text)
        if not choices:
            return None
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=choices)

    def usage_chunk(self, usage: Usage | None = None) -> CompletionResponse:
        return CompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=[], usage=usage or self.usage or Usage()
        )

    def response(self) -> CompletionResponse:
        choices = [
            CompletionChoice(
                index=index,
                text="".join(self._texts[index]),
                logprobs=self._logprobs_of(self._logprobs.get(index), 0),
                finish_reason=self._finish.get(index),
            )
            for index in sorted(self._texts)
        ]
        return CompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=self.usage
        )
