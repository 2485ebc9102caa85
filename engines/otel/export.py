"""The spans of generation requests, built with the OpenTelemetry SDK and exported by its OTLP/HTTP
exporter through a ``BatchSpanProcessor`` (loaded only when an endpoint is configured: ``engines.otel``).

A request's spans are built when it ends, from the engine's own stamps (``RequestOutput.times``,
what ``usage.extra``'s figures are differences of: docs/metrics.md), so their durations are the
engine's figures, and placed on the Unix epoch with the trace recorder's anchor, so they line up
with the Chrome trace to the nanosecond::

    chat smollm2 (SERVER)    arrival -> finish; the GenAI attributes, vLLM's gen_ai.latency.* figures
      queue                  arrival -> first scheduled (queue_time_s)
        preprocess           arrival -> the engine took it: API key, parsing, tokenizing, the step in flight
      prefill                first scheduled -> first token ("first token" is an event of the request span)
      decode                 first token -> finish

The request span is the child of the client's span when the request carries a W3C ``traceparent``
(and ``tracestate``), through the SDK's propagator (``OTEL_PROPAGATORS``; W3C trace context by
default); the sampler is the SDK's (``OTEL_TRACES_SAMPLER``; by default it follows the parent's
sampled flag). A request that fails, is aborted or whose client goes away has status ERROR and an
``error.type``. Behind a router of ours the spans stay on this server's time (they start at its
arrival); the ``gen_ai.latency.*`` figures count from the router's, as the metrics do.

An endpoint that fails never fails a request (spans are queued in memory and exported on the
processor's thread) and is told once: one warning with the first reason; the exporter's own log
lines (a line a retry) are held back.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind, Status, StatusCode

from engines.server import server_identity
from engines.protocol import ChatCompletionRequest, CompletionRequest
from engines.runtime import (
    EngineDeadError,
    EngineRequestError,
    FinishReason,
    GenerationRequest,
    RequestOutput,
    RequestTimes,
    epoch_anchor_ns,
)

__all__ = ["DEFAULT_SERVICE_NAME", "PROVIDER_NAME", "RequestSpan", "SpanExport"]

logger = logging.getLogger("engines.otel")

#: ``service.name`` unless ``OTEL_SERVICE_NAME`` (or ``OTEL_RESOURCE_ATTRIBUTES``) names another.
DEFAULT_SERVICE_NAME = "llm-debugsite"
#: ``gen_ai.provider.name`` (the current GenAI conventions' name for ``gen_ai.system``): this server.
PROVIDER_NAME = "llm-debugsite"
#: The instrumentation scope the spans are recorded under.
SCOPE = "engines.otel"
#: The exporter's logger: a line per failed attempt and retry, held back (told once, here).
EXPORTER_LOGGERS = ("opentelemetry.exporter.otlp.proto.http.trace_exporter", "opentelemetry.exporter.otlp.common.http")
#: The batch processor's logger: "Queue full, dropping span." while the endpoint is down.
PROCESSOR_LOGGER = "opentelemetry.sdk._shared_internal"


class SpanExport:
    """A tracer provider of its own (the process's global one is left alone) with one
    ``BatchSpanProcessor`` over the OTLP/HTTP exporter, and the resource that names this server."""

    def __init__(self, endpoint: str, service_name: str | None = None) -> None:
        self.endpoint = endpoint
        self.held = HeldExporterLogs()
        self.exporter = ReportingExporter(OTLPSpanExporter(endpoint=endpoint), endpoint, self.held)
        self.processor = BatchSpanProcessor(self.exporter)
        self.provider = TracerProvider(resource=server_resource(service_name))
        self.provider.add_span_processor(self.processor)
        self.tracer = self.provider.get_tracer(SCOPE)

    def begin(self, headers: Mapping[str, str], body: ChatCompletionRequest | CompletionRequest,
              generation: GenerationRequest, model: str) -> RequestSpan:
        return RequestSpan(self.tracer, propagate.extract(headers, context=Context()), body, generation, model)

    def force_flush(self) -> bool:
        return self.provider.force_flush()

    def shutdown(self) -> None:
        """Export what is queued and stop. An endpoint that is failing is not waited for: its
        retries are cut short and what is queued is dropped (the warning said it would be)."""
        if self.exporter.failing:
            self.exporter.close()
        self.provider.shutdown()
        self.held.release()


def server_resource(service_name: str | None) -> Resource:
    """``service.name``, ``service.instance.id`` (the server's id: ``host:port``) and ``host.name``,
    over what ``OTEL_RESOURCE_ATTRIBUTES`` and ``OTEL_SERVICE_NAME`` say."""
    from_env = Resource.create({})  # the SDK's defaults and the two variables
    name = service_name or str(from_env.attributes.get("service.name", ""))
    if not name or name.startswith("unknown_service"):
        name = DEFAULT_SERVICE_NAME
    server = server_identity.server_id()
    return Resource.create({"service.name": name, "service.instance.id": server,
                            "host.name": server_identity.host_of(server)})


class RequestSpan:
    """One generation request's spans: fed the engine's outputs (:meth:`watch`), built and ended
    when the last comes, or when the request fails or its client goes away."""

    def __init__(self, tracer: trace.Tracer, parent: Context, body: ChatCompletionRequest | CompletionRequest,
                 generation: GenerationRequest, model: str) -> None:
        self.tracer = tracer
        self.parent = parent
        self.operation = "chat" if isinstance(body, ChatCompletionRequest) else "text_completion"
        self.model = model
        # The server's stamp (set by the view); the engine's arrival may be earlier (a router's age).
        self.arrival = generation.arrival_time if generation.arrival_time is not None else time.perf_counter()
        self.attributes = request_attributes(self.operation, body, generation)
        self.finish_reasons: dict[int, str] = {}
        self.output_tokens = 0
        self.ended = False

    async def watch(self, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        """``outputs``, passed on as they come; the spans end with the last one, or with what
        stopped them: the engine refusing or dying, or the client leaving (the cancellation or
        the close that then reaches here, at an ``await`` or at a ``yield``)."""
        try:
            async for output in outputs:
                self.observe(output)
                yield output
        except BaseException as exc:
            self.fail(exc)
            raise
        finally:
            # Closing the engine's stream aborts its request (a no-op once the stream has ended).
            await outputs.aclose()  # type: ignore[attr-defined]

    def observe(self, output: RequestOutput) -> None:
        for choice in output.choices:
            self.output_tokens += len(choice.token_ids)
            if choice.finish_reason is not None:
                self.finish_reasons[choice.index] = str(choice.finish_reason)
        if output.usage is not None:
            self.end(output.usage, output.times)

    def fail(self, exc: BaseException) -> None:
        """End the spans for a request that stopped without its last output."""
        if self.ended:  # the last output came: what stops the stream now (its close) is not the request's
            return
        if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
            error, message = "cancelled", "the client went away: the request was aborted in its engine"
        elif isinstance(exc, EngineRequestError):
            error, message = type(exc).__name__, f"the engine refused the request: {exc}"
        elif isinstance(exc, EngineDeadError):
            error, message = type(exc).__name__, f"the engine died: {exc}"
        else:
            error, message = type(exc).__qualname__, str(exc)
        self.end(None, None, (error, message))

    def end(self, usage: dict[str, Any] | None, times: RequestTimes | None,
            error: tuple[str, str] | None = None) -> None:
        """Build every span of the request and end them at the engine's stamps (now, without them)."""
        if self.ended:
            return
        self.ended = True
        anchor = epoch_anchor_ns()

        def ns(perf_s: float) -> int:
            return anchor + round(perf_s * 1e9)

        attributes = dict(self.attributes)
        reasons = [self.finish_reasons[i] for i in sorted(self.finish_reasons)]
        if reasons:
            attributes["gen_ai.response.finish_reasons"] = reasons
        if usage is not None:
            attributes["gen_ai.usage.input_tokens"] = usage["prompt_tokens"]
            attributes["gen_ai.usage.output_tokens"] = usage["completion_tokens"]
        else:
            attributes["gen_ai.usage.output_tokens"] = self.output_tokens
        if times is not None:
            attributes.update(latency_attributes(times))
        if error is None:
            ended = [r for r in reasons if r in (FinishReason.ABORT, FinishReason.PREEMPT)]
            if ended:
                error = (ended[0], "aborted: by a reset, a drain at shutdown, or a failure of this request"
                         if ended[0] == FinishReason.ABORT else "preempted: a disaggregated request given up")
        if error is not None:
            attributes["error.type"] = error[0]
        end_ns = ns(times.finish) if times is not None else time.time_ns()
        span = self.tracer.start_span(f"{self.operation} {self.model}", context=self.parent, kind=SpanKind.SERVER,
                                      attributes=attributes, start_time=ns(self.arrival))
        if times is not None:
            self._phases(span, times, ns)
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error[1]))
        span.end(end_time=max(end_ns, ns(self.arrival)))

    def _phases(self, span: trace.Span, times: RequestTimes, ns: Callable[[float], int]) -> None:
        """The child spans: queue (and within it the server's part), prefill, decode."""
        inside = trace.set_span_in_context(span, Context())
        arrival = self.arrival
        scheduled = times.first_scheduled if times.first_scheduled is not None else times.finish
        queue = self.tracer.start_span("queue", context=inside, start_time=ns(arrival))
        self._child("preprocess", trace.set_span_in_context(queue, Context()), ns(arrival),
                    ns(max(min(times.added, scheduled), arrival)))
        queue.end(end_time=ns(max(scheduled, arrival)))
        if times.first_scheduled is None:
            return
        prefilled = times.first_token if times.first_token is not None else times.finish
        self._child("prefill", inside, ns(times.first_scheduled), ns(prefilled))
        if times.first_token is None:
            return
        span.add_event("first token", timestamp=ns(times.first_token))
        self._child("decode", inside, ns(times.first_token), ns(times.finish))

    def _child(self, name: str, parent: Context, start_ns: int, end_ns: int) -> None:
        self.tracer.start_span(name, context=parent, start_time=start_ns).end(end_time=end_ns)


