"""Running a request on its engine and gathering the reply: the whole reply once it ended, or
its server-sent events as they come (``data: {...}`` ... ``data: [DONE]``).

Streaming semantics are decided here. A client that goes away mid-request (Django cancels the
view or the stream) aborts the request in its engine, freeing its KV pages; the first output is
awaited before any reply is made, so a request the engine refuses still gets a proper 400
instead of a broken stream; an engine that dies mid-stream is reported in-band.
"""
from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import orjson
from pydantic import BaseModel

from engines.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse, ProtocolError, Usage
from engines.registry import registry
from engines.runtime import AsyncEngine, EngineDeadError, EngineRequestError, GenerationRequest, RequestOutput
from engines.serving.shapers import ResponseShaper

if TYPE_CHECKING:
    from engines.otel.export import RequestSpan

__all__ = ["SSE_DONE", "Reply", "collect", "generate", "metrics_events", "sse_events", "summed_usage", "together"]

SSE_DONE = b"data: [DONE]\n\n"

#: A generation's reply: one whole object, or the SSE events of a stream.
Reply = BaseModel | AsyncIterator[bytes]


async def generate(
    engine: AsyncEngine,
    body: ChatCompletionRequest | CompletionRequest,
    generation: GenerationRequest | list[GenerationRequest],
    shaper: ResponseShaper,
    span: RequestSpan | None = None,
) -> Reply:
    """Start the request (or the requests of a completion's several prompts, as one: see
    :func:`together`); the SSE events of its stream, or its whole reply once it ended.
    ``span`` (``engines.otel.begin``: None unless spans are exported) sees every output.

    The first output is awaited before any reply is made, so a request the
    engine refuses still gets a proper 400 instead of a broken stream.

    A client that leaves meanwhile needs nothing here: Django cancels the view while it
    awaits ``outputs``, so the cancellation lands inside ``AsyncEngine.generate``, whose
    ``finally`` aborts the request (once) and frees its KV pages.
    """
    generations = generation if isinstance(generation, list) else [generation]
    shaper.prompt_tokens = sum(len(g.prompt) for g in generations)  # continuous usage: every prompt's
    # Counted for a draining shutdown; a stream counts again while its body is written.
    with registry.response_in_flight():
        outputs = engine.generate(generations[0]) if len(generations) == 1 else together(engine, generations)
        if span is not None:
            outputs = span.watch(outputs)
        try:
            first = await anext(outputs)
        except EngineRequestError as exc:
            raise ProtocolError(400, str(exc)) from None
        if not body.stream:
            return await collect(outputs, first, shaper)
    return sse_events(outputs, first, shaper, body.include_usage)


async def together(engine: AsyncEngine, generations: list[GenerationRequest]) -> AsyncIterator[RequestOutput]:
    """Several requests' outputs as one stream, each request's in its order: nothing before
    every request has its first output (a refusal of any is then the whole reply's 400, as
    for one request), their last outputs without usage, then one more output, of no choice,
    with the usage summed (``summed_usage``). Closing it, an error, or a client that leaves
    aborts the requests still running."""
    queue: asyncio.Queue[RequestOutput | Exception | None] = asyncio.Queue()

    async def pump(generation: GenerationRequest) -> None:
        # Cancelled (below), its AsyncEngine.generate aborts the request.
        try:
            async for output in engine.generate(generation):
                queue.put_nowait(output)
        except Exception as exc:  # noqa: BLE001 - the merged stream raises it
            queue.put_nowait(exc)
        else:
            queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(g)) for g in generations]
    try:
        started: set[str] = set()
        held: list[RequestOutput] | None = []
        usages: list[dict[str, Any]] = []
        running = len(tasks)
        while running:
            item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is None:
                running -= 1
                continue
            if item.usage is not None:
                usages.append(item.usage)
                item = dataclasses.replace(item, usage=None)
            if held is not None:  # not every request has had its first output yet
                held.append(item)
                started.add(item.request_id)
                if len(started) == len(tasks):
                    for output in held:
                        yield output
                    held = None
                continue
            yield item
        yield RequestOutput(generations[0].request_id, [], summed_usage(usages))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def summed_usage(usages: list[dict[str, Any]]) -> dict[str, Any]:
    """The usage of several requests: their token counts summed (nested counts too, such as
    ``prompt_tokens_details``). ``extra`` is one request's metrics and is left out."""
    total: dict[str, Any] = {}
    for usage in usages:
        for key, value in usage.items():
            if isinstance(value, bool) or key == "extra":
                continue
            if isinstance(value, (int, float)):
                total[key] = total.get(key, 0) + value
            elif isinstance(value, dict):
                total[key] = summed_usage([total.get(key, {}), value])
    return total


async def sse_events(
    outputs: AsyncIterator[RequestOutput],
    first: RequestOutput,
    shaper: ResponseShaper,
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


async def collect(outputs: AsyncIterator[RequestOutput], first: RequestOutput, shaper: ResponseShaper) -> BaseModel:
    """Gather every output of a non-streaming request into its one reply."""
    shaper.absorb(first)
    if not first.finished:
        async for output in outputs:
            shaper.absorb(output)
    return shaper.response()


async def metrics_events(engine: AsyncEngine, shaper: ResponseShaper) -> AsyncIterator[bytes]:
    """MLC's ``query_engine_metrics``: one usage chunk (zero tokens, ``extra`` = engine metrics), then ``[DONE]``.

    Never queued and never traced (MLC traces these and litters the trace with
    ``chatcmpl-`` lanes; we don't).
    """
    usage = Usage(extra=await engine.metrics())
    return _aiter([_sse(shaper.usage_chunk(usage)), SSE_DONE])


async def _aiter(items: list[bytes]) -> AsyncIterator[bytes]:
    # Django consumes a sync iterator on a worker thread (with a warning); this stays on the loop.
    for item in items:
        yield item