def request_attributes(operation: str, body: ChatCompletionRequest | CompletionRequest,
                       generation: GenerationRequest) -> dict[str, Any]:
    """What the request asked for, by the GenAI conventions (the sampling the engine was given)."""
    sampling = generation.sampling
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": PROVIDER_NAME,
        "gen_ai.request.model": body.model,
        "gen_ai.response.model": body.model,
        # vLLM's name for it (the conventions have none): the engine's and the trace's id.
        "gen_ai.request.id": generation.request_id,
        # The reply's "id" (OpenAI's), the same id here.
        "gen_ai.response.id": generation.request_id,
        "gen_ai.request.temperature": sampling.temperature,
        "gen_ai.request.top_p": sampling.top_p,
        "gen_ai.request.stream": body.stream,
    }
    if sampling.max_tokens is not None:
        attributes["gen_ai.request.max_tokens"] = sampling.max_tokens
    if sampling.top_k > 0:
        attributes["gen_ai.request.top_k"] = sampling.top_k
    if sampling.n != 1:
        attributes["gen_ai.request.choice.count"] = sampling.n
    if sampling.seed is not None:
        attributes["gen_ai.request.seed"] = sampling.seed
    if sampling.frequency_penalty:
        attributes["gen_ai.request.frequency_penalty"] = sampling.frequency_penalty
    if sampling.presence_penalty:
        attributes["gen_ai.request.presence_penalty"] = sampling.presence_penalty
    if sampling.stop:
        attributes["gen_ai.request.stop_sequences"] = list(sampling.stop)
    return attributes


def latency_attributes(times: RequestTimes) -> dict[str, float]:
    """vLLM's ``gen_ai.latency.*`` span attributes (seconds), from the engine's stamps: the figures
    ``usage.extra`` gives (queue_time_s, ttft_s, end_to_end_latency_s), counted from the arrival."""
    out = {"gen_ai.latency.e2e": times.finish - times.arrival}
    if times.first_scheduled is not None:
        out["gen_ai.latency.time_in_queue"] = times.first_scheduled - times.arrival
    if times.first_token is not None:
        out["gen_ai.latency.time_to_first_token"] = times.first_token - times.arrival
        out["gen_ai.latency.time_in_model_decode"] = times.finish - times.first_token
        if times.first_scheduled is not None:
            out["gen_ai.latency.time_in_model_prefill"] = times.first_token - times.first_scheduled
    return out


class HeldExporterLogs(logging.Filter):
    """Holds back the exporter's log lines (one a failed attempt, one a retry) and the batch
    processor's "Queue full" after its first, keeping an export's first line (its reason) for the
    one warning."""

    def __init__(self) -> None:
        super().__init__()
        #: The first line the exporter logged since :attr:`first` was last cleared.
        self.first: str | None = None
        self.queue_full_told = False
        self._loggers = [logging.getLogger(name) for name in EXPORTER_LOGGERS]
        self._processor = logging.getLogger(PROCESSOR_LOGGER)
        for held in (*self._loggers, self._processor):
            held.addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == PROCESSOR_LOGGER:
            if not record.getMessage().startswith("Queue full"):
                return True
            told, self.queue_full_told = self.queue_full_told, True
            return not told
        if self.first is None:
            self.first = record.getMessage()
        return False

    def release(self) -> None:
        for held in (*self._loggers, self._processor):
            held.removeFilter(self)


class ReportingExporter(SpanExporter):
    """The OTLP exporter, whose failures are told once: a warning the first time an export fails,
    with the exporter's reason; nothing after (spans are dropped while the endpoint fails; the
    request path never waits on it)."""

    def __init__(self, inner: OTLPSpanExporter, endpoint: str, held: HeldExporterLogs) -> None:
        self.inner = inner
        self.endpoint = endpoint
        self.held = held
        #: The last export failed (so a shutdown does not wait for its retries).
        self.failing = False
        self.failed_batches = 0
        self._warned = False
        self._closed = False
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.held.first = None
        try:
            result = self.inner.export(spans)
        except Exception as exc:  # noqa: BLE001 - an exporter's bug must not end the processor's thread
            self.held.first = f"{type(exc).__name__}: {exc}"
            result = SpanExportResult.FAILURE
        self.failing = result is not SpanExportResult.SUCCESS
        if self.failing:
            self.failed_batches += 1
            if not self._warned:
                self._warned = True
                logger.warning("OpenTelemetry: exporting request spans to %s failed (%s); requests are served as "
                               "before, their spans are dropped while it fails. Told once.", self.endpoint,
                               self.held.first or "no reason given")
        return result

    def close(self) -> None:
        """Shut the OTLP exporter down now: a retry waiting on a failing endpoint gives up."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self.inner.shutdown()

    def shutdown(self) -> None:
        self.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)
